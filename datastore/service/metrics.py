"""What `redraft serve --metrics-port` counts, in shared memory, for Prometheus.

Why shared memory, as `stats`: with `--workers N` every process serves its own calls, and
`/metrics` (served by the parent) must report the whole server. Every label is bounded: the
tenant is a tenant slot of the service's limits (one per configured token, labelled with its
key's hash, or one of TENANT_BUCKETS slots of declared tenants without auth), the source a
combination of the three source bits, the position one of POSITIONS, the status one of
gRPC's 17 codes. Nothing here is counted unless metrics are on (`MetricSlots.enabled`), so
a server without `--metrics-port` pays nothing.

Accepted tokens are what clients report back: a step's accepted tokens, walked down the
tree the server drafted for that session or sequence before; each node they follow is an
accepted draft token (vLLM's `num_accepted_tokens`), counted by its source and its depth.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

# A node's sources are three bits (proto.tree.SOURCE_BITS: rest 1, pld 2, learned 4), so a
# source label is one of these seven (a node several sources proposed counts once, under
# their combination; 0: none known).
SOURCE_NAMES = ("unknown", "rest", "pld", "pld+rest", "learned", "learned+rest",
                "learned+pld", "learned+pld+rest")
N_BITS = len(SOURCE_NAMES)
POSITIONS = 16  # accepted tokens counted by depth 0..15 (deeper ones: in the totals only)
STATUS_CODES = 17  # gRPC status codes 0..16
# Server time per Session step and per Batch call, in seconds (Prometheus `le` bounds).
TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                0.25, 0.5, 1.0, 2.5, 10.0)
ENTRY_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
# Server-wide counters (not by tenant).
COUNTERS = ("persist_failures", "quarantined_records", "reloads", "reload_failures",
            "share_failures")
# Per worker process, each a gauge of its own (the server reports the largest, or the sum).
WORKER_GAUGES = ("ready", "datastore_tokens", "datastore_segments", "commit",
                 "last_persist_unix")


class MetricSlots:
    """The shared array behind `/metrics`: per tenant slot, steps drafted and draft and
    accepted tokens by source; accepted tokens by position; histograms; refusals by
    status; server-wide counters; per worker, its readiness and its datastore's sizes."""

    def __init__(self, ctx: Any = None, workers: int = 1, tenants: int = 1) -> None:
        self.workers = max(1, workers)
        self.tenants = max(1, tenants)
        t = self.tenants
        layout = [("drafts", t), ("draft_tokens", t * N_BITS), ("accepted", t * N_BITS),
                  ("positions", POSITIONS), ("step_hist", len(TIME_BUCKETS) + 2),
                  ("batch_hist", len(TIME_BUCKETS) + 2),
                  ("entries_hist", len(ENTRY_BUCKETS) + 2), ("refusals", STATUS_CODES),
                  ("counters", len(COUNTERS)), ("stopping", 1),
                  ("workers", self.workers * len(WORKER_GAUGES))]
        self.at: dict[str, int] = {}
        size = 0
        for name, n in layout:
            self.at[name] = size
            size += n
        if ctx is None:
            self._arr: Any = [0.0] * size
            self._lock: Any = threading.Lock()
        else:
            self._arr = ctx.Array("d", size, lock=False)
            self._lock = ctx.Lock()
        self.enabled = False

    # ---- counting (worker processes) -----------------------------------------------------
    def drafted(self, slot: int, seconds: float | None, bits: Sequence[int],
                accepted: Sequence[int], depth: int) -> None:
        """One Session reply: its tree's nodes' source bits (`bits`), the accepted draft
        tokens of the step it answers (their bits, `depth` of them on the path), and the
        server time of a step (None for the reply to an open)."""
        slot = slot if 0 <= slot < self.tenants else 0
        a, at = self._arr, self.at
        with self._lock:
            if bits:
                a[at["drafts"] + slot] += 1
                base = at["draft_tokens"] + slot * N_BITS
                for b in bits:
                    a[base + b] += 1
            if accepted:
                base = at["accepted"] + slot * N_BITS
                for b in accepted:
                    a[base + b] += 1
                for p in range(min(depth, POSITIONS)):
                    a[at["positions"] + p] += 1
            if seconds is not None:
                self._observe("step_hist", TIME_BUCKETS, seconds)

    def batch(self, seconds: float, entries: int, slots: np.ndarray, node_bits: np.ndarray,
              node_slot: np.ndarray, accepted: np.ndarray, depths: Sequence[int]) -> None:
        """One Batch call: its server time and entries, the tenant slot of each sequence
        that drafted (`slots`), every node's bits and slot, and the accepted draft tokens'
        bits-by-slot counts (`accepted`, tenants x N_BITS) with each step's path depth."""
        t = self.tenants
        drafts = np.bincount(slots, minlength=t) if len(slots) else None
        tokens = (np.bincount(node_slot * N_BITS + node_bits, minlength=t * N_BITS)
                  if len(node_bits) else None)
        positions = [0] * POSITIONS
        for d in depths:
            for p in range(min(d, POSITIONS)):
                positions[p] += 1
        a, at = self._arr, self.at
        with self._lock:
            if drafts is not None:
                for i in np.flatnonzero(drafts).tolist():
                    a[at["drafts"] + i] += int(drafts[i])
            if tokens is not None:
                for i in np.flatnonzero(tokens).tolist():
                    a[at["draft_tokens"] + i] += int(tokens[i])
            for i in np.flatnonzero(accepted).tolist():
                a[at["accepted"] + i] += int(accepted.flat[i])
            for p, n in enumerate(positions):
                if n:
                    a[at["positions"] + p] += n
            self._observe("batch_hist", TIME_BUCKETS, seconds)
            self._observe("entries_hist", ENTRY_BUCKETS, entries)

    def _observe(self, name: str, bounds: Sequence[float], value: float) -> None:
        """Under the lock: one observation into histogram `name` (its buckets, then +Inf,
        then the sum)."""
        base = self.at[name]
        i = 0
        while i < len(bounds) and value > bounds[i]:
            i += 1
        self._arr[base + i] += 1
        self._arr[base + len(bounds) + 1] += value

    def refused(self, code: int, n: int = 1) -> None:
        """A call (or a Batch entry) refused with gRPC status `code`."""
        if self.enabled and 0 <= code < STATUS_CODES:
            with self._lock:
                self._arr[self.at["refusals"] + code] += n

    def add(self, name: str, n: float = 1) -> None:
        """One of COUNTERS."""
        if self.enabled:
            with self._lock:
                self._arr[self.at["counters"] + COUNTERS.index(name)] += n

    def set_worker(self, worker: int, **gauges: float) -> None:
        """Worker slot `worker`'s gauges (WORKER_GAUGES), replacing earlier values."""
        if not 0 <= worker < self.workers:
            return
        base = self.at["workers"] + worker * len(WORKER_GAUGES)
        with self._lock:
            for name, value in gauges.items():
                self._arr[base + WORKER_GAUGES.index(name)] = value

    def clear_worker(self, worker: int) -> None:
        """A worker that died: its gauges are no one's (a new one publishes its own)."""
        self.set_worker(worker, **{name: 0 for name in WORKER_GAUGES})

    def set_stopping(self) -> None:
        """The server is shutting down: not ready, whatever its workers say."""
        with self._lock:
            self._arr[self.at["stopping"]] = 1

    # ---- reading (the process that serves /metrics) --------------------------------------
    def read(self) -> dict[str, Any]:
        """A consistent copy of every figure."""
        with self._lock:
            values = list(self._arr)
        at, t = self.at, self.tenants

        def block(name: str, n: int) -> list[float]:
            return values[at[name]:at[name] + n]

        k = len(WORKER_GAUGES)
        raw = block("workers", self.workers * k)
        return {
            "drafts": block("drafts", t),
            "draft_tokens": block("draft_tokens", t * N_BITS),
            "accepted": block("accepted", t * N_BITS),
            "positions": block("positions", POSITIONS),
            "step_hist": block("step_hist", len(TIME_BUCKETS) + 2),
            "batch_hist": block("batch_hist", len(TIME_BUCKETS) + 2),
            "entries_hist": block("entries_hist", len(ENTRY_BUCKETS) + 2),
            "refusals": block("refusals", STATUS_CODES),
            "counters": dict(zip(COUNTERS, block("counters", len(COUNTERS)))),
            "stopping": bool(values[at["stopping"]]),
            "workers": [dict(zip(WORKER_GAUGES, raw[w * k:(w + 1) * k]))
                        for w in range(self.workers)],
        }

    def ready(self) -> bool:
        """Some worker listens with its datastore open, and the server is not stopping."""
        snap = self.read()
        return not snap["stopping"] and any(w["ready"] for w in snap["workers"])


def walk_accepted(tokens: Sequence[int], parents: Sequence[int], bits: Sequence[int],
                  start: int, end: int, accepted: Sequence[int]) -> list[int]:
    """The source bits of the nodes of the tree in [start, end) (parents local to it) that
    the client's accepted tokens follow from the root, in path order.

    `list.index` scans in C: a step costs a few hundred nanoseconds per accepted token, not
    a Python loop over the tree."""
    out: list[int] = []
    cur = -1
    for token in accepted:
        i = start
        while True:
            try:
                i = tokens.index(token, i, end)
            except ValueError:
                return out
            if parents[i] == cur:
                break
            i += 1
        out.append(bits[i])
        cur = i - start
    return out


def node_bits(sources: Sequence[str]) -> list[int]:
    """Source bits of a Tree's nodes, from their labels ("pld+rest" -> 3)."""
    cache = _LABEL_BITS
    out = []
    for label in sources:
        b = cache.get(label)
        if b is None:
            b = cache[label] = sum(1 << i for i, n in enumerate(("rest", "pld", "learned"))
                                   if n in label.split("+"))
        out.append(b)
    return out


_LABEL_BITS: dict[str, int] = {}


def now_unix() -> float:
    """Wall-clock time, for the last persist's gauge."""
    return time.time()
