"""The service's counters: latency percentiles come from the histogram alone; tenants of one
hash slot counted apart, and everything a session or a dead worker held given back."""

from __future__ import annotations

import os

from redraft.datastore.service.config import TENANT_BUCKETS
from redraft.datastore.service.stats import LANES, Full, ServiceStats
from redraft.datastore.service.tenants import TenantSlot, session_key


def test_latency_percentiles_ignore_the_worker_fields_after_the_histogram():
    # A worker's pid and learned sizes live after the histogram in the same array; with few
    # requests recorded they used to outweigh it and push p50 to the top bucket (~16 s).
    stats = ServiceStats()
    slot = stats.claim_worker()
    stats.publish_worker(slot, {"learned_tokens": 1_000_000, "learned_docs": 50,
                                "learned_pools": 3})
    stats.record_batch(0.001, 10, nodes=100, expected=5.0, hits=10, rest=10, pld=0,
                       learned=0)  # one call of 10 sequences: 100 us each
    snap = stats.snapshot()
    assert 90 <= snap["latency_p50_us"] <= 110
    assert 90 <= snap["latency_p99_us"] <= 110
    assert snap["batch_calls"] == 1 and snap["batch_steps"] == 10


def test_tenants_of_one_slot_are_counted_apart_and_a_dead_workers_are_given_back():
    """Nine tenants of one hash slot, one session each, with fair shares of 56 slots: the
    first eight each in a lane of their own (eight tenants hold slots; none holds its share
    of 56 // 8 = 7), the ninth in a lane it shares; a second session of the first is counted
    in its lane. Ending them, or the death of the worker holding them, gives every count
    back."""
    names = ["tenant-29", "tenant-57", "tenant-151", "tenant-255", "tenant-373",
             "tenant-386", "tenant-423", "tenant-505", "tenant-601"]
    for ended_by_death in (False, True):
        stats = ServiceStats(tenants=TENANT_BUCKETS)
        stats.claim_worker()
        slots = [TenantSlot(session_key("", n), TENANT_BUCKETS) for n in names]
        assert len(set(slots)) == 1
        for s in slots:
            assert stats.try_open_session(64, s, None, 56) is None
        assert len({s.lane for s in slots}) == LANES
        assert stats.snapshot()["sessions_active"] == 9
        again = TenantSlot(session_key("", names[0]), TENANT_BUCKETS)
        assert stats.try_open_session(64, again, None, 56) is None and again.lane == slots[0].lane
        full = stats.try_open_session(64, TenantSlot(session_key("", "other"), TENANT_BUCKETS),
                                      None, 9)  # nine tenants now: a share of one each
        assert full is None  # a tenant of another slot holds none yet
        assert stats.try_open_session(64, TenantSlot(session_key("", names[1]),
                                                     TENANT_BUCKETS), None, 9) == \
            Full("tenant", 1, 9)
        if ended_by_death:
            assert stats.release_worker(os.getpid()) == 11
        else:
            for s in (*slots, again):
                stats.close_session(s)
            stats.close_session(TenantSlot(session_key("", "other"), TENANT_BUCKETS))
        assert stats.snapshot()["sessions_active"] == 0
        assert stats.open_by_tenant() == [0] * TENANT_BUCKETS
        lanes = stats._arr[stats._lane0 + 1:stats._holders:2]
        assert list(lanes) == [0] * (TENANT_BUCKETS * LANES) and stats._arr[stats._holders] == 0
