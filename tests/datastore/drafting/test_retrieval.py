"""The retrieval (REST) tree over a Reader against the brute-force reference: sampled
continuations, the back-off when support is low, and its calibration."""

from __future__ import annotations

import numpy as np
import pytest
from redraft.datastore import Reader
from redraft.datastore.drafting import REST_CALIBRATION, calibrate, retrieval_tree
from redraft.proto.tree import REST, Tree

REST_D = Tree([1, 2, 3, 9], [-1, 0, 1, -1], [0.9, 0.8, 0.5, 0.1], [REST] * 4, match_len=6)


def test_calibration_maps_probs_and_keeps_the_tree():
    d = calibrate(REST_D, 0.5, 2.0)
    assert d.tokens == REST_D.tokens and d.parents == REST_D.parents
    assert d.probs == [0.5 * p * p for p in REST_D.probs]
    assert calibrate(REST_D, 1.0, 1.0) is REST_D
    scale, power = REST_CALIBRATION
    assert all(0 < scale * p**power <= p for p in (0.05, 0.5, 1.0))


@pytest.mark.parametrize("shard_tokens", [10_000, 250])
def test_propose_matches_brute_force(make_store, helpers, shard_tokens):
    rng = np.random.default_rng(7)
    docs = helpers.random_docs(rng, 30, 4, max_len=50)
    path = make_store(docs, vocab=4, shard_tokens=shard_tokens)
    with Reader(path) as r:
        shard_docs = [list(range(s["first_doc"], s["first_doc"] + s["n_docs"]))
                      for s in r.manifest["shards"]]
        ref = helpers.Ref(docs, shard_docs=shard_docs, sep=r.separator)
        checked = 0
        for _ in range(40):
            ctx = rng.integers(0, 4, size=int(rng.integers(2, 12))).tolist()
            for kw in [dict(max_occurrences=10**6, min_support=1),
                       dict(max_occurrences=7, min_support=1),
                       dict(max_occurrences=10**6, min_support=50, max_depth=5)]:
                if len(r.manifest["shards"]) > 1 and kw["max_occurrences"] == 7:
                    continue  # cross-shard sampling order is covered in the 1-shard case
                L, want = ref.propose_masses(ctx, **kw)
                for budget in (1000, 9):
                    d = retrieval_tree(r, ctx, budget=budget, **kw)
                    helpers.compare_tree(d, L, want, budget)
                checked += bool(want)
        assert checked > 20


def test_sampling_spreads_over_the_whole_range(make_store):
    """With more occurrences than max_occurrences, the sample covers all continuations."""
    docs = [[7, t] for t in range(7)] * 20  # [7, t] for t = 0..6, 140 docs
    with Reader(make_store(docs)) as r:
        d = retrieval_tree(r, [7], budget=64, max_occurrences=7, min_match_len=1, min_support=1)
        # the first 7 suffixes in SA order would all continue with 0; an even spread sees all
        assert sorted(d.tokens) == list(range(7))
        assert d.probs == pytest.approx([1 / 7] * 7)


def test_backoff_when_support_is_low(make_store):
    docs = [[1, 2, 3, 4], [9, 2, 3, 5], [8, 2, 3, 5], [7, 2, 3, 5]]
    with Reader(make_store(docs, vocab=10)) as r:
        only_long = retrieval_tree(r, [1, 2, 3], min_support=1)
        assert only_long.match_len == 3 and only_long.tokens == [4]
        mixed = retrieval_tree(r, [1, 2, 3], min_support=4)
        assert mixed.match_len == 3
        paths = dict(zip(mixed.tokens, mixed.probs))
        # long match (n=1) gets 1/2; [2, 3] (4 occurrences: 4,5,5,5) shares the other half
        assert paths[4] == pytest.approx(0.5 + 0.5 * 0.25)
        assert paths[5] == pytest.approx(0.5 * 0.75)
