"""The core's count_batch (what the service's metrics count of a Batch call) against its
Python reference, metrics.count_batch (walk_accepted down each previous tree), on random
trees: the same counts to the last one and the same trees left to each sequence, whatever
the trees, their rows, the keys; and a bad argument refused before anything is counted."""

from __future__ import annotations

import random

import numpy as np
import pytest
from redraft.datastore.drafting.native import _core
from redraft.datastore.service.metrics import count_batch


def tally(counter: int, last=None, row: int = 0) -> list:
    """A sequence's tally as count_batch reads and sets it (a BatchedSequence's `tally`)."""
    return [counter, last, row]


def random_trees(rng: random.Random, rows: int) -> tuple:
    """A call's trees as flat arrays, parents local and before their children; siblings
    that hold the same token now and then (the first one is the one walked)."""
    offsets, tokens, parents, bits = [0], [], [], []
    for _ in range(rows):
        n = rng.choice([0, 1, 3, 8, 20, 64])
        for i in range(n):
            parents.append(rng.randint(-1, i - 1) if rng.random() < 0.9 else -1)
            tokens.append(rng.randint(1, 6))
            bits.append(rng.choice([1, 2, 3, 4, 5, 6, 7, 0, 200]))
        offsets.append(offsets[-1] + n)
    return (np.array(offsets, np.int64), np.array(tokens, np.uint32),
            np.array(parents, np.int32), np.array(bits, np.uint8))


def a_path(rng: random.Random, trees: tuple, row: int) -> list[int]:
    """Tokens along one path of the row's tree, then maybe a token off it."""
    offsets, tokens, parents, _ = trees
    a, b = int(offsets[row]), int(offsets[row + 1])
    out, cur = [], -1
    while rng.random() < 0.85:
        kids = [i for i in range(a, b) if parents[i] == cur]
        if not kids:
            break
        cur = rng.choice(kids) - a
        out.append(int(tokens[a + cur]))
    if rng.random() < 0.7:
        out.append(rng.randint(1, 9))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_core_counts_what_the_reference_counts(seed):
    rng = random.Random(seed)
    n_keys, n_bits, depths = 6, rng.choice([8, 8, 3, 20]), rng.choice([0, 4, 16])
    size = n_keys * (1 + 2 * n_bits) + depths
    want, got = np.zeros(size), np.zeros(size)
    earlier = [random_trees(rng, rng.randint(1, 30)) for _ in range(3)]
    pool: list[tuple[list, list]] = []  # each sequence twice: the reference's, the core's
    for _ in range(40):
        n = rng.randint(0, 40)
        while len(pool) < n:
            trees = rng.choice(earlier)
            last = None if rng.random() < 0.15 else trees
            row = rng.randrange(len(trees[0]) - 1)
            key = rng.randrange(n_keys)
            pool.append((tally(key, last, row), tally(key, last, row)))
        calls = rng.sample(pool, n)
        accepted, counts = [], []
        for ref, _ in calls:
            path = a_path(rng, ref[1], ref[2]) if ref[1] is not None and \
                rng.random() < 0.9 else []
            accepted += path
            counts.append(len(path))
        now = random_trees(rng, n)
        flat = (np.array(accepted, np.uint32), np.array(counts, np.uint32))
        count_batch([r for r, _ in calls], now, *flat, want, n_keys, n_bits)
        _core.count_batch([c for _, c in calls], now, *flat, got, n_keys, n_bits)
        assert got.tolist() == want.tolist()
        for ref, core in pool:
            assert core[0] == ref[0] and core[1] is ref[1] and core[2] == ref[2]
        for i, (_, core) in enumerate(calls):
            assert core[1] is now and core[2] == i
        if n:
            earlier = [now, *earlier[:2]]
    at = n_keys * (1 + n_bits)
    assert want[at:at + n_keys * n_bits].sum() > 100  # accepted tokens were walked


def test_one_tree_walked_as_walk_accepted_walks_it():
    #            0   1   2   3   4   a tree: 0 -> 1 -> 3, 0 -> 2, a second root 4
    before = (np.array([0, 5], np.int64), np.array([10, 11, 12, 13, 11], np.uint32),
              np.array([-1, 0, 0, 1, -1], np.int32), np.array([1, 3, 2, 1, 4], np.uint8))
    now = (np.array([0, 2], np.int64), np.array([7, 8], np.uint32),
           np.array([-1, 0], np.int32), np.array([4, 4], np.uint8))
    into = np.zeros(1 + 2 * 8 + 4)
    seq = tally(0, before, 0)
    _core.count_batch([seq], now, np.array([10, 11, 13, 99], np.uint32),
                      np.array([4], np.uint32), into, 1, 8)
    assert into[0] == 1 and into[1 + 4] == 2  # a draft now, its two nodes' source 4
    assert into[9:17].tolist() == [0, 2, 0, 1, 0, 0, 0, 0]  # nodes 0, 1, 3: sources 1, 3, 1
    assert into[17:].tolist() == [1, 1, 1, 0]
    assert seq[1] is now and seq[2] == 0


def test_a_bad_argument_is_refused_before_anything_is_counted():
    before = (np.array([0, 1], np.int64), np.array([5], np.uint32), np.array([-1], np.int32),
              np.array([1], np.uint8))
    now = (np.array([0, 1, 2], np.int64), np.array([5, 5], np.uint32),
           np.array([-1, -1], np.int32), np.array([1, 1], np.uint8))
    into = np.zeros(2 * (1 + 2 * 8))
    acc, counts = np.array([5, 5], np.uint32), np.array([1, 1], np.uint32)
    with pytest.raises(ValueError, match="outside"):
        _core.count_batch([tally(0, before), tally(2)], now, acc, counts, into, 2, 8)
    with pytest.raises(ValueError, match="no row 1"):
        _core.count_batch([tally(0, before), tally(1, before, 1)], now, acc, counts, into, 2, 8)
    with pytest.raises(ValueError, match="more than accepted"):
        _core.count_batch([tally(0), tally(1)], now, acc[:1], counts, into, 2, 8)
    with pytest.raises(ValueError, match="differ in number"):
        _core.count_batch([tally(0)], now, acc, counts, into, 2, 8)
    with pytest.raises(ValueError, match="smaller"):
        _core.count_batch([tally(0), tally(1)], now, acc, counts, into[:5], 2, 8)
    with pytest.raises(TypeError, match="trees must be"):
        _core.count_batch([tally(0, (1, 2)), tally(1)], now, acc, counts, into, 2, 8)
    with pytest.raises(TypeError, match="a tally must be"):
        _core.count_batch([(0, None, 0), tally(1)], now, acc, counts, into, 2, 8)
    assert not into.any()
    seqs = [tally(0, before), tally(1)]
    _core.count_batch(seqs, now, acc, counts, into, 2, 8)
    assert into[:2].tolist() == [1, 1] and into[2 + 16 + 1] == 1  # key 0 walked node 0
    assert [(s[1] is now, s[2]) for s in seqs] == [(True, 0), (True, 1)]
