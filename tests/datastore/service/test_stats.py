"""The service's counters: latency percentiles come from the histogram alone."""

from __future__ import annotations

from redraft.datastore.service.stats import ServiceStats


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
