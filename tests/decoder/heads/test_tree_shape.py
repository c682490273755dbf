"""The Medusa tree's shape from the heads' accuracies: the best rank paths, parents first."""

from __future__ import annotations

import itertools

import pytest
from redraft.decoder.heads.tree_shape import rank_accuracy, sparse_tree
from redraft.proto.tree import Tree

ACC = [[0.6, 0.75, 0.82, 0.86], [0.4, 0.55, 0.62, 0.66], [0.3, 0.42, 0.5, 0.55]]

def test_rank_accuracy_is_the_difference_of_cumulative_accuracies():
    assert rank_accuracy([[0.5, 0.7, 0.7, 0.8]])[0] == pytest.approx([0.5, 0.2, 0.0, 0.1])


def test_sparse_tree_is_the_best_n_rank_paths_parents_first():
    shape = sparse_tree(ACC, 20)
    per_rank = rank_accuracy(ACC)
    # brute force: every rank path up to depth 3, by probability
    paths = []
    for d in range(1, 4):
        for ranks in itertools.product(range(4), repeat=d):
            p = 1.0
            for depth, r in enumerate(ranks):
                p *= per_rank[depth][r]
            paths.append(p)
    best = sorted(paths, reverse=True)[:20]
    tree = Tree([0] * len(shape), shape.parents, shape.probs, ["medusa"] * len(shape))
    assert sorted(tree.path_probs(), reverse=True) == pytest.approx(best)
    assert all(p < i for i, p in enumerate(shape.parents))
    pp = tree.path_probs()
    assert all(a >= b - 1e-12 for a, b in zip(pp, pp[1:]))  # best first: prefixes are trees
    assert shape.depth == [d + 1 for d in (x - 1 for x in tree.depths())]
    assert sparse_tree(ACC, 20, max_depth=1).depth == [1, 1, 1, 1]
