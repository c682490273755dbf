"""The one candidate-tree type: what every drafter returns and the decoder verifies.

Flat arrays as in the README: `parents[i] == -1` means node i follows the context's last
token, parents come before children, `probs[i]` is the estimated probability that node i is
accepted given that its parent was, `sources[i]` names who proposed it ("rest", "pld", or
several joined by "+" where sources agreed). The decoder uses this type as `Tree`; the service
converts it 1:1 to the proto `Tree`. Flat arrays let the verifier build its mask and
positions with no pointer chasing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

REST = "rest"
PLD = "pld"

# On the wire (proto enum redraft.v1.Source) each source is one bit, and a node that several
# sources proposed carries their OR (REST | PLD = 3 is "pld+rest").
SOURCE_BITS = {REST: 1, PLD: 2}


def source_bits(label: str) -> int:
    """Wire value of a source label ("pld+rest" -> 3); unknown names contribute nothing."""
    return sum(SOURCE_BITS.get(s, 0) for s in set(label.split("+")))


def source_label(bits: int) -> str:
    """Source label of a wire value (3 -> "pld+rest"; 0 or unknown bits -> "unknown")."""
    names = sorted(name for name, bit in SOURCE_BITS.items() if bits & bit)
    return "+".join(names) or "unknown"


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
    """Probability that each node is accepted: the product of probs along its path."""
    return path_and_depth(probs, parents)[0][:-1]


def best_first(path: Sequence[float], depth: Sequence[int], n: int) -> list[int]:
    """Node indices by path probability descending, then depth, then index.

    Path probabilities never grow along a path (probs <= 1), so this order puts every parent
    before its children and any prefix of it is a tree. Two sorts of plain indices by one key
    each (the second stable; `reverse` keeps ties in order) avoid building a tuple per node.
    """
    order = sorted(range(n), key=depth.__getitem__)
    order.sort(key=path.__getitem__, reverse=True)
    return order


def take_top(tokens: list[int], parents: list[int], probs: list[float], sources: list[str],
             path: list[float], depth: list[int], budget: int, match_len: int) -> Draft:
    """The `budget` best nodes of a tree given as arrays with path probs and depths, best first.

    `path` and `depth` may have extra trailing entries. A node whose parent was not kept
    (possible only when a prob above 1 put a child before its parent) is dropped.
    """
    new_id = [-2] * len(tokens) + [-1]  # new_id[-1] == -1: a root's parent stays -1
    kept: list[int] = []
    kept_parents: list[int] = []
    for i in best_first(path, depth, len(tokens))[: max(budget, 0)]:
        parent = new_id[parents[i]]
        if parent == -2:
            continue
        new_id[i] = len(kept)
        kept.append(i)
        kept_parents.append(parent)
    return Draft(
        tokens=[tokens[i] for i in kept],
        parents=kept_parents,
        probs=[float(probs[i]) for i in kept],
        sources=[sources[i] for i in kept],
        match_len=match_len,
    )


@dataclass
class Draft:
    """A draft tree. Every node is a guess for one future token."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    match_len: int = 0  # length of the context suffix the drafter matched (0 = none)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int], prob: float = 0.5, source: str = "unknown") -> Draft:
        """A single path (what a linear drafter such as HF prompt lookup proposes)."""
        n = len(tokens)
        return cls(list(tokens), list(range(-1, n - 1)), [prob] * n, [source] * n)

    # -- structure ---------------------------------------------------------------------

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError unless the arrays form a tree in the documented order.

        A tree without a probability (or source) for every node is invalid: nothing is
        filled in, because a made-up probability would mislead the budget.
        """
        n = len(self.tokens)
        if not (len(self.parents) == len(self.probs) == len(self.sources) == n):
            raise ValueError("tree arrays differ in length")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first")
        for p in self.probs:
            if not 0.0 <= p <= 1.0 + 1e-6:  # also rejects NaN
                raise ValueError(f"node probability {p} outside [0, 1]")
        if vocab_size is not None:
            for t in self.tokens:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"token id {t} outside the vocabulary (size {vocab_size})")

    def depths(self) -> list[int]:
        """Depth of each node; children of the root (parent -1) have depth 1."""
        return [d + 1 for d in path_and_depth(self.probs, self.parents)[1][:-1]]

    def children(self) -> list[list[int]]:
        """children()[0] lists the root's children; children()[i + 1] lists node i's."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            out[parent + 1].append(i)
        return out

    def path_probs(self) -> list[float]:
        """P(node accepted): the product of the conditional probs along its path."""
        return path_probs(self.probs, self.parents)

    @property
    def expected_accepted(self) -> float:
        """Expected number of accepted draft tokens (before the bonus token)."""
        return float(sum(self.path_probs()))

    def subset(self, keep: Iterable[int]) -> Draft:
        """The sub-tree made of `keep` (must be closed under taking parents), order preserved."""
        keep = sorted(set(keep))
        remap = {old: new for new, old in enumerate(keep)}
        parents = []
        for old in keep:
            parent = self.parents[old]
            if parent >= 0 and parent not in remap:
                raise ValueError(f"node {old} kept without its parent {parent}")
            parents.append(-1 if parent < 0 else remap[parent])
        return Draft([self.tokens[i] for i in keep], parents, [self.probs[i] for i in keep],
                     [self.sources[i] for i in keep], self.match_len)

    def best_nodes(self) -> list[int]:
        """Node indices ordered by path probability, best first, each after its parent.

        Any prefix of this order is a valid sub-tree, which is what lets the budget logic
        cut a tree at any size. (Nodes left orphaned by a prob above 1 come last.)
        """
        path, depth = path_and_depth(self.probs, self.parents)
        order = best_first(path, depth, len(self))
        placed: set[int] = set()
        out: list[int] = []
        while order:
            rest = []
            for i in order:
                if self.parents[i] < 0 or self.parents[i] in placed:
                    placed.add(i)
                    out.append(i)
                else:
                    rest.append(i)
            order = rest
        return out

    def prune(self, budget: int) -> Draft:
        """The `budget` nodes with the highest path probability, best first (a valid tree)."""
        if budget >= len(self):
            return self
        path, depth = path_and_depth(self.probs, self.parents)
        return take_top(self.tokens, self.parents, self.probs, self.sources, path, depth,
                        budget, self.match_len)

    def limit_depth(self, max_depth: int) -> Draft:
        """Drop nodes deeper than max_depth."""
        depth = self.depths()
        if not depth or max(depth) <= max_depth:
            return self
        return self.subset(i for i, d in enumerate(depth) if d <= max_depth)
