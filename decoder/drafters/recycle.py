"""`recycle`: token recycling, the target's own earlier top-k predictions per token."""

from __future__ import annotations

from collections.abc import Sequence

from redraft.decoder.drafters.base import DEFAULT_MAX_DEPTH, Drafter
from redraft.proto.tree import Tree


class RecycleDrafter(Drafter):
    """Token recycling: drafts from the target's own top-k predictions seen after each token.

    The table is kept across generations (it is what this model says, not what a prompt
    says), so one drafter should serve one model.
    """

    name = "recycle"

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, k: int = 8) -> None:
        from redraft.decoder.recycle import CandidateTable

        self.max_depth = max_depth
        self.candidates_wanted = k
        self.table = CandidateTable(k)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        return self.table.draft(int(context[-1]), budget, self.max_depth)

    def observe(self, context: Sequence[int], tree: Tree, ids, probs) -> None:
        self.table.record([int(context[-1]), *tree.tokens], ids, probs)


def make(ctx) -> RecycleDrafter:
    return RecycleDrafter(max_depth=ctx.max_depth)
