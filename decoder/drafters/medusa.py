"""`medusa`: a sparse tree of the heads' top-k guesses, shaped by their accuracies.

Medusa's tree construction: a node is a path of ranks (r_1, ..., r_d), meaning "head 1's
r_1-th guess, then head 2's r_2-th guess, ...". Taking the heads as independent, the node is
accepted with probability prod_i acc_i(r_i), where acc_k(r) is head k's measured held-out
accuracy at rank r exactly. The tree that maximises the expected accepted length for n nodes
takes the n most probable nodes, and since a child is never more probable than its parent,
a best-first search yields them parents first: every prefix is itself the best smaller
tree, which is what lets the budget cut it at any size. The shape is fixed per heads file;
each step only fills it with the heads' current top-k tokens.

Each node's probability is acc_d(r_d) (P(accepted | parent accepted) under independence),
labelled `medusa`, so the calibrator corrects it from what the target really accepts and
the budget sizes the tree like any other source's.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from redraft.decoder.drafters.base import Drafter
from redraft.decoder.medusa import PROJECTIONS, HeadsError, HeadsPredictor, MedusaHeads
from redraft.proto.tree import Tree

SOURCE = "medusa"
MAX_TREE = 64  # nodes in the static tree; no cost curve on any device verifies more


@dataclass
class TreeShape:
    """A sparse tree of rank paths: node i takes head depth[i]'s rank[i]-th guess."""

    parents: list[int]
    depth: list[int]  # 1 = head 1
    rank: list[int]  # 0 = the head's top guess
    probs: list[float]  # acc_depth(rank): P(node accepted | parent accepted)

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def max_rank(self) -> int:
        return max(self.rank, default=-1) + 1


def rank_accuracy(cumulative: Sequence[Sequence[float]]) -> list[list[float]]:
    """Per head, P(the label is the guess at rank r exactly) from top-1..top-n accuracies."""
    out = []
    for row in cumulative:
        prev, ranks = 0.0, []
        for acc in row:
            ranks.append(max(float(acc) - prev, 0.0))
            prev = max(prev, float(acc))
        out.append(ranks)
    return out


def sparse_tree(cumulative: Sequence[Sequence[float]], size: int = MAX_TREE,
                max_depth: int | None = None) -> TreeShape:
    """The `size` most probable rank paths, best first (Medusa's greedy construction)."""
    per_rank = rank_accuracy(cumulative)
    depth_limit = len(per_rank) if max_depth is None else min(len(per_rank), max_depth)
    shape = TreeShape([], [], [], [])
    heap: list[tuple[float, int, int, int, float]] = []  # (-path prob, tie, parent, rank, p)
    tie = 0

    def push_children(parent: int, path: float, depth: int) -> None:
        nonlocal tie
        if depth >= depth_limit:
            return
        for r, p in enumerate(per_rank[depth]):
            if p > 0:
                heapq.heappush(heap, (-path * p, tie, parent, r, p))
                tie += 1

    push_children(-1, 1.0, 0)
    while heap and len(shape) < size:
        neg, _, parent, r, p = heapq.heappop(heap)
        d = 1 if parent < 0 else shape.depth[parent] + 1
        shape.parents.append(parent)
        shape.depth.append(d)
        shape.rank.append(r)
        shape.probs.append(p)
        push_children(len(shape) - 1, -neg, d)
    return shape


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
    read (and a missing or damaged one refused) before the model loads; heads trained for
    another model are refused once it has."""
    from redraft.decoder.medusa import default_heads_path, load_heads, read_meta

    projection = ctx.option("medusa_projection")
    if projection not in (None, *PROJECTIONS):
        raise HeadsError(f"--medusa-projection must be full or subset, got {projection!r}")
    path = ctx.option("medusa_heads") or default_heads_path(ctx.model_name)
    if path is None:
        raise HeadsError(f"no Medusa heads for model {ctx.model_name!r}: train them with "
                         "`redraft train-medusa` and pass --medusa-heads FILE")
    read_meta(path)
    model = ctx.model
    return MedusaDrafter(load_heads(path, model), model, projection, max_depth=ctx.max_depth)
