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
    assert node_bits(["rest", "pld", "pld+rest", "learned+pld+rest", "x"]) == [1, 2, 3, 7, 0]


def test_counts_add_up_across_processes_and_nothing_is_counted_while_off():
    slots = MetricSlots(mp.get_context("spawn"), workers=2, tenants=3)
    slots.refused(5)
    slots.add("reloads")
    assert slots.read()["refusals"][5] == 0 and slots.read()["counters"]["reloads"] == 0
    slots.enabled = True
    slots.refused(5)
    slots.add("reloads", 2)
    slots.drafted(2, 0.0003, [1, 1, 3], [1, 3], 2)
    slots.drafted(2, None, [], [], 0)  # an open's reply that drafted nothing
    m = slots.read()
    assert m["refusals"][5] == 1 and m["counters"]["reloads"] == 2
    assert m["drafts"] == [0, 0, 1]
    assert m["draft_tokens"][2 * N_BITS + 1] == 2 and m["draft_tokens"][2 * N_BITS + 3] == 1
    assert m["accepted"][2 * N_BITS + 1] == 1 and m["accepted"][2 * N_BITS + 3] == 1
    assert m["positions"][:3] == [1, 1, 0]
    hist = m["step_hist"]  # one step of 0.3 ms: the 0.5 ms bucket, the sum
    assert hist[TIME_BUCKETS.index(0.0005)] == 1 and sum(hist[:-1]) == 1
    assert abs(hist[-1] - 0.0003) < 1e-12


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
