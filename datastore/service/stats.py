"""Counters of the draft service, in shared memory so several worker processes add up.

Why shared memory: `redraft serve --workers N` runs N processes on one port; `Stats` must
report the whole server (and `max_sessions`, and each token's share of it, must bound all
of them), whichever process answers. Latency is a log-bucketed histogram (bucket width
~9%), so percentiles cost O(1) memory however long the server runs. Each worker keeps its
own learned index, so each publishes that index's sizes in slots of its own
(`publish_worker`): `Stats` adds them up for the whole server and lists them per worker,
never one worker's figures as the server's.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any, NamedTuple

from redraft.datastore.service.metrics import MetricSlots
from redraft.datastore.service.tenants import TenantSlot
from redraft.proto.tree import LEARNED, PLD, REST, SOURCE_BITS

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
    "refused_tenant_sessions",
    "worker_restarts",
)
_SLOT = {name: i for i, name in enumerate(FIELDS)}
_REST, _PLD, _LEARNED = SOURCE_BITS[REST], SOURCE_BITS[PLD], SOURCE_BITS[LEARNED]
_BUCKETS_PER_OCTAVE = 8
_N_BUCKETS = _BUCKETS_PER_OCTAVE * 24  # 1 us .. ~16 s
_HIST0 = len(FIELDS)
# Per worker, after the histogram: its pid and its learned index's sizes.
WORKER_FIELDS = ("pid", "learned_tokens", "learned_docs", "learned_pools")
_CLAIMED = _HIST0 + _N_BUCKETS  # how many workers have claimed their slots
_WORKER0 = _CLAIMED + 1
# Tenants counted apart in each tenant slot (a hash bucket of declared tenants): a session
# of a tenant that names itself (`TenantSlot.tenant`) counts in a lane of its slot holding
# that tenant, or in a free one; only a ninth tenant of one slot at once shares a lane.
LANES = 8


class Full(NamedTuple):
    """Why a session slot was refused: what is full, "server" or "tenant" (the caller's
    tenant holds its share); for a tenant, that share and, when shares are fair (an equal
    part for each tenant holding sessions), how many hold some."""

    what: str
    share: int = 0
    holders: int = 0


class ServiceStats:
    """Process-shared counters and a latency histogram (microseconds)."""

    def __init__(self, ctx: Any = None, workers: int = 1, tenants: int = 1) -> None:
        """`ctx`: a multiprocessing context to share with `workers` worker processes;
        None = local (one process). `tenants`: how many tenant slots count their open
        sessions (one per configured token; one for a server without auth)."""
        self._tenant0 = _WORKER0 + workers * len(WORKER_FIELDS)
        self.tenants = max(1, tenants)
        # per lane of each tenant slot: the tenant counted there, its sessions; then how
        # many lanes hold some (the tenants holding slots, for fair shares)
        self._lane0 = self._tenant0 + self.tenants
        self._holders = self._lane0 + 2 * self.tenants * LANES
        # per worker, the sessions it holds and, per tenant slot and per lane, those counted
        # there: what a worker that died held is given back (`release_worker`), never leaked
        self._held0 = self._holders + 1
        self._held_per_worker = 1 + self.tenants + self.tenants * LANES  # [0]: all its sessions
        size = self._held0 + workers * self._held_per_worker
        if ctx is None:
            self._arr: Any = [0.0] * size
            self._lock: Any = threading.Lock()
        else:
            self._arr = ctx.Array("d", size, lock=False)
            self._lock = ctx.Lock()
        self.workers = workers
        # what /metrics reports beyond these counters (counted only with metrics on)
        self.metrics = MetricSlots(ctx, workers=workers, tenants=self.tenants)
        self.started = time.time()
        self._slot = -1  # this process's worker slot, once claimed

    def claim_worker(self) -> int:
        """This process's worker slot (once per server process; -1 when all are taken): a
        slot a dead worker left (`release_worker`), else the next one."""
        k = len(WORKER_FIELDS)
        with self._lock:
            claimed = int(self._arr[_CLAIMED])
            free = [w for w in range(claimed) if self._arr[_WORKER0 + w * k] == 0]
            if free:
                slot = free[0]
            elif claimed < self.workers:
                slot = claimed
                self._arr[_CLAIMED] = claimed + 1
            else:
                return -1
            self._arr[_WORKER0 + slot * k] = os.getpid()
            self._slot = slot
        self.metrics.serve_as(slot)  # its counts for /metrics go to this slot's region
        return slot

    def release_worker(self, pid: int, wait_s: float = 2.0) -> int | None:
        """A worker process `pid` died: give back the sessions it held (to max_sessions and
        its tenants' shares) and free its slot for the worker started in its place; the
        sessions given back (None: `pid` held no slot). A worker killed while it held the
        lock (for microseconds at a time) never releases it: after `wait_s` it is taken
        from the dead."""
        if not self._lock.acquire(timeout=wait_s):
            self._lock.release()  # the dead worker's: nobody else holds it this long
            self._lock.acquire()
        try:
            k = len(WORKER_FIELDS)
            for w in range(int(self._arr[_CLAIMED])):
                if self._arr[_WORKER0 + w * k] != pid:
                    continue
                base = self._held0 + w * self._held_per_worker
                given = int(self._arr[base])
                self._arr[base] = 0
                self._arr[_SLOT["sessions_active"]] -= given
                for t in range(self.tenants):
                    n = int(self._arr[base + 1 + t])
                    self._arr[base + 1 + t] = 0
                    self._arr[self._tenant0 + t] -= n
                for lane in range(self.tenants * LANES):
                    n = int(self._arr[base + 1 + self.tenants + lane])
                    if n:
                        self._arr[base + 1 + self.tenants + lane] = 0
                        self._count_lane(lane, -n)
                for i in range(k):
                    self._arr[_WORKER0 + w * k + i] = 0
                self.metrics.clear_worker(w)
                return given
            return None
        finally:
            self._lock.release()

    def publish_worker(self, slot: int, figures: dict[str, float]) -> None:
        """Worker `slot`'s own figures (its learned index's sizes), replacing earlier ones."""
        if slot < 0:
            return
        base = _WORKER0 + slot * len(WORKER_FIELDS)
        with self._lock:
            for i, name in enumerate(WORKER_FIELDS[1:], 1):
                self._arr[base + i] = figures.get(name, 0)

    def per_worker(self) -> list[dict[str, int]]:
        """Every claimed worker's figures (pid and learned sizes), in slot order."""
        with self._lock:
            n = int(self._arr[_CLAIMED])
            values = list(self._arr[_WORKER0:_WORKER0 + n * len(WORKER_FIELDS)])
        k = len(WORKER_FIELDS)
        return [{name: int(values[w * k + i]) for i, name in enumerate(WORKER_FIELDS)}
                for w in range(n) if values[w * k]]  # a dead worker's slot, freed: none

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, n in counts.items():
                self._arr[_SLOT[name]] += n

    def get(self, name: str) -> float:
        return self._arr[_SLOT[name]]

    def try_open_session(self, max_sessions: int, tenant: int = 0,
                         tenant_share: int | None = None,
                         fair_room: int | None = None) -> Full | None:
        """Take a session slot atomically across processes, for tenant slot `tenant` (-1:
        none yet, `join_tenant` later): None when taken, else what is full (the server, or
        the tenant's share: `tenant_share`, or with `fair_room` an equal part of it for each
        tenant holding sessions). A `TenantSlot` is counted as its own tenant, apart from
        the others of its slot, and keeps the lane it was counted in for `close_session`."""
        a = self._arr
        with self._lock:
            if a[_SLOT["sessions_active"]] >= max_sessions:
                a[_SLOT["refused_sessions"]] += 1
                return Full("server")
            if tenant >= 0:
                return self._count_in(tenant, tenant_share, fair_room, opening=True)
            self._count_open(+1)
            return None

    def join_tenant(self, tenant: int, tenant_share: int | None = None,
                    fair_room: int | None = None) -> Full | None:
        """Count a session taken without a tenant slot (-1) against `tenant` now; what is
        full (and it stays without) when that tenant already holds its share."""
        with self._lock:
            return self._count_in(tenant, tenant_share, fair_room, opening=False)

    def _count_in(self, tenant: int, tenant_share: int | None, fair_room: int | None,
                  opening: bool) -> Full | None:
        """Under the lock: count a session (`opening`: a new one, else one counted already)
        against `tenant`'s lane, or refuse it (counted) when that tenant holds its share."""
        lane = self._lane_of(tenant)
        held = self._arr[self._lane0 + 2 * lane + 1]
        if fair_room is not None:  # the caller counts as holding, whether it does yet or not
            holders = int(self._arr[self._holders]) + (1 if held <= 0 else 0)
            share = max(1, fair_room // holders)
        else:
            holders, share = 0, tenant_share
        if share is not None and held >= share:
            self._arr[_SLOT["refused_sessions"]] += 1
            self._arr[_SLOT["refused_tenant_sessions"]] += 1
            return Full("tenant", share, holders)
        if opening:
            self._count_open(+1)
        self._arr[self._tenant0 + tenant] += 1
        self._count_lane(lane, +1)
        if self._slot >= 0:
            mine = self._held0 + self._slot * self._held_per_worker
            self._arr[mine + 1 + tenant] += 1
            self._arr[mine + 1 + self.tenants + lane] += 1
        if isinstance(tenant, TenantSlot):
            tenant.lane = lane
        return None

    def _lane_of(self, tenant: int) -> int:
        """Under the lock: the lane `tenant` counts in: the one of its slot that holds this
        tenant, else a free one (an unnamed tenant, a token's: the slot's first), else (all
        held by other tenants) one it shares, as all tenants of a slot once did."""
        first = tenant * LANES
        named = getattr(tenant, "tenant", None)
        if named is None:
            return first
        free = -1
        for lane in range(first, first + LANES):
            at = self._lane0 + 2 * lane
            if self._arr[at + 1] <= 0:
                if free < 0:
                    free = lane
            elif self._arr[at] == named:
                return lane
        if free < 0:
            return first + named % LANES
        self._arr[self._lane0 + 2 * free] = named
        return free

    def _count_lane(self, lane: int, n: int) -> None:
        """Under the lock: `n` more sessions in `lane`, and the tenants holding some."""
        at = self._lane0 + 2 * lane + 1
        before = self._arr[at]
        self._arr[at] = before + n
        self._arr[self._holders] += (before + n > 0) - (before > 0)

    def _count_open(self, n: int) -> None:
        """Under the lock: `n` more sessions open (this worker's among them)."""
        self._arr[_SLOT["sessions_active"]] += n
        if n > 0:
            self._arr[_SLOT["sessions_opened"]] += n
        if self._slot >= 0:
            self._arr[self._held0 + self._slot * self._held_per_worker] += n

    def close_session(self, tenant: int = 0) -> None:
        """A session of tenant slot `tenant` (-1: none) ended (a `TenantSlot`: in the lane it
        was counted in)."""
        with self._lock:
            self._count_open(-1)
            if tenant < 0:
                return
            lane = getattr(tenant, "lane", None)
            lane = tenant * LANES if lane is None else lane
            self._arr[self._tenant0 + tenant] -= 1
            self._count_lane(lane, -1)
            if self._slot >= 0:
                mine = self._held0 + self._slot * self._held_per_worker
                self._arr[mine + 1 + tenant] -= 1
                self._arr[mine + 1 + self.tenants + lane] -= 1

    def record(self, latency_s: float, n_nodes: int, expected: float, used: int,
               kind: str | None = None) -> None:
        """Count one answered request (and its `kind` counter): latency and tree contents
        (`used`: the OR of its nodes' source bits, tree.SOURCE_BITS)."""
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
                if used & _REST:
                    a[_SLOT["rest_hits"]] += 1
                if used & _PLD:
                    a[_SLOT["pld_hits"]] += 1
                if used & _LEARNED:
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

    def open_by_tenant(self) -> list[int]:
        """Sessions and sequences each tenant slot holds now (all workers)."""
        with self._lock:
            return [int(x) for x in self._arr[self._tenant0:self._tenant0 + self.tenants]]

    def percentile_us(self, q: float) -> float:
        """Latency percentile from the histogram (the bucket's geometric middle)."""
        hist = self._arr[_HIST0:_HIST0 + _N_BUCKETS]  # not the worker fields after it
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
