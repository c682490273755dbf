"""The decoder's Tree: structure helpers, pruning that always leaves a valid tree, merging."""

from __future__ import annotations

import random

import pytest
from redraft.proto import draft_pb2
from redraft.proto.tree import LEARNED, PLD, REST, SOURCE_BITS, Tree, grow, merge, trie


def random_tree(rng: random.Random, n: int) -> Tree:
    parents = [rng.randrange(-1, i) for i in range(n)]
    return Tree(rng.sample(range(1000), n), parents,  # distinct: a path names one node

                [rng.random() for _ in range(n)], [rng.choice(["pld", "rest"]) for _ in range(n)])


def test_depths_children_and_path_probs():
    t = Tree([5, 6, 7, 8], [-1, 0, 0, 2], [0.5, 0.5, 0.4, 1.0], ["pld"] * 4)
    assert t.depths() == [1, 2, 2, 3]
    assert t.children() == [[0], [1, 2], [], [3], []]
    assert t.path_probs() == pytest.approx([0.5, 0.25, 0.2, 0.2])
    assert t.expected_accepted == pytest.approx(1.15)


@pytest.mark.parametrize("seed", range(20))
def test_prune_keeps_a_valid_tree_of_the_best_paths(seed):
    rng = random.Random(seed)
    t = random_tree(rng, rng.randrange(1, 40))
    for budget in (0, 1, 3, 10, 100):
        p = t.prune(budget)
        p.validate()
        assert len(p) == min(budget, len(t))
        # every kept path exists in the original tree, with its probability
        orig = {tuple(path): pp for path, pp in zip(paths(t), t.path_probs())}
        kept = list(zip(paths(p), p.path_probs()))
        for path, pp in kept:
            assert orig[tuple(path)] == pytest.approx(pp)
        # nothing dropped is better than the worst kept node
        if kept and len(p) < len(t):
            worst = min(pp for _, pp in kept)
            dropped = [v for k, v in orig.items() if k not in {tuple(q) for q, _ in kept}]
            assert max(dropped) <= worst + 1e-12


def paths(t: Tree) -> list[list[int]]:
    out: list[list[int]] = []
    for tok, parent in zip(t.tokens, t.parents):
        out.append(([] if parent < 0 else out[parent]) + [tok])
    return out


def test_merge_shares_prefixes_and_keeps_the_higher_prob():
    a = Tree([1, 2, 3], [-1, 0, 1], [0.5, 0.5, 0.5], ["pld"] * 3)
    b = Tree([1, 2, 4], [-1, 0, 1], [0.9, 0.2, 0.7], ["rest"] * 3)
    m = merge([a, b])
    m.validate()
    assert sorted(map(tuple, paths(m))) == [(1,), (1, 2), (1, 2, 3), (1, 2, 4)]
    got = {tuple(path): (p, s) for path, p, s in zip(paths(m), m.probs, m.sources)}
    assert got == {(1,): (0.9, "pld+rest"), (1, 2): (0.5, "pld+rest"),
                   (1, 2, 3): (0.5, "pld"), (1, 2, 4): (0.7, "rest")}
    # best first: every prefix of the arrays is a tree of the best paths
    assert m.path_probs() == sorted(m.path_probs(), reverse=True)


def test_validate_rejects_bad_trees():
    with pytest.raises(ValueError, match="parents must come first"):
        Tree([1, 2], [1, -1], [0.5, 0.5], ["pld"] * 2).validate()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tree([70], [-1], [0.5], ["pld"]).validate(vocab_size=64)
    with pytest.raises(ValueError, match="differ in length"):
        Tree([1], [-1], [], []).validate()  # a missing probability is never made up
    with pytest.raises(ValueError, match="outside \\[0, 1\\]"):
        Tree([1], [-1], [float("nan")], ["pld"]).validate()


def test_trie_shares_prefixes_and_sums_weights():
    t = trie([([1, 2, 3], 2.0, 1), ([1, 2, 4], 1.0, 5), ([7], 3.0, 2)])
    assert t.tokens == [1, 2, 3, 4, 7]
    assert t.parents == [-1, 0, 1, 1, -1]
    assert t.depth == [0, 1, 2, 2, 0]
    assert t.weight == [3.0, 3.0, 2.0, 1.0, 3.0]
    assert t.best == [5, 5, 1, 5, 2]


def test_grow_yields_the_most_probable_nodes_parents_first():
    children = {None: [("a", 0.6), ("b", 0.4)], "a": [("c", 0.9), ("d", 0.1)], "b": [("e", 1.0)]}

    def expand(label, depth, path):
        return children.get(label, []) if depth < 2 else []

    parents, labels, probs, depths = grow(expand, None, 4)
    assert labels == ["a", "c", "b", "e"]  # path probabilities 0.6, 0.54, 0.4, 0.4
    assert parents == [-1, 0, -1, 2] and depths == [1, 2, 1, 2]
    assert probs == [0.6, 0.9, 0.4, 1.0]
    assert grow(expand, None, 0) == ([], [], [], [])


def test_the_wire_enum_holds_the_source_bits():
    """SOURCE_BITS is the one definition (the compiled core is given it at import); the proto,
    which cannot import it, must hold the same values, each a single bit."""
    wire = {REST: draft_pb2.SOURCE_REST, PLD: draft_pb2.SOURCE_PLD,
            LEARNED: draft_pb2.SOURCE_LEARNED}
    assert wire == SOURCE_BITS
    assert sorted(draft_pb2.Source.values()) == [0, *sorted(SOURCE_BITS.values())]
    assert all(bit & (bit - 1) == 0 for bit in SOURCE_BITS.values())
