"""The decoder's candidate tree: flat arrays, converted 1:1 from a datastore Draft or proto Tree.

`parents[i] == -1` means node i follows the context's last token, parents come before their
children, and `probs[i]` estimates P(node i accepted | its parent accepted). Keeping the
arrays flat means the verifier can build its mask and positions with no pointer chasing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from redraft.datastore.draft import path_probs

# Proto enum values of redraft.v1.Source, kept here so the decoder need not import the stubs
# just to name a source.
_PROTO_SOURCE_NAMES = {0: "unknown", 1: "rest", 2: "pld"}


@dataclass
class Tree:
    """A draft tree. Every node is a guess for one future token."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    # -- conversions -------------------------------------------------------------------

    @classmethod
    def from_draft(cls, draft) -> Tree:
        """Convert a `redraft.datastore.draft.Draft` (duck-typed: same field names)."""
        n = len(draft.tokens)
        probs = list(draft.probs) if len(draft.probs) == n else [0.5] * n
        sources = list(draft.sources) if len(draft.sources) == n else ["unknown"] * n
        return cls([int(t) for t in draft.tokens], [int(p) for p in draft.parents],
                   [float(p) for p in probs], [str(s) for s in sources])

    @classmethod
    def from_proto(cls, msg) -> Tree:
        """Convert a `redraft.v1.Tree` message."""
        n = len(msg.tokens)
        probs = list(msg.probs) if len(msg.probs) == n else [0.5] * n
        sources = (
            [_PROTO_SOURCE_NAMES.get(int(s), "unknown") for s in msg.sources]
            if len(msg.sources) == n
            else ["unknown"] * n
        )
        return cls(list(msg.tokens), list(msg.parents), [float(p) for p in probs], sources)

    @classmethod
    def chain(cls, tokens: Sequence[int], prob: float = 0.5, source: str = "unknown") -> Tree:
        """A single path (what a linear drafter such as HF prompt lookup proposes)."""
        n = len(tokens)
        return cls(list(tokens), list(range(-1, n - 1)), [prob] * n, [source] * n)

    # -- structure ---------------------------------------------------------------------

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError unless the arrays form a tree in the documented order."""
        n = len(self.tokens)
        if not (len(self.parents) == len(self.probs) == len(self.sources) == n):
            raise ValueError("tree arrays differ in length")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first")
        if vocab_size is not None:
            for t in self.tokens:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"token id {t} outside the vocabulary (size {vocab_size})")

    def depths(self) -> list[int]:
        """Depth of each node; children of the root (parent -1) have depth 1."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

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
        return float(sum(self.path_probs()))

    def subset(self, keep: Iterable[int]) -> Tree:
        """The sub-tree made of `keep` (must be closed under taking parents), order preserved."""
        keep = sorted(set(keep))
        remap = {old: new for new, old in enumerate(keep)}
        parents = []
        for old in keep:
            parent = self.parents[old]
            if parent >= 0 and parent not in remap:
                raise ValueError(f"node {old} kept without its parent {parent}")
            parents.append(-1 if parent < 0 else remap[parent])
        return Tree(
            [self.tokens[i] for i in keep],
            parents,
            [self.probs[i] for i in keep],
            [self.sources[i] for i in keep],
        )

    def best_nodes(self) -> list[int]:
        """Node indices ordered by path probability, best first, each after its parent.

        Any prefix of this order is a valid sub-tree, which is what lets the budget logic
        cut a tree at any size. Path probabilities never grow along a path, so sorting by
        (-path_prob, depth, index) already puts parents first; the fix-up loop below only
        matters for ties or probs above 1.
        """
        pp = self.path_probs()
        depth = self.depths()
        order = sorted(range(len(self)), key=lambda i: (-pp[i], depth[i], i))
        placed: set[int] = set()
        out: list[int] = []
        pending = list(order)
        while pending:
            rest = []
            for i in pending:
                parent = self.parents[i]
                if parent < 0 or parent in placed:
                    placed.add(i)
                    out.append(i)
                else:
                    rest.append(i)
            pending = rest
        return out

    def prune(self, budget: int) -> Tree:
        """The `budget` nodes with the highest path probability (a valid sub-tree)."""
        if budget >= len(self):
            return self
        return self.subset(self.best_nodes()[: max(budget, 0)])

    def limit_depth(self, max_depth: int) -> Tree:
        """Drop nodes deeper than max_depth."""
        depth = self.depths()
        if not depth or max(depth) <= max_depth:
            return self
        return self.subset(i for i, d in enumerate(depth) if d <= max_depth)


def merge(trees: Sequence[Tree]) -> Tree:
    """Union of several trees as one trie: identical paths are shared, not duplicated.

    A node drafted by several sources keeps the highest conditional probability and is
    labelled with all of them (e.g. "pld+rest"): two independent sources agreeing is a
    different, usually much better, bet than either alone, and the decoder calibrates each
    label separately from what the target accepts.
    """
    out = Tree()
    index: dict[tuple[int, int], int] = {}  # (parent in out, token) -> node in out
    for tree in trees:
        mapping: list[int] = []
        for tok, parent, p, src in zip(tree.tokens, tree.parents, tree.probs, tree.sources):
            new_parent = -1 if parent < 0 else mapping[parent]
            key = (new_parent, tok)
            node = index.get(key)
            if node is None:
                node = len(out.tokens)
                index[key] = node
                out.tokens.append(tok)
                out.parents.append(new_parent)
                out.probs.append(p)
                out.sources.append(src)
            else:
                out.probs[node] = max(out.probs[node], p)
                labels = set(out.sources[node].split("+")) | set(src.split("+"))
                out.sources[node] = "+".join(sorted(labels))
            mapping.append(node)
    return out
