"""Counters of the draft service, in shared memory so several worker processes add up.

Why shared memory: `redraft serve --workers N` runs N processes on one port; `Stats` must
report the whole server (and `max_sessions` must bound all of them), whichever process
answers. Latency is a log-bucketed histogram (bucket width ~9%), so percentiles cost O(1)
memory however long the server runs.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any

# Counter slots in the shared array.
FIELDS = (
    "requests",
    "propose_calls",
    "session_steps",
    "sessions_opened",
    "sessions_active",
    "sessions_idle_closed",
    "sessions_unread_closed",
    "errors",
    "hits",
    "rest_hits",
    "pld_hits",
    "learned_hits",
    "learned_persisted",
    "nodes",
    "expected_accepted_x1000",
    "refused_sessions",
    "batch_calls",
    "batch_steps",
)
_SLOT = {name: i for i, name in enumerate(FIELDS)}
_BUCKETS_PER_OCTAVE = 8
_N_BUCKETS = _BUCKETS_PER_OCTAVE * 24  # 1 us .. ~16 s
_HIST0 = len(FIELDS)


class ServiceStats:
    """Process-shared counters and a latency histogram (microseconds)."""

    def __init__(self, ctx: Any = None) -> None:
        """`ctx`: a multiprocessing context to share with worker processes; None = local."""
        if ctx is None:
            self._arr: Any = [0.0] * (_HIST0 + _N_BUCKETS)
            self._lock: Any = threading.Lock()
        else:
            self._arr = ctx.Array("d", _HIST0 + _N_BUCKETS, lock=False)
            self._lock = ctx.Lock()
        self.started = time.time()

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, n in counts.items():
                self._arr[_SLOT[name]] += n

    def get(self, name: str) -> float:
        return self._arr[_SLOT[name]]

    def try_open_session(self, max_sessions: int) -> bool:
        """Take a session slot atomically across processes; False when the server is full."""
        with self._lock:
            if self._arr[_SLOT["sessions_active"]] >= max_sessions:
                self._arr[_SLOT["refused_sessions"]] += 1
                return False
            self._arr[_SLOT["sessions_active"]] += 1
            self._arr[_SLOT["sessions_opened"]] += 1
            return True

    def close_session(self) -> None:
        with self._lock:
            self._arr[_SLOT["sessions_active"]] -= 1

    def record(self, latency_s: float, n_nodes: int, expected: float, sources: set[str],
               kind: str | None = None) -> None:
        """Count one answered request (and its `kind` counter): latency and tree contents."""
        us = max(latency_s * 1e6, 1.0)
        b = min(_N_BUCKETS - 1, int(math.log2(us) * _BUCKETS_PER_OCTAVE))
        with self._lock:
            a = self._arr
            a[_SLOT["requests"]] += 1
            if kind is not None:
                a[_SLOT[kind]] += 1
            a[_SLOT["nodes"]] += n_nodes
            a[_SLOT["expected_accepted_x1000"]] += expected * 1000.0
            if n_nodes:
                a[_SLOT["hits"]] += 1
                if "rest" in sources:
                    a[_SLOT["rest_hits"]] += 1
                if "pld" in sources:
                    a[_SLOT["pld_hits"]] += 1
                if "learned" in sources:
                    a[_SLOT["learned_hits"]] += 1
            a[_HIST0 + b] += 1

    def record_batch(self, latency_s: float, n: int, nodes: int, expected: float, hits: int,
                     rest: int, pld: int, learned: int) -> None:
        """Count one batched call that drafted `n` sequences: each is one request, with the
        call's time per sequence as its latency; `hits` of them had a tree (`rest`, `pld`,
        `learned`: those whose tree holds that source)."""
        if n <= 0:
            return
        us = max(latency_s * 1e6 / n, 1.0)
        b = min(_N_BUCKETS - 1, int(math.log2(us) * _BUCKETS_PER_OCTAVE))
        with self._lock:
            a = self._arr
            a[_SLOT["requests"]] += n
            a[_SLOT["batch_calls"]] += 1
            a[_SLOT["batch_steps"]] += n
            a[_SLOT["nodes"]] += nodes
            a[_SLOT["expected_accepted_x1000"]] += expected * 1000.0
            a[_SLOT["hits"]] += hits
            a[_SLOT["rest_hits"]] += rest
            a[_SLOT["pld_hits"]] += pld
            a[_SLOT["learned_hits"]] += learned
            a[_HIST0 + b] += n

    def percentile_us(self, q: float) -> float:
        """Latency percentile from the histogram (the bucket's geometric middle)."""
        hist = self._arr[_HIST0:]
        total = sum(hist)
        if total == 0:
            return 0.0
        want = q * total
        seen = 0.0
        for b, c in enumerate(hist):
            seen += c
            if seen >= want and c:
                return 2 ** ((b + 0.5) / _BUCKETS_PER_OCTAVE)
        return 2 ** (_N_BUCKETS / _BUCKETS_PER_OCTAVE)

    def snapshot(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything as a plain dict (the Stats reply's stats_json)."""
        out: dict[str, Any] = {name: int(self._arr[i]) for i, name in enumerate(FIELDS)}
        exp = out.pop("expected_accepted_x1000") / 1000.0
        req = max(out["requests"], 1)
        out["hit_rate"] = out["hits"] / req
        out["mean_nodes"] = out["nodes"] / req
        out["mean_expected_accepted"] = exp / req
        out["latency_p50_us"] = self.percentile_us(0.5)
        out["latency_p99_us"] = self.percentile_us(0.99)
        out["uptime_s"] = time.time() - self.started
        out["pid"] = os.getpid()
        out.update(extra or {})
        return out

    def to_json(self, extra: dict[str, Any] | None = None) -> str:
        return json.dumps(self.snapshot(extra), sort_keys=True)
