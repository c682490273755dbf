"""The best chain of a draft tree: the path with the most expected accepted tokens."""

from __future__ import annotations

import itertools
import random

from redraft.proto.tree import Tree as Draft
from redraft.proto.tree import best_chain, path_probs


def brute_force(draft: Draft, max_len: int) -> float:
    """The best sum of path probabilities over every root-to-node path of <= max_len nodes."""
    pp = path_probs(draft.probs, draft.parents)
    best = 0.0
    for i in range(len(draft)):
        path, node = [], i
        while node >= 0:
            path.append(node)
            node = draft.parents[node]
        if len(path) <= max_len:
            best = max(best, sum(pp[j] for j in path))
    return best


def random_tree(rng: random.Random, n: int) -> Draft:
    parents = [rng.randrange(-1, i) for i in range(n)]
    return Draft(tokens=[rng.randrange(100) for _ in range(n)], parents=parents,
                 probs=[rng.random() for _ in range(n)],
                 sources=[rng.choice(["rest", "pld"]) for _ in range(n)])


def test_a_long_likely_branch_beats_a_short_more_likely_one():
    # root -> A (0.6) with no children; root -> B (0.5) -> C (0.9) -> D (0.9)
    draft = Draft(tokens=[10, 20, 30, 40], parents=[-1, -1, 1, 2], probs=[0.6, 0.5, 0.9, 0.9],
                  sources=["pld", "rest", "rest", "rest"])
    chain = best_chain(draft, 16)
    assert chain.tokens == [20, 30, 40]
    assert chain.probs == [0.5, 0.9, 0.9] and chain.sources == ["rest"] * 3
    assert best_chain(draft, 1).tokens == [10]  # one node: the likeliest first token
    assert best_chain(draft, 0).tokens == [] and best_chain(Draft(), 4).tokens == []


def test_matches_brute_force_on_random_trees():
    rng = random.Random(3)
    for n, max_len in itertools.product([1, 2, 5, 12, 30], [1, 2, 3, 8]):
        for _ in range(20):
            draft = random_tree(rng, n)
            chain = best_chain(draft, max_len)
            assert 1 <= len(chain) <= max_len
            # the chain is a real path of the tree (each token a child of the previous node)
            node, value, path_prob = -1, 0.0, 1.0
            for tok, p in zip(chain.tokens, chain.probs):
                kids = [i for i, par in enumerate(draft.parents) if par == node
                        and draft.tokens[i] == tok and draft.probs[i] == p]
                assert kids
                node = kids[0]
                path_prob *= p
                value += path_prob
            assert abs(value - brute_force(draft, max_len)) < 1e-9
