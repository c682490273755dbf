"""The flat-trees value: a row as a Tree and as a Chain, trees in and out unchanged, rows
joined, the per-row figures riding along."""

from __future__ import annotations

import numpy as np
from redraft.proto.flat_trees import FlatTrees
from redraft.proto.tree import SOURCE_LABELS, Chain, Tree, best_chain

TREES = [
    Tree([5, 6, 7], [-1, 0, 0], [0.5, 0.25, 0.75], ["rest", "pld+rest", "learned"], 3),
    Tree(),
    Tree([9], [-1], [1.0], ["pld"], 0),
    Tree([1, 2, 3, 4], [-1, 0, 1, -1], [0.5, 0.5, 0.5, 0.125],
         ["rest", "learned+pld+rest", "rest", "learned+pld"], 7),
]


def test_trees_come_back_as_they_went_in():
    flat = FlatTrees.of_trees(TREES)
    assert len(flat) == len(TREES)
    assert flat.sizes().tolist() == [3, 0, 1, 4]
    assert [flat.tree(i) for i in range(len(flat))] == TREES
    assert flat.match_lens.tolist() == [[3, 0, 0], [0, 0, 0], [0, 0, 0], [7, 0, 0]]
    assert flat.expected.tolist() == [t.expected_accepted for t in TREES]
    assert flat.bits.tolist() == [1, 3, 4, 2, 1, 7, 1, 6]
    assert flat.row_bits().tolist() == [7, 0, 2, 7]
    assert FlatTrees.of_trees([]).row_bits().tolist() == []
    assert FlatTrees.of_trees([Tree(), Tree()]).row_bits().tolist() == [0, 0]


def test_a_rows_figures_ride_along():
    mls = np.array([[3, 1, 2], [0, 0, 0], [0, 4, 0], [7, 0, 5]])
    flat = FlatTrees.of_trees(TREES, mls)
    assert flat.match_lens.tolist() == mls.tolist()
    assert flat.tree(3).match_len == 7  # a Tree's match_len is the retrieval's


def test_a_row_as_a_chain_is_its_nodes_in_order():
    chains = [best_chain(t, 8) for t in TREES]
    flat = FlatTrees.of_trees([c.tree() for c in chains])
    assert [flat.chain(i) for i in range(len(flat))] == chains
    assert flat.chain(1) == Chain()
    assert [flat.row_tokens(i) for i in range(len(flat))] == [c.tokens for c in chains]


def test_joined_rows_follow_each_other():
    a = FlatTrees.of_trees(TREES[:2], np.array([[3, 1, 1], [0, 0, 0]]))
    b = FlatTrees.of_trees(TREES[2:], np.array([[0, 2, 0], [7, 0, 3]]))
    both = a.joined(b)
    assert [both.tree(i) for i in range(len(both))] == TREES
    assert both.offsets.tolist() == [0, 3, 3, 4, 8]
    assert both.match_lens.tolist() == [[3, 1, 1], [0, 0, 0], [0, 2, 0], [7, 0, 3]]


def test_the_wires_arrays_are_read_as_they_are():
    """Little-endian views of packed bytes (the batched reply's), float32 probs: a row's
    Tree holds Python values, labels from the one table."""
    flat = FlatTrees(np.array([0, 2], np.int64), np.frombuffer(b"\x05\0\0\0\x06\0\0\0", "<u4"),
                     np.array([-1, 0], "<i4"), np.array([0.5, 0.25], "<f4"),
                     np.array([1, 6], np.uint8), np.array([[4, 0, 2]]), np.array([0.625]))
    tree = flat.tree(0)
    assert tree == Tree([5, 6], [-1, 0], [0.5, 0.25], ["rest", SOURCE_LABELS[6]], 4)
    assert all(type(x) is int for x in tree.tokens + tree.parents)
    assert all(type(p) is float for p in tree.probs)
    assert flat.chain(0) == Chain([5, 6], [0.5, 0.25], ["rest", "learned+pld"])
