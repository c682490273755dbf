"""The compiled learned index against the Python one (the reference): the same documents,
pools, eviction, persistence hand-offs and drafts under any sequence of operations."""

from __future__ import annotations

import random

import pytest
from redraft.datastore.drafting.learned_index import PROMPT_TAIL, LearnedIndex
from redraft.datastore.drafting.native import NativeLearnedIndex


def run_ops(rng: random.Random, py: LearnedIndex, native: NativeLearnedIndex, same,
            n_ops: int, vocab: int) -> int:
    """Random writers, extends, closes, drafts, loads and hand-offs on both indexes."""
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 9))] for _ in range(15)]
    tenants = ["", "a", "b", "c/d"]
    writers: list[tuple] = []
    history: list[int] = []
    drafted = 0
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.15 or not writers:
            tenant = rng.choice(tenants)
            prompt = sum((rng.choice(phrases) for _ in range(rng.randint(0, 6))), [])
            writers.append((py.writer(tenant, prompt), native.writer(tenant, prompt)))
        elif op < 0.55:
            a, b = rng.choice(writers)
            toks = sum((rng.choice(phrases) for _ in range(rng.randint(0, 3))), [])
            if rng.random() < 0.2:
                toks.append(rng.randrange(vocab))
            a.extend(toks)
            b.extend(toks)
            history += toks
        elif op < 0.65:
            i = rng.randrange(len(writers))
            a, b = writers.pop(i)
            a.close()
            b.close()
        elif op < 0.9:
            tenant = rng.choice(tenants)
            context = (history[-rng.randint(0, 60):] if rng.random() < 0.7 else
                       [rng.randrange(vocab) for _ in range(rng.randint(0, 10))])
            budget, depth = rng.choice([(16, 8), (64, 16), (3, 30), (0, 4), (8, 0), (100, 40)])
            want = py.propose(tenant, context, budget, depth)
            same(want, native.propose(tenant, context, budget, depth))
            drafted += len(want) > 0
        elif op < 0.95 and py.journal is not None:  # a writer replaying another's output
            tenant = rng.choice(tenants)
            toks = sum((rng.choice(phrases) for _ in range(3)), [])
            for w in (py.writer(tenant, [], journal=False), native.writer(tenant, [],
                                                                           journal=False)):
                w.extend(toks)
                w.close()
        else:
            docs = [(rng.choice(tenants), sum((rng.choice(phrases) for _ in range(4)), []))
                    for _ in range(rng.randint(0, 3))]
            py.load(docs)
            native.load(docs)
        assert native.n_tokens == py.n_tokens
        assert native.stats() == py.stats()
    return drafted


@pytest.mark.parametrize("max_tokens", [40, 300, 1_000_000])
@pytest.mark.parametrize("shared", [False, True])
def test_any_sequence_of_operations_gives_the_same_index(max_tokens, shared, same, journals):
    rng = random.Random(f"{max_tokens}-{shared}")
    py = LearnedIndex(max_tokens, shared, journal=journals[0])
    native = NativeLearnedIndex(max_tokens, shared, journal=journals[1])
    drafted = run_ops(rng, py, native, same, 3000, vocab=50)
    assert drafted > (15 if max_tokens < 100 else 100)
    assert journals[1].events == journals[0].events and journals[0].events


def test_pools_of_evicted_tenants_are_dropped(same):
    """Every tenant's last document evicted: its pool goes (memory bounded in tenants)."""
    py, native = LearnedIndex(50), NativeLearnedIndex(50)
    for i in range(40):
        for index in (py, native):
            w = index.writer(f"tenant-{i}", [1, 2, 3])
            w.extend([4, 5, 6, i, 7, 8])
            w.close()
        assert native.stats() == py.stats()
    assert py.stats()["learned_pools"] < 10
    same(py.propose("tenant-39", [4, 5], 16, 8), native.propose("tenant-39", [4, 5], 16, 8))
    same(py.propose("tenant-0", [4, 5], 16, 8), native.propose("tenant-0", [4, 5], 16, 8))


def test_any_tenant_key_is_kept_apart():
    """Tenant keys are plain strings (the service's `k:<digest>/<name>`, anything printable,
    even a lone surrogate from a damaged log): distinct keys never share a pool."""
    index = NativeLearnedIndex()
    keys = ["", "t:a", "k:" + "0" * 64 + "/a", "t:\udc80", "t:é", "t:e\u0301"]
    for n, key in enumerate(keys):
        w = index.writer(key, [])
        w.extend([100 + n, 1, 2, 3, 200 + n])
        w.close()
    assert index.stats()["learned_pools"] == len(keys)
    for n, key in enumerate(keys):
        assert index.propose(key, [1, 2, 3], 8, 4).tokens == [200 + n]


def test_wide_token_ids_and_colliding_keys(same):
    """Ids past 2**21 make the reference's packed n-gram keys collide (a 4-gram of two
    zeros then x, y shares the 2-gram x, y's key): the same candidates must come out."""
    rng = random.Random(2)
    py, native = LearnedIndex(5000), NativeLearnedIndex(5000)
    alphabet = [0, 1, 2, 2**21, 2**21 + 1, 2**31 + 5, 2**32 - 1, 70_000]
    for _ in range(400):
        w_py, w_native = py.writer("t", []), native.writer("t", [])
        toks = [rng.choice(alphabet) for _ in range(rng.randint(1, 12))]
        w_py.extend(toks)
        w_native.extend(toks)
        ctx = [rng.choice(alphabet) for _ in range(rng.randint(2, 8))]
        same(py.propose("t", ctx, 32, 8), native.propose("t", ctx, 32, 8))
    assert native.stats() == py.stats()


def test_a_writer_continues_from_its_tail_after_eviction(same):
    py, native = LearnedIndex(max_tokens=30), NativeLearnedIndex(max_tokens=30)
    prompt = list(range(100, 140))
    wp, wn = py.writer("", prompt), native.writer("", prompt)
    for i in range(0, 90, 5):
        chunk = list(range(i, i + 5))
        wp.extend(chunk)
        wn.extend(chunk)
        assert native.stats() == py.stats()
        same(py.propose("", chunk[-3:], 16, 8), native.propose("", chunk[-3:], 16, 8))
    assert PROMPT_TAIL == 16  # the native core stores the same prompt tail


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        NativeLearnedIndex(0)
    index = NativeLearnedIndex()
    with pytest.raises(ValueError, match="outside"):
        index.writer("t", [1, 2]).extend([-3])
    with pytest.raises(TypeError):
        index.load([("t", ["x"])])
    with pytest.raises(TypeError):
        index.writer(7, [1])
