"""`medusa`: a sparse tree of the heads' top-k guesses, shaped by their accuracies.

The tree's shape (which guess of which head each node takes) is fixed per heads file
(`redraft.decoder.heads.tree_shape`); each step only fills it with the heads' current top-k
tokens for the hidden state the loop hands over.

Each node's probability is acc_d(r_d) (P(accepted | parent accepted) under independence),
labelled `medusa`, so the calibrator corrects it from what the target really accepts and
the budget sizes the tree like any other source's.
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.decoder.drafter import Drafter
from redraft.decoder.heads.blocks import PROJECTIONS, MedusaHeads
from redraft.decoder.heads.committed import default_heads_path
from redraft.decoder.heads.heads_file import HeadsError, build_heads, read_heads
from redraft.decoder.heads.predictor import HeadsPredictor
from redraft.decoder.heads.tree_shape import MAX_TREE, sparse_tree
from redraft.proto.tree import Tree

SOURCE = "medusa"


class MedusaDrafter(Drafter):
    """Drafts from Medusa heads on the hidden state the decoding loop hands over.

    The loop calls `observe_hidden(context, hidden)` after every step with the final hidden
    state of the row whose prediction is `context[-1]`; head k then guesses the token k
    places after `context[-1]`, i.e. the tree's depth-k nodes. No extra target forward.
    """

    name = SOURCE
    hidden_wanted = True

    def __init__(self, heads: MedusaHeads, model, projection: str | None = None,
                 max_depth: int | None = None) -> None:
        projection = projection or heads.meta.get("projection", "full")
        accuracy = heads.accuracy(projection)
        if not accuracy:
            raise HeadsError(f"the heads file records no held-out accuracy for the {projection} "
                             "projection (needed to shape the tree)")
        self.predictor = HeadsPredictor(heads, model, projection)
        width = self.predictor.width  # no head has more guesses than projection rows
        self.shape = sparse_tree([row[:width] for row in accuracy], MAX_TREE, max_depth)
        if not len(self.shape):
            raise HeadsError(f"the heads file records no accuracy above 0 for the first head "
                             f"({projection} projection): no tree to draft")
        self._hidden = None
        self._context_len = -1

    def begin(self, prompt: Sequence[int]) -> None:
        self._hidden, self._context_len = None, -1

    def observe_hidden(self, context: Sequence[int], hidden) -> None:
        self._hidden, self._context_len = hidden, len(context)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        if self._hidden is None or self._context_len != len(context) or budget <= 0:
            return Tree()  # the first step has no hidden state yet
        n = min(budget, len(self.shape))
        ids, _ = self.predictor.topk(self._hidden, max(self.shape.rank[:n]) + 1, context[-1])
        s = self.shape
        tokens = [int(ids[s.depth[i] - 1, s.rank[i]]) for i in range(n)]
        return Tree(tokens, s.parents[:n], s.probs[:n], [SOURCE] * n)


def make(ctx) -> MedusaDrafter:
    """Heads from `--medusa-heads FILE`, else the committed heads of the model. The file is
    read and checked (a missing, damaged or tampered one refused) before the model loads;
    heads trained for another model are refused once it has."""
    projection = ctx.option("medusa_projection")
    if projection not in (None, *PROJECTIONS):
        raise HeadsError(f"--medusa-projection must be full or subset, got {projection!r}")
    path = ctx.option("medusa_heads") or default_heads_path(ctx.model_name)
    if path is None:
        raise HeadsError(f"no Medusa heads for model {ctx.model_name!r}: train them with "
                         "`redraft train-medusa` and pass --medusa-heads FILE")
    checked = read_heads(path)  # every check that needs no model, before it loads
    model = ctx.model
    return MedusaDrafter(build_heads(checked, model), model, projection,
                         max_depth=ctx.max_depth)
