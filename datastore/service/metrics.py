"""What `redraft serve --metrics-port` counts, in shared memory, for Prometheus.

Why shared memory, as `stats`: with `--workers N` every process serves its own calls, and
`/metrics` (served by the parent) must report the whole server. Why counted in the process
first: a step must not pay for a lock and shared-memory writes; each worker adds up its
counts in plain Python containers (a Batch call's in one call of the compiled core,
`count_batch`) and copies them to its own region of the shared array every PUBLISH_S (and
at shutdown), so a scrape is at most that much behind, and the reader adds the regions up.
Every label is bounded: the tenant is a tenant slot of the service's limits (one per
configured token, labelled with its key's hash, or one of TENANT_BUCKETS slots of declared
tenants without auth), the corpus one of CORPUS_SLOTS (the corpora a session or sequence
restricts retrieval to: "all" unrestricted, the first CORPUS_SLOTS - 2 selections asked
for by their names, "other" past them), the source a combination of the three source
bits, the position one of POSITIONS, the status one of gRPC's 17 codes. Nothing here is
counted unless metrics are on (`MetricSlots.enabled`), so a server without
`--metrics-port` pays nothing.

Accepted tokens are what clients report back: a step's accepted tokens, walked down the
tree the server drafted for that session or sequence before; each node they follow is an
accepted draft token (vLLM's `num_accepted_tokens`), counted by its source and its depth.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections.abc import Iterable, Sequence
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
# The corpus label: a session's or sequence's corpus selection (DraftParams.corpora), in one
# of these slots: ALL_CORPORA unrestricted, then each selection in the order first asked for
# (its names, sorted, joined by "+"), OTHER_CORPORA once the slots between are taken (or for
# a label too long to share, or one that would read as "all" or "other").
CORPUS_SLOTS = 8
ALL_CORPORA, OTHER_CORPORA = 0, CORPUS_SLOTS - 1
CORPUS_LABEL_BYTES = 240  # a selection's label as the workers share it, at most
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


PUBLISH_S = 0.1  # how often a worker copies its counts to shared memory


class MetricSlots:
    """The shared array behind `/metrics` and this process's counts on their way there.

    Counted by key: tenant slot * CORPUS_SLOTS + corpus slot (`key`). Per worker region:
    steps drafted by key; draft and accepted tokens by key * N_BITS + source bits; accepted
    tokens by position (these four first: the block `count_batch` adds a Batch call's
    counts to); histograms (per bucket, then +Inf, then the sum); refusals by status;
    COUNTERS. Beside them: each worker's gauges (WORKER_GAUGES, written at once: rare), the
    server's `stopping` flag, and the corpus slots' labels (shared bytes)."""

    def __init__(self, ctx: Any = None, workers: int = 1, tenants: int = 1) -> None:
        self.workers = max(1, workers)
        self.tenants = max(1, tenants)
        self.keys = k = self.tenants * CORPUS_SLOTS
        layout = [("drafts", k), ("draft_tokens", k * N_BITS), ("accepted", k * N_BITS),
                  ("positions", POSITIONS), ("step_hist", len(TIME_BUCKETS) + 2),
                  ("batch_hist", len(TIME_BUCKETS) + 2),
                  ("entries_hist", len(ENTRY_BUCKETS) + 2), ("refusals", STATUS_CODES),
                  ("counters", len(COUNTERS))]
        self.at: dict[str, int] = {}
        size = 0
        for name, n in layout:
            self.at[name] = size
            size += n
        self.region = size  # per worker
        self.counted = self.at["step_hist"]  # count_batch's block: drafts .. positions
        self._gauges0 = self.workers * size
        self._stopping = self._gauges0 + self.workers * len(WORKER_GAUGES)
        total = self._stopping + 1
        names = CORPUS_SLOTS * CORPUS_LABEL_BYTES
        if ctx is None:
            self._arr: Any = np.zeros(total)
            self._names: Any = bytearray(names)
            self._lock: Any = threading.Lock()
        else:
            self._arr = ctx.Array("d", total, lock=False)
            self._names = ctx.Array("c", names, lock=False)
            self._lock = ctx.Lock()
        self.enabled = False
        self.worker = -1  # this process's region, once it serves
        self._reset_local()

    def __getstate__(self) -> dict:
        """To a worker process: the shared arrays, never this process's counts."""
        state = self.__dict__.copy()
        for name in _LOCAL:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_local()

    def _reset_local(self) -> None:
        # a Batch call's counts (count_batch adds to it), laid out as the region's first part
        self.batch_counts = np.zeros(self.counted)
        self._drafts: dict[int, int] = {}  # a Session's: steps drafted by key
        self._tokens: dict[int, int] = {}  # draft tokens by key * N_BITS + source bits
        self._accepted: dict[int, int] = {}  # accepted draft tokens, the same
        self._positions = [0] * POSITIONS
        self._step_hist = [0.0] * (len(TIME_BUCKETS) + 2)
        self._batch_hist = [0.0] * (len(TIME_BUCKETS) + 2)
        self._entries_hist = [0.0] * (len(ENTRY_BUCKETS) + 2)
        self._refusals = [0] * STATUS_CODES
        self._counters = [0.0] * len(COUNTERS)
        self._corpus: dict[tuple, int] = {}  # corpus selections' slots, once looked up
        self._base: np.ndarray | None = None
        self._shared: np.ndarray | None = None

    def _view(self) -> np.ndarray:
        """The shared array as numpy (the caller holds the lock to read or write counts)."""
        if self._shared is None:
            self._shared = np.frombuffer(self._arr, np.float64)
        return self._shared

    # ---- counting (worker processes, on the event loop) ----------------------------------
    def serve_as(self, worker: int) -> None:
        """This process serves as worker slot `worker`: its counts go to that region, on
        from what a worker that died there had counted (counters never go back)."""
        self.worker = worker
        self._reset_local()
        if not 0 <= worker < self.workers:
            return
        with self._lock:  # added to this process's counts when published
            self._base = self._view()[worker * self.region:(worker + 1) * self.region].copy()

    def key(self, slot: int, corpora: Sequence[str] | None) -> int:
        """The key a session or sequence counts under: its tenant slot (0 if none) and the
        corpus slot of the corpora it restricts retrieval to (None or empty: all)."""
        if not 0 <= slot < self.tenants:
            slot = 0
        return slot * CORPUS_SLOTS + self.corpus_slot(corpora)

    def corpus_slot(self, corpora: Sequence[str] | None) -> int:
        """The corpus slot of a selection: ALL_CORPORA for none; else its label's slot,
        shared by every worker, taken the first time any of them is asked for it (under the
        lock: once per selection and process), OTHER_CORPORA once all are taken."""
        if not corpora:
            return ALL_CORPORA
        selection = tuple(corpora)
        slot = self._corpus.get(selection)
        if slot is None:
            slot = self._corpus[selection] = self._claim("+".join(sorted(set(selection))))
        return slot

    def _claim(self, label: str) -> int:
        data = label.encode("utf-8", "surrogatepass")
        if len(data) > CORPUS_LABEL_BYTES or b"\0" in data or label in ("all", "other"):
            return OTHER_CORPORA
        n = CORPUS_LABEL_BYTES
        with self._lock:
            names = bytes(self._names)
            for i in range(ALL_CORPORA + 1, OTHER_CORPORA):
                held = names[i * n:(i + 1) * n].rstrip(b"\0")
                if held == data:
                    return i
                if not held:
                    self._names[i * n:i * n + len(data)] = data
                    return i
        return OTHER_CORPORA

    def drafted(self, key: int, seconds: float | None, bits: list[int],
                kinds: Iterable[int], accepted: Sequence[int]) -> None:
        """One Session reply of the session counted under `key`: its tree's nodes' source
        bits (`bits`; `kinds`: the distinct ones, which the server has already), the bits
        of the draft tokens the step it answers accepted (in path order), and the server
        time of a step (None for the reply to an open). A few C-level counts per step, no
        Python loop per node."""
        if not 0 <= key < self.keys:
            key = 0
        base = key * N_BITS
        if bits:
            self._drafts[key] = self._drafts.get(key, 0) + 1
            tokens = self._tokens
            for b in kinds:
                i = base + (b if 0 <= b < N_BITS else 0)
                tokens[i] = tokens.get(i, 0) + bits.count(b)
        if accepted:
            total = self._accepted
            for b in accepted:
                i = base + (b if 0 <= b < N_BITS else 0)
                total[i] = total.get(i, 0) + 1
            positions = self._positions
            for p in range(min(len(accepted), POSITIONS)):
                positions[p] += 1
        if seconds is not None:
            hist = self._step_hist
            hist[bisect.bisect_left(TIME_BUCKETS, seconds)] += 1
            hist[-1] += seconds

    def batch(self, seconds: float, entries: int) -> None:
        """One Batch call: its server time and entries (its trees and accepted tokens are
        counted into `batch_counts` by `count_batch`)."""
        hist = self._batch_hist
        hist[bisect.bisect_left(TIME_BUCKETS, seconds)] += 1
        hist[-1] += seconds
        hist = self._entries_hist
        hist[bisect.bisect_left(ENTRY_BUCKETS, entries)] += 1
        hist[-1] += entries

    def refused(self, code: int, n: int = 1) -> None:
        """A call (or a Batch entry) refused with gRPC status `code`."""
        if self.enabled and 0 <= code < STATUS_CODES:
            self._refusals[code] += n

    def add(self, name: str, n: float = 1) -> None:
        """One of COUNTERS."""
        if self.enabled:
            self._counters[COUNTERS.index(name)] += n

    def publish(self) -> None:
        """Copy this process's counts to its region of the shared array (every PUBLISH_S
        and at shutdown): whole values, so a copy missed is caught up by the next."""
        w = self.worker
        if not self.enabled or not 0 <= w < self.workers:
            return
        values = np.zeros(self.region) if self._base is None else self._base.copy()
        values[:self.counted] += self.batch_counts
        at = self.at
        for key, local in (("drafts", self._drafts), ("draft_tokens", self._tokens),
                           ("accepted", self._accepted)):
            for i, n in local.items():
                values[at[key] + i] += n
        for key, array in (("positions", self._positions), ("step_hist", self._step_hist),
                           ("batch_hist", self._batch_hist),
                           ("entries_hist", self._entries_hist),
                           ("refusals", self._refusals), ("counters", self._counters)):
            values[at[key]:at[key] + len(array)] += array
        with self._lock:
            self._view()[w * self.region:(w + 1) * self.region] = values

    async def publish_every(self, seconds: float = PUBLISH_S) -> None:
        """Publish until cancelled (a worker's background task)."""
        while True:
            await asyncio.sleep(seconds)
            self.publish()

    def set_worker(self, worker: int, **gauges: float) -> None:
        """Worker slot `worker`'s gauges (WORKER_GAUGES), replacing earlier values."""
        if not 0 <= worker < self.workers:
            return
        base = self._gauges0 + worker * len(WORKER_GAUGES)
        with self._lock:
            for name, value in gauges.items():
                self._arr[base + WORKER_GAUGES.index(name)] = value

    def clear_worker(self, worker: int) -> None:
        """A worker that died: its gauges are no one's (its counts stay, for the worker
        that takes its slot to go on from)."""
        self.set_worker(worker, **{name: 0 for name in WORKER_GAUGES})

    def set_stopping(self) -> None:
        """The server is shutting down: not ready, whatever its workers say."""
        with self._lock:
            self._arr[self._stopping] = 1

    # ---- reading (the process that serves /metrics) --------------------------------------
    def read(self) -> dict[str, Any]:
        """Every figure, the workers' regions added up; `corpora`: each corpus slot's label
        ("" while no selection has taken it)."""
        with self._lock:
            values = self._view().copy()
            names = bytes(self._names)
        size = self.region
        total = values[:self.workers * size].reshape(self.workers, size).sum(axis=0).tolist()
        at, k = self.at, self.keys

        def block(name: str, n: int) -> list[float]:
            return total[at[name]:at[name] + n]

        n = CORPUS_LABEL_BYTES
        corpora = [names[i * n:(i + 1) * n].rstrip(b"\0").decode("utf-8", "replace")
                   for i in range(CORPUS_SLOTS)]
        corpora[ALL_CORPORA], corpora[OTHER_CORPORA] = "all", "other"
        g = len(WORKER_GAUGES)
        raw = values[self._gauges0:self._gauges0 + self.workers * g].tolist()
        return {
            "drafts": block("drafts", k),
            "draft_tokens": block("draft_tokens", k * N_BITS),
            "accepted": block("accepted", k * N_BITS),
            "positions": block("positions", POSITIONS),
            "step_hist": block("step_hist", len(TIME_BUCKETS) + 2),
            "batch_hist": block("batch_hist", len(TIME_BUCKETS) + 2),
            "entries_hist": block("entries_hist", len(ENTRY_BUCKETS) + 2),
            "refusals": block("refusals", STATUS_CODES),
            "counters": dict(zip(COUNTERS, block("counters", len(COUNTERS)))),
            "stopping": bool(values[self._stopping]),
            "workers": [dict(zip(WORKER_GAUGES, raw[w * g:(w + 1) * g]))
                        for w in range(self.workers)],
            "corpora": corpora,
        }

    def ready(self) -> bool:
        """Some worker listens with its datastore open, and the server is not stopping."""
        with self._lock:
            if self._arr[self._stopping]:
                return False
            k = len(WORKER_GAUGES)
            return any(self._arr[self._gauges0 + w * k] for w in range(self.workers))


# This process's counts and views (MetricSlots._reset_local): never sent to another process.
_LOCAL = ("batch_counts", "_drafts", "_tokens", "_accepted", "_positions", "_step_hist",
          "_batch_hist", "_entries_hist", "_refusals", "_counters", "_corpus", "_base",
          "_shared")


def walk_accepted(tokens: Sequence[int], parents: Sequence[int], bits: Sequence,
                  start: int, end: int, accepted: Sequence[int]) -> list:
    """The sources (`bits`: source bits or labels, per node) of the nodes of the tree in
    [start, end) (parents local to it) that the client's accepted tokens follow from the
    root, in path order.

    `list.index` scans in C: a step costs a few hundred nanoseconds per accepted token, not
    a Python loop over the tree."""
    out: list = []
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


def count_batch(tallies: Sequence[list], trees: tuple, accepted, counts, into, n_keys: int,
                n_bits: int) -> None:
    """What a Batch call counts, added to `into` ([drafts: n_keys][draft tokens: n_keys x
    n_bits][accepted: n_keys x n_bits][accepted by depth: the rest]). Sequence i's tally is
    a list [counter, last, row] (a BatchedSequence's `tally`): it counts under its counter;
    its tree now, row i of `trees` = (offsets, tokens, parents, bits), is a draft if it has a
    node, each node a draft token under its source bits; `last` is None or the trees of its
    call before, down whose row `row` its counts[i] tokens of `accepted` walk
    (`walk_accepted`); then its last is `trees` and its row i.

    The reference of the compiled core's count_batch (what the service runs: one call per
    Batch call, no Python loop per sequence), and what runs without the core."""
    if len(into) < n_keys * (1 + 2 * n_bits):
        raise ValueError("into is smaller than n_keys * (1 + 2 * n_bits)")
    keys = [int(tally[0]) for tally in tallies]
    if any(not 0 <= k < n_keys for k in keys):
        raise ValueError(f"a counter is outside [0, {n_keys})")
    tokens_at, accepted_at, depth_at = n_keys, n_keys * (1 + n_bits), n_keys * (1 + 2 * n_bits)
    depths = len(into) - depth_at
    offsets, bits = [int(x) for x in trees[0]], [int(b) for b in trees[3]]
    flat = [int(t) for t in accepted]
    start = 0
    for i, ((_, last, row), key) in enumerate(zip(tallies, keys)):
        a, b = offsets[i], offsets[i + 1]
        if b > a:
            into[key] += 1
            for bit in bits[a:b]:
                into[tokens_at + key * n_bits + (bit if bit < n_bits else 0)] += 1
        end = start + int(counts[i])
        if last is not None:
            t_offsets, t_tokens, t_parents, t_bits = last
            walked = walk_accepted([int(x) for x in t_tokens], [int(x) for x in t_parents],
                                   [int(x) for x in t_bits], int(t_offsets[row]),
                                   int(t_offsets[row + 1]), flat[start:end])
            for depth, bit in enumerate(walked):
                into[accepted_at + key * n_bits + (bit if bit < n_bits else 0)] += 1
                if depth < depths:
                    into[depth_at + depth] += 1
        start = end
    for i, tally in enumerate(tallies):
        tally[1:] = [trees, i]


def now_unix() -> float:
    """Wall-clock time, for the last persist's gauge."""
    return time.time()
