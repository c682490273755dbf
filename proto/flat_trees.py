"""Many draft trees as one value of flat arrays, `FlatTrees`: what a batched step drafts
(`redraft.datastore.drafting.batch_step.BatchStep` is one), what the batched RPC packs and
unpacks (`redraft.datastore.service.wire.BatchResults` holds one) and what the engines read a
sequence's tree or chain from.

Row i's nodes are [offsets[i], offsets[i + 1]) of `tokens`, `parents` (within the row's
tree, -1 for a root), `probs` and `bits` (the wire's source bits, `tree.SOURCE_BITS`); the
per-row figures are `match_lens` (rows x 3: the matched suffix of the retrieval, of prompt
lookup and of the learned outputs) and `expected` (the tree's expected accepted tokens).
A row that drafted nothing (or failed) has no nodes and zero figures.

Why one value: a row as a `Tree` (or a `Chain`) is made here once, from bits to labels by
one table look-up per node, instead of in each of the stages that hold a batch; and a
per-row figure rides along with the nodes instead of being threaded through each of them.
The arrays are not copied or converted: dtypes are the producer's (the core's uint32
tokens, int32 parents, float32 or float64 probs, uint8 bits; the wire's little-endian
views).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from redraft.proto.tree import SOURCE_LABELS, Chain, Tree, source_bits

# The per-row match lengths' columns.
MATCH_COLUMNS = ("rest", "pld", "learned")


@dataclass
class FlatTrees:
    """Trees concatenated row by row (module docstring)."""

    offsets: np.ndarray  # int64, one more entry than rows
    tokens: np.ndarray  # uint32
    parents: np.ndarray  # int32, within each row's tree
    probs: np.ndarray  # float32 or float64
    bits: np.ndarray  # uint8 source bits
    match_lens: np.ndarray  # int64 (rows, 3): rest, pld, learned
    expected: np.ndarray  # float64 per row: the tree's expected accepted tokens

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sizes(self) -> np.ndarray:
        """Each row's node count."""
        return np.diff(self.offsets)

    def row_bits(self) -> np.ndarray:
        """Each row's source bits ORed over its nodes (uint8; 0 for a row without nodes)."""
        out = np.zeros(len(self), np.uint8)
        full = np.flatnonzero(self.sizes())
        if len(full):  # a row's nodes run to the next non-empty row's first
            out[full] = np.bitwise_or.reduceat(self.bits.astype(np.uint8, copy=False),
                                               self.offsets[full])
        return out

    def tree(self, i: int) -> Tree:
        """Row i as a Tree (its match_len the retrieval's; empty if it drafted nothing)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Tree(self.tokens[a:b].tolist(), self.parents[a:b].tolist(),
                    self.probs[a:b].tolist(),
                    [SOURCE_LABELS[x & 7] for x in self.bits[a:b].tolist()],
                    int(self.match_lens[i, 0]))

    def chain(self, i: int) -> Chain:
        """Row i's nodes in order as a Chain (what a row drafted as a best chain is; of a
        tree, its nodes in the tree's order)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Chain(self.tokens[a:b].tolist(), self.probs[a:b].tolist(),
                     [SOURCE_LABELS[x & 7] for x in self.bits[a:b].tolist()])

    def row_tokens(self, i: int) -> list[int]:
        """Row i's tokens, in order."""
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])].tolist()

    @classmethod
    def of_trees(cls, trees: Sequence[Tree], match_lens: np.ndarray | None = None
                 ) -> FlatTrees:
        """`trees` as rows (probs float64; `match_lens` (rows, 3), else each tree's
        match_len as the retrieval's and zeros)."""
        offsets = np.zeros(len(trees) + 1, np.int64)
        np.cumsum([len(t) for t in trees], out=offsets[1:])
        if match_lens is None:
            match_lens = np.zeros((len(trees), 3), np.int64)
            match_lens[:, 0] = [t.match_len for t in trees]
        return cls(
            offsets,
            np.array([x for t in trees for x in t.tokens], np.uint32),
            np.array([x for t in trees for x in t.parents], np.int32),
            np.array([x for t in trees for x in t.probs], np.float64),
            np.array([source_bits(s) for t in trees for s in t.sources], np.uint8),
            np.asarray(match_lens, np.int64).reshape(len(trees), 3),
            np.array([t.expected_accepted for t in trees], np.float64))

    def joined(self, other: FlatTrees) -> FlatTrees:
        """Both values' rows as one value, `other`'s after this one's."""
        return FlatTrees(
            np.concatenate([self.offsets, other.offsets[1:] + self.offsets[-1]]),
            np.concatenate([self.tokens, other.tokens]),
            np.concatenate([self.parents, other.parents]),
            np.concatenate([self.probs, other.probs]),
            np.concatenate([self.bits, other.bits]),
            np.concatenate([self.match_lens, other.match_lens]),
            np.concatenate([self.expected, other.expected]))
