"""The Medusa tree's shape: which guess of which head each node takes, from the heads'
held-out accuracies.

A node is a path of ranks (r_1, ..., r_d), meaning "head 1's r_1-th guess, then head 2's
r_2-th guess, ...". Taking the heads as independent, the node is accepted with probability
prod_i acc_i(r_i), where acc_k(r) is head k's measured held-out accuracy at rank r exactly.
The tree that maximises the expected accepted length for n nodes takes the n most probable
nodes, and since a child is never more probable than its parent, a best-first search yields
them parents first: every prefix is itself the best smaller tree, which is what lets the
budget cut it at any size. The shape is fixed per heads file; each step only fills it with
the heads' current top-k tokens (the `medusa` drafter). Training uses it too, to choose the
projection a heads file recommends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redraft.proto.tree import grow

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

    def expand(_rank: int | None, depth: int, _path: float) -> list[tuple[int, float]]:
        if depth >= depth_limit:
            return []
        return [(r, p) for r, p in enumerate(per_rank[depth]) if p > 0]

    parents, ranks, probs, depths = grow(expand, None, size)
    return TreeShape(parents, depths, ranks, probs)
