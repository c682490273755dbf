"""The datastore side's candidate tree: what `Reader.propose` and prompt lookup return.

Flat arrays as in DESIGN.md: `parents[i] == -1` means node i follows the context's last
token, parents come before children, `probs[i]` is the estimated probability that node i is
accepted given that its parent was. The service converts it 1:1 to the proto `Tree`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

REST = "rest"
PLD = "pld"


def path_and_depth(probs: Sequence[float], parents: Sequence[int]
                   ) -> tuple[list[float], list[int]]:
    """Path probability and depth of each node, each list with one extra last entry.

    The extra entries (path 1.0, depth -1) stand for the roots' parent, so that index -1 needs
    no branch in this per-node loop: 1.0 * p == p exactly, -1 + 1 == 0.
    """
    n = len(parents)
    path = [1.0] * (n + 1)
    depth = [-1] * (n + 1)
    for i, (prob, parent) in enumerate(zip(probs, parents)):
        path[i] = path[parent] * prob
        depth[i] = depth[parent] + 1
    return path, depth


def path_probs(probs: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Probability that each node is accepted: the product of probs along its path.

    Shared by the datastore's `Draft` and the decoder's `Tree`, which keep the same arrays.
    """
    return path_and_depth(probs, parents)[0][:-1]


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # REST or PLD, one per node
    match_len: int = 0  # length of the context suffix the drafter matched (0 = none)

    def __len__(self) -> int:
        return len(self.tokens)

    def path_probs(self) -> list[float]:
        """Probability that each node is accepted: the product of probs along its path."""
        return path_probs(self.probs, self.parents)

    @property
    def expected_accepted(self) -> float:
        """Expected number of accepted draft tokens (before the bonus token)."""
        return float(sum(self.path_probs()))

    def validate(self) -> None:
        """Raise ValueError if the arrays do not form a tree in the documented order."""
        n = len(self.tokens)
        if not (len(self.parents) == len(self.probs) == len(self.sources) == n):
            raise ValueError("draft arrays differ in length")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first")
