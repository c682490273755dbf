"""The shared figures behind /metrics: accepted draft tokens walked down the tree drafted
before, histograms into Prometheus buckets, a Batch call's counts (count_batch) published
with the rest, corpus selections' slots shared by the workers and bounded, readiness, and
nothing counted with metrics off."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
from redraft.datastore.drafting.native import _core
from redraft.datastore.service.batch_rpc import BatchedSequence
from redraft.datastore.service.metrics import (
    ALL_CORPORA,
    CORPUS_SLOTS,
    N_BITS,
    OTHER_CORPORA,
    TIME_BUCKETS,
    MetricSlots,
    walk_accepted,
)

#        0    1    2    3    4      a tree: 0 -> 1 -> 3, 0 -> 2, and a second root 4
TOKENS = [10, 11, 12, 13, 11]
PARENTS = [-1, 0, 0, 1, -1]
BITS = [1, 3, 2, 1, 4]


def test_accepted_tokens_follow_one_path_from_the_root():
    assert walk_accepted(TOKENS, PARENTS, BITS, 0, 5, [10, 11, 13, 99]) == [1, 3, 1]
    assert walk_accepted(TOKENS, PARENTS, BITS, 0, 5, [10, 12]) == [1, 2]
    # 11 is a root's child only as node 4 (node 1 is 10's child), 13 is not 4's child
    assert walk_accepted(TOKENS, PARENTS, BITS, 0, 5, [11, 13]) == [4]
    assert walk_accepted(TOKENS, PARENTS, BITS, 0, 5, [13]) == []
    assert walk_accepted(TOKENS, PARENTS, BITS, 0, 5, []) == []
    # a tree inside concatenated arrays, parents local to it
    tokens, parents, bits = [7, 7, *TOKENS, 10], [-1, 0, *PARENTS, -1], [1, 1, *BITS, 2]
    assert walk_accepted(tokens, parents, bits, 2, 7, [10, 11, 13]) == [1, 3, 1]


def _worker_counts(slots: MetricSlots, worker: int) -> None:
    """A worker process: counts one step and one refusal, publishes them."""
    slots.serve_as(worker)
    slots.drafted(slots.key(1, None), 0.002, [2], {2}, [2])  # pld
    assert slots.corpus_slot(("docs", "code")) == 2  # the slot the parent took
    slots.refused(5)
    slots.publish()


def test_counts_reach_the_shared_array_when_published_and_add_up_over_workers():
    ctx = mp.get_context("spawn")
    slots = MetricSlots(ctx, workers=2, tenants=3)
    slots.serve_as(0)
    slots.refused(5)
    slots.add("reloads")
    slots.publish()  # off: nothing counted, nothing published
    assert slots.read()["refusals"][5] == 0 and slots.read()["counters"]["reloads"] == 0
    slots.enabled = True
    slots.refused(5)
    slots.add("reloads", 2)
    bits = [1, 1, 3]  # rest, rest, pld+rest
    assert slots.corpus_slot(["code"]) == 1 and slots.corpus_slot(("code", "docs")) == 2
    k2 = slots.key(2, None)
    slots.drafted(k2, 0.0003, bits, set(bits), [1, 3])
    slots.drafted(k2, None, [], set(), [])  # an open's reply that drafted nothing
    assert slots.read()["refusals"][5] == 0  # not yet published
    slots.publish()
    proc = ctx.Process(target=_worker_counts, args=(slots, 1))  # the other worker
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    m = slots.read()
    assert m["refusals"][5] == 2 and m["counters"]["reloads"] == 2
    k1 = slots.key(1, ())
    assert [i for i, n in enumerate(m["drafts"]) if n] == [k1, k2] and sum(m["drafts"]) == 2
    assert m["draft_tokens"][k2 * N_BITS + 1] == 2 and m["draft_tokens"][k2 * N_BITS + 3] == 1
    assert m["draft_tokens"][k1 * N_BITS + 2] == 1
    assert m["accepted"][k2 * N_BITS + 1] == 1 and m["accepted"][k2 * N_BITS + 3] == 1
    assert m["corpora"][:4] == ["all", "code", "code+docs", ""]
    assert m["positions"][:3] == [2, 1, 0]
    hist = m["step_hist"]  # 0.3 ms and 2 ms: the 0.5 ms and 2.5 ms buckets, the sum
    assert hist[TIME_BUCKETS.index(0.0005)] == 1 and hist[TIME_BUCKETS.index(0.0025)] == 1
    assert sum(hist[:-1]) == 2 and abs(hist[-1] - 0.0023) < 1e-12
    again = MetricSlots.__new__(MetricSlots)  # a worker started in a dead one's slot 1
    again.__setstate__(slots.__getstate__())
    again.serve_as(1)
    again.refused(5)
    again.publish()
    assert slots.read()["refusals"][5] == 3  # goes on from what the dead one counted


def test_ready_once_a_worker_listens_and_not_once_stopping():
    slots = MetricSlots(None, workers=2)
    assert not slots.ready()
    slots.set_worker(1, ready=1)
    assert slots.ready()
    slots.clear_worker(1)  # it died
    assert not slots.ready()
    slots.set_worker(0, ready=1)
    slots.set_stopping()
    assert not slots.ready()


def test_corpus_selections_take_bounded_slots_by_their_sorted_names():
    slots = MetricSlots(None, tenants=2)
    assert slots.corpus_slot(None) == slots.corpus_slot(()) == ALL_CORPORA
    assert slots.corpus_slot(("b", "a")) == slots.corpus_slot(("a", "b", "a")) == 1
    assert slots.key(1, ["a", "b"]) == CORPUS_SLOTS + 1
    assert slots.key(7, None) == 0  # a tenant slot it does not have: the first
    for i in range(2, OTHER_CORPORA):
        assert slots.corpus_slot([f"c{i}"]) == i
    assert slots.corpus_slot(["one-too-many"]) == OTHER_CORPORA  # the slots are all taken
    again = MetricSlots(None, tenants=2)
    assert again.corpus_slot(["x" * 300]) == OTHER_CORPORA  # too long to share
    assert again.corpus_slot(["all"]) == again.corpus_slot(["other"]) == OTHER_CORPORA
    assert again.read()["corpora"] == ["all", *[""] * (CORPUS_SLOTS - 2), "other"]


def test_a_batch_calls_counts_are_published_under_their_keys():
    slots = MetricSlots(None, tenants=2)
    slots.enabled = True
    slots.serve_as(0)
    key = slots.key(1, ["docs"])
    # the tree before: root 10 (rest) -> 11 (pld); the step accepts 10, 11, then 5 (bonus)
    before = (np.array([0, 2], np.int64), np.array([10, 11], np.uint32),
              np.array([-1, 0], np.int32), np.array([1, 2], np.uint8))
    now = (np.array([0, 3], np.int64), np.array([1, 2, 3], np.uint32),
           np.array([-1, 0, 1], np.int32), np.array([4, 4, 1], np.uint8))
    seq = BatchedSequence(("", "", "s"), None, 3, 1, key)
    seq.tally[1] = before
    _core.count_batch([seq.tally], now, np.array([10, 11, 5], np.uint32), np.array([3], np.uint32),
                      slots.batch_counts, slots.keys, N_BITS)
    slots.batch(0.0004, 1)
    slots.publish()
    m = slots.read()
    assert m["drafts"][key] == 1 == sum(m["drafts"])
    assert m["draft_tokens"][key * N_BITS + 4] == 2 and m["draft_tokens"][key * N_BITS + 1] == 1
    assert m["accepted"][key * N_BITS + 1] == 1 and m["accepted"][key * N_BITS + 2] == 1
    assert sum(m["accepted"]) == 2 and m["positions"][:3] == [1, 1, 0]
    assert m["corpora"][key % CORPUS_SLOTS] == "docs"
    assert m["batch_hist"][TIME_BUCKETS.index(0.0005)] == 1
