"""The shared figures behind /metrics: accepted draft tokens walked down the tree drafted
before, histograms into Prometheus buckets, readiness, and nothing counted with metrics
off."""

from __future__ import annotations

import multiprocessing as mp

from redraft.datastore.service.metrics import (
    N_BITS,
    TIME_BUCKETS,
    MetricSlots,
    node_bits,
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


def test_source_labels_map_to_their_bits():
    assert node_bits(["rest", "pld", "pld+rest", "rest+pld", "learned+pld+rest", "x"]) == \
        [1, 2, 3, 3, 7, 0]


def _worker_counts(slots: MetricSlots, worker: int) -> None:
    """A worker process: counts one step and one refusal, publishes them."""
    slots.serve_as(worker)
    slots.drafted(1, 0.002, ["pld"], {"pld"}, ["pld"])
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
    labels = ["rest", "rest", "rest+pld"]
    slots.drafted(2, 0.0003, labels, set(labels), ["rest", "pld+rest"])
    slots.drafted(2, None, [], set(), [])  # an open's reply that drafted nothing
    assert slots.read()["refusals"][5] == 0  # not yet published
    slots.publish()
    proc = ctx.Process(target=_worker_counts, args=(slots, 1))  # the other worker
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    m = slots.read()
    assert m["refusals"][5] == 2 and m["counters"]["reloads"] == 2
    assert m["drafts"] == [0, 1, 1]
    assert m["draft_tokens"][2 * N_BITS + 1] == 2 and m["draft_tokens"][2 * N_BITS + 3] == 1
    assert m["draft_tokens"][1 * N_BITS + 2] == 1
    assert m["accepted"][2 * N_BITS + 1] == 1 and m["accepted"][2 * N_BITS + 3] == 1
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
