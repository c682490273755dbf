"""The batched RPC on the server: an engine's sequences, kept between calls, each call
drafting every sequence it names in one step of the compiled core.

A sequence is what a session is, without a stream of its own: its drafter (the same session
drafter a `Session` runs), its tenant and learned output, its slot under max_sessions, its
idle deadline. It is keyed by (the bearer token's tenant key, the request's `client`, the
caller's sequence id), so a caller reaches only its own sequences, and two callers' ids never
meet. Every entry is checked as a session's request would be; an entry that fails ends its
sequence (as a session would end) with the status and message the session would get, in its
own result, and never touches the other entries.

Drafting: every sequence of the call is extended, then all draft (`drafting.step_flat`):
one call into the core, without the GIL. Small batches draft inline on the event loop (a
hand-off to a thread costs more than they do); from `batch_offload_min` sequences on, or
when the call's opens and steps bring more than OFFLOAD_TOKENS new tokens (a step or a
prompt may be up to max_context_len: tens of ms of indexing, which the core does while
drafting), the call drafts on a thread so the loop goes on answering other calls and health
checks. Only compiled drafters go to a thread: the core's learned index is locked, the Python
reference's is not (it is for debugging).

Packed steps (`BatchRequest.steps`, an engine's common call: every running sequence steps)
take a path without a Python object per sequence where one can be avoided: the packing is
checked as a whole, the tokens against the vocabulary with one max over all of them, the
budgets and context lengths (each sequence's length is kept beside it) as arrays; the core
steps every sequence from the flat arrays (`drafting.step_flat`) and the reply's per-step
results are a few arrays' bytes. A bad step gets exactly what its step entry would get.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from redraft.datastore.drafting import BatchStep, step_flat
from redraft.datastore.drafting.implementation import uses_native
from redraft.datastore.drafting.native import NativeSessionDrafter
from redraft.datastore.service import wire
from redraft.datastore.service.config import MAX_ID_BYTES, THREADS_MIN_SEQUENCES, ServiceConfig
from redraft.datastore.service.metrics import N_BITS, count_batch
from redraft.datastore.service.refusals import Refusal, bad
from redraft.datastore.service.session_limits import take_slot
from redraft.datastore.service.stats import ServiceStats
from redraft.proto import draft_pb2
from redraft.proto.errors import DatastoreCorrupt, DatastoreError

try:  # a Batch call's metrics in one compiled call; the reference where there is no core
    from redraft.datastore.drafting.native._core import count_batch as _count_batch
except ImportError:  # pragma: no cover - the core is built wherever the tests run
    _count_batch = count_batch

_OK = grpc.StatusCode.OK.value[0]
_NOT_FOUND = grpc.StatusCode.NOT_FOUND
_SWEPT_REMEMBERED = 4096  # ids of swept sequences kept to say why they are gone
OFFLOAD_TOKENS = 1 << 16  # about 20 ms of indexing in the core
REPLY_ROW_BYTES = 400  # the most one result takes in a reply, but for its tree's nodes


def _too_long(name: str) -> bool:
    """Whether an id is over MAX_ID_BYTES in UTF-8 (a character is at most 4 bytes, so most
    ids are cleared without encoding them)."""
    return len(name) * 4 > MAX_ID_BYTES and len(name.encode()) > MAX_ID_BYTES


class BatchedSequence:
    """One sequence held between calls."""

    __slots__ = ("key", "drafter", "since", "busy", "length", "slot", "tally")

    def __init__(self, key: tuple, drafter, length: int | None = None, slot: int = 0,
                 counter: int = 0) -> None:
        self.key = key
        self.drafter = drafter
        self.slot = slot  # the tenant slot it counts against
        self.since = time.monotonic()  # last used
        self.busy = False  # a call is drafting it on a thread
        # tokens of its context (kept here: no call per check)
        self.length = len(drafter) if length is None else length
        # with metrics on: [its counter key (MetricSlots.key: tenant, corpus), the trees of
        # the call that drafted for it last ((offsets, tokens, parents, bits)) or None, its
        # row there], which its next step's accepted tokens walk down (`count_batch` reads
        # and sets them)
        self.tally: list = [counter, None, 0]


class SequenceTable:
    """The open sequences of one server process: their slots and the idle sweeper."""

    def __init__(self, config: ServiceConfig, stats: ServiceStats,
                 slot: Callable[[str, str], int]) -> None:
        self.config = config
        self.stats = stats
        self.slot = slot  # a caller's tenant slot: its token's (key[0]) or declared tenant
        self.open: dict[tuple, BatchedSequence] = {}
        self.swept: OrderedDict[tuple, float] = OrderedDict()  # recently swept: when
        self._sweeper: asyncio.Future | None = None

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep())

    def add(self, key: tuple, drafter, length: int | None = None, slot: int = 0,
            counter: int = 0) -> BatchedSequence:
        """Hold a new sequence (its slot was taken by `take_slot`)."""
        seq = self.open[key] = BatchedSequence(key, drafter, length, slot, counter)
        self.swept.pop(key, None)
        return seq

    def take_slot(self, auth: str, tenant: str) -> int:
        """A slot under max_sessions and the caller's token's (or, without auth, declared
        tenant's) share of it, or a Refusal; the tenant slot taken."""
        slot = self.slot(auth, tenant)
        take_slot(self.stats, self.config, slot)
        return slot

    def end(self, seq: BatchedSequence) -> None:
        """The sequence is over: its output is final, its slot free."""
        if self.open.pop(seq.key, None) is seq:
            try:
                seq.drafter.close()
            finally:
                self.stats.close_session(seq.slot)

    def missing(self, key: tuple, sequence: str) -> Refusal:
        """NOT_FOUND for a sequence this process does not hold, saying why if it knows."""
        if key in self.swept:
            return Refusal(_NOT_FOUND, f"sequence {sequence!r} was closed after idling more "
                           f"than {self.config.idle_timeout_s:g} s; open it again")
        return Refusal(_NOT_FOUND, f"no open sequence {sequence!r} (never opened, closed, or "
                       "opened on another server process); open it with its whole context")

    async def _sweep(self) -> None:
        idle = self.config.idle_timeout_s
        while True:
            await asyncio.sleep(min(1.0, idle / 4))
            now = time.monotonic()
            for seq in [s for s in self.open.values() if now - s.since > idle and not s.busy]:
                self.end(seq)
                self.stats.add(sessions_idle_closed=1)
                self.swept[seq.key] = now
                while len(self.swept) > _SWEPT_REMEMBERED:
                    self.swept.popitem(last=False)

    def end_all(self) -> None:
        """Shutdown: every sequence ends (its output final), the sweeper stops."""
        for seq in list(self.open.values()):
            self.end(seq)
        if self._sweeper is not None:
            self._sweeper.cancel()


class _Entry:
    """One entry of a call on its way through: its result so far, and what it drafts."""

    __slots__ = ("sequence", "seq", "accepted", "budget", "error", "drafts")

    def __init__(self, sequence: str) -> None:
        self.sequence = sequence
        self.seq: BatchedSequence | None = None
        self.accepted = None
        self.budget: int | None = None
        self.error: Refusal | None = None
        self.drafts = False


class BatchDrafting:
    """The Batch RPC of one service (handlers.DrafterService owns it)."""

    def __init__(self, service) -> None:
        self.service = service
        self.config: ServiceConfig = service.config
        self.table = SequenceTable(service.config, service.stats, service.checks.slot)
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: set[asyncio.Future] = set()
        self._native = uses_native(service.config.drafting)  # the core's drafters

    async def idle(self) -> None:
        """Wait until the calls drafting on a thread now are done (a snapshot retired now may
        then close; later calls draft from the new one)."""
        if self._in_flight:
            await asyncio.gather(*list(self._in_flight), return_exceptions=True)

    def follow(self, reader) -> None:
        """A newer snapshot is served: every held sequence drafts from it from now on (not
        only at its next step: the old snapshot's maps go as soon as it is retired)."""
        for seq in self.table.open.values():
            if not seq.busy:
                seq.drafter.use_reader(reader)

    async def run(self, request: draft_pb2.BatchRequest, auth: str) -> draft_pb2.BatchReply:
        t0 = time.perf_counter()
        self.table.start()
        checks = self.service.checks
        if request.chain > self.config.max_budget:
            raise bad(f"chain {request.chain} exceeds the server's max_budget "
                      f"{self.config.max_budget}")
        size = len(request.entries) + len(request.steps.sequences)
        if size > self.config.max_batch_entries:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"batch of {size} entries and packed steps exceeds the server's "
                          f"max_batch_entries {self.config.max_batch_entries}; split it")
        if _too_long(request.client):
            raise bad(f"client id of {len(request.client.encode())} bytes; at most "
                      f"{MAX_ID_BYTES}")
        packed = _PackedSteps(request.steps) if request.HasField("steps") else None
        if request.tokenizer_fingerprint:  # one caller has one tokenizer: checked once
            checks.check_fingerprint(request.tokenizer_fingerprint, required=True)
        defaults = _Defaults(self, request, auth)
        entries: list[_Entry] = []
        seen: set[str] = set()
        client = request.client
        step_checks = _StepChecks(self)
        for e in request.entries:
            sequence = e.sequence
            entry = _Entry(sequence)
            entries.append(entry)
            if _too_long(sequence):
                entry.error = bad(f"sequence id of {len(sequence.encode())} bytes; at most "
                                  f"{MAX_ID_BYTES}")
                continue
            if sequence in seen:
                entry.error = bad(f"sequence {sequence!r} appears twice in one batch")
                continue
            seen.add(sequence)
            key = (auth, client, sequence)
            try:
                kind = e.WhichOneof("kind")
                if kind == "step":
                    step_checks.step(entry, key, e.step)
                elif kind == "open":
                    self._open(entry, key, e.open, defaults)
                elif kind == "close":
                    self._close(entry, key, e.close)
                else:
                    raise bad(f"entry for sequence {e.sequence!r} has no open, step or close")
            except Refusal as exc:
                entry.error = exc
                if entry.seq is not None:  # a sequence ends with its failed request
                    self.table.end(entry.seq)
                    entry.seq = None
        if packed is not None:
            packed.check(self, auth, client, seen)
        drafting = [x for x in entries if x.drafts]
        out = None
        if drafting or (packed is not None and packed.seqs):
            out = await self._draft(drafting, packed, request.chain, size)
        self.service.learned_outputs.publish()
        return self._reply(entries, drafting, packed, out, t0)

    # ---- entries -----------------------------------------------------------------------
    def _held(self, sequence: str, key: tuple, required: bool = True) -> BatchedSequence | None:
        """The open sequence an entry names (NOT_FOUND if `required` and there is none),
        ABORTED while another call drafts it."""
        seq = self.table.open.get(key)
        if seq is None:
            if required:
                raise self.table.missing(key, sequence)
        elif seq.busy:
            raise Refusal(grpc.StatusCode.ABORTED, f"sequence {sequence!r} is being "
                          "drafted by another call; send one call at a time per sequence")
        return seq

    def _open(self, entry: _Entry, key: tuple, opening: draft_pb2.SessionOpen,
              defaults: _Defaults) -> None:
        checks = self.service.checks
        fingerprint = opening.tokenizer_fingerprint or defaults.request.tokenizer_fingerprint
        if not fingerprint:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "tokenizer_fingerprint is required to open a sequence (the "
                          f"datastore's is {checks.fingerprint})")
        checks.check_fingerprint(fingerprint, required=True)
        settings = (checks.settings(opening.params) if opening.HasField("params")
                    else defaults.settings())
        tenant = checks.tenant(defaults.auth, opening.tenant or defaults.tenant)
        prompt = opening.prompt
        n = len(prompt)
        if self._native:  # the ids as one array: checked at once, read by the core at once
            if n > self.config.max_context_len:
                checks.check_context(prompt, "prompt", "open.prompt")  # raises
            ids = np.array(prompt, np.int64)
            if n and (int(ids.min()) < 0 or int(ids.max()) >= checks.vocab_size):
                checks.check_tokens(ids.tolist(), "open.prompt")  # raises
            prompt = ids
        else:
            checks.check_context(prompt, "prompt", "open.prompt")
        old = self._held(entry.sequence, key, required=False)
        if old is not None:
            self.table.end(old)  # opened again: the earlier generation is over
        slot = self.table.take_slot(defaults.auth, tenant)
        try:
            drafter = self.service.new_drafter(prompt, settings, tenant)
        except BaseException:
            self.service.stats.close_session(slot)
            raise
        metrics = self.service.stats.metrics
        counter = metrics.key(slot, settings.params.corpora) if metrics.enabled else 0
        entry.seq = self.table.add(key, drafter, slot=slot, counter=counter)
        entry.drafts = True

    def _close(self, entry: _Entry, key: tuple, close: draft_pb2.SequenceClose) -> None:
        seq = entry.seq = self._held(entry.sequence, key)
        accepted = close.accepted
        self.service.checks.check_tokens(accepted, "close.accepted")
        if accepted:
            seq.drafter.extend(accepted)  # learned: the whole output is final
        self.table.end(seq)

    # ---- drafting ----------------------------------------------------------------------
    async def _draft(self, drafting: list[_Entry], packed: _PackedSteps | None,
                     chain: int, rows: int) -> BatchStep:
        """One step of the core for the call: the drafting entries' sequences first, in
        order, then the packed steps that passed their checks (`rows`: the reply's results,
        entries and packed steps)."""
        seqs = [x.seq for x in drafting]
        if drafting:
            counts = np.array([len(x.accepted) if x.accepted is not None else 0
                               for x in drafting], np.uint32)
            parts = [np.array(x.accepted, np.uint32) for x in drafting if x.accepted]
            tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
            budgets = np.array([x.budget or 0 for x in drafting], np.uint32)
            if packed is not None and packed.seqs:
                seqs += packed.seqs
                tokens = np.concatenate([tokens, packed.ok_tokens])
                counts = np.concatenate([counts, packed.ok_counts])
                budgets = np.concatenate([budgets, packed.ok_budgets if packed.ok_budgets
                                          is not None else np.zeros(len(packed.seqs),
                                                                    np.uint32)])
        else:
            seqs = packed.seqs
            tokens, counts, budgets = packed.ok_tokens, packed.ok_counts, packed.ok_budgets
        reader = self.service.reader
        drafters = [seq.drafter for seq in seqs]
        for d in drafters:
            d.use_reader(reader)  # the newest snapshot, between two steps
        threads = self.config.batch_threads if len(seqs) >= THREADS_MIN_SEQUENCES else 1
        new = len(tokens) + sum(x.seq.length for x in drafting if x.accepted is None)  # opens
        big = len(seqs) >= self.config.batch_offload_min or new > OFFLOAD_TOKENS
        if not big or not all(d.__class__ is NativeSessionDrafter for d in drafters):
            out = step_flat(drafters, tokens, counts, budgets, chain, threads)
        else:
            for seq in seqs:
                seq.busy = True
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="redraft-batch")
            fut = asyncio.get_running_loop().run_in_executor(
                self._pool, step_flat, drafters, tokens, counts, budgets, chain, threads)
            self._in_flight.add(fut)
            try:
                out = await fut
            finally:
                self._in_flight.discard(fut)
                for seq in seqs:
                    seq.busy = False
            if self.service.reader is not reader:  # swapped meanwhile: `follow` skipped these
                for d in drafters:
                    d.use_reader(self.service.reader)
        _fit_reply(out, self._reply_nodes(rows), self.config)
        now = time.monotonic()
        for seq, n in zip(seqs, out.context_lens.tolist()):
            seq.since = now
            seq.length = n
        if self.service.stats.metrics.enabled:  # counted with the reply (`_count`)
            out.counted = ([seq.tally for seq in seqs], tokens, counts)
        if out.errors:
            n_entries = len(drafting)
            for i, err in out.errors.items():
                refusal = self._refusal(err, reader)
                if i < n_entries:
                    drafting[i].error = refusal
                else:
                    packed.failed_drafting(i - n_entries, refusal)
                self.table.end(seqs[i])
        return out

    def _refusal(self, err: Exception, reader) -> Refusal:
        """What a sequence whose drafting failed gets."""
        if isinstance(err, Refusal):
            return err
        if isinstance(err, DatastoreCorrupt):
            return self.service.damaged(err, reader)
        if isinstance(err, (DatastoreError, ValueError, TypeError)):
            return bad(str(err))
        return Refusal(grpc.StatusCode.INTERNAL, f"drafting failed: {err}")

    def _reply_nodes(self, rows: int) -> int:
        """Tree nodes a reply of `rows` results has room for under max_message_bytes: 13
        bytes a node (token, parent, prob, source bits), and up to REPLY_ROW_BYTES for
        each result (its id, figures and a refusal's message)."""
        return max(0, (self.config.max_message_bytes - REPLY_ROW_BYTES * rows - 4096) // 13)

    def _reply(self, entries: list[_Entry], drafting: list[_Entry],
               packed: _PackedSteps | None, out: BatchStep | None,
               t0: float) -> draft_pb2.BatchReply:
        reply = draft_pb2.BatchReply()
        row = {id(x): i for i, x in enumerate(drafting)}
        # the drafting entries' rows come first (plain lists: one conversion per call)
        context_lens = out.context_lens[:len(drafting)].tolist() if out is not None else ()
        errors = [x.error for x in entries]
        failed = len(errors) - errors.count(None)
        wire.put_results(reply, [x.sequence for x in entries], errors,
                         [row.get(id(x)) for x in entries], out, context_lens)
        if packed is not None:
            failed += packed.fill(reply.steps, out, len(drafting))
        if out is not None:
            # a failed row drafted nothing: every row's nodes go as they are
            wire.put_trees(reply, out)
            sizes, used = out.sizes(), out.used
            self.service.stats.record_batch(
                time.perf_counter() - t0, len(sizes) - len(out.errors), int(out.offsets[-1]),
                float(out.expected.sum()), int(np.count_nonzero(sizes)),
                rest=int(np.count_nonzero(used & 1)), pld=int(np.count_nonzero(used & 2)),
                learned=int(np.count_nonzero(used & 4)))
        if failed:
            self.service.stats.add(errors=failed)
        metrics = self.service.stats.metrics
        if metrics.enabled:
            if failed:
                codes = [x.error.code for x in entries if x.error is not None]
                if packed is not None:
                    codes += [e.code for e in packed.errors.values()]
                for code in codes:
                    metrics.refused(code.value[0])
            self._count(metrics, out, len(entries) + (len(packed.ids) if packed else 0), t0)
        reply.server_us = (time.perf_counter() - t0) * 1e6
        return reply

    def _count(self, metrics, out: BatchStep | None, rows: int, t0: float) -> None:
        """A call's figures for /metrics: its time and entries, and in one call of the core
        (`count_batch`) each drafted tree's nodes by its sequence's counter key and source,
        and the draft tokens its steps accepted, walked down the trees drafted for them
        before (each sequence's `tally`, which the call then sets to its own)."""
        counted = getattr(out, "counted", None)
        if counted is not None:  # the trees as the reply has them
            tallies, tokens, counts = counted
            _count_batch(tallies, (out.offsets, out.tokens, out.parents, out.bits), tokens,
                         counts, metrics.batch_counts, metrics.keys, N_BITS)
        metrics.batch(time.perf_counter() - t0, rows)


class _PackedSteps:
    """A call's packed steps (BatchRequest.steps) on their way through: the packing checked
    as a whole, each step as a step entry would be (the same refusals, in the same order:
    duplicate, held, then the step rule over arrays, `RequestValidator.check_steps`)."""

    def __init__(self, steps: draft_pb2.PackedSteps) -> None:
        u = wire.unpack_steps(steps)  # refuses a packing that does not add up
        self.ids, self.counts, self.tokens, self.budgets = u.ids, u.counts, u.tokens, u.budgets
        self.errors: dict[int, Refusal] = {}
        self.seqs: list[BatchedSequence] = []  # those that draft, in order
        self.ok = None  # their indexes, when some failed

    def check(self, batch_rpc: BatchDrafting, auth: str, client: str, seen: set[str]) -> None:
        errors = self.errors
        n = len(self.ids)
        seqs: list[BatchedSequence | None] = [None] * n
        lens = [0] * n
        get = batch_rpc.table.open.get
        for i, sid in enumerate(self.ids):
            if sid in seen:
                errors[i] = bad(f"sequence {sid!r} appears twice in one batch")
                continue
            seen.add(sid)
            seq = get((auth, client, sid))
            if seq is None or seq.busy:
                try:
                    batch_rpc._held(sid, (auth, client, sid))
                except Refusal as exc:
                    errors[i] = exc
                continue
            seqs[i] = seq
            lens[i] = seq.length
        tokens, counts, budgets = self.tokens, self.counts, self.budgets
        # steps that reached their sequence and failed: it ends
        ended = batch_rpc.service.checks.check_steps(tokens, counts, budgets,
                                                    np.array(lens, np.int64), errors)
        for i in ended:
            batch_rpc.table.end(seqs[i])
        if not errors:
            self.seqs = seqs
            self.ok_tokens, self.ok_counts, self.ok_budgets = tokens, counts, budgets
            return
        keep = np.ones(n, bool)
        keep[list(errors)] = False
        self.ok = np.flatnonzero(keep)
        self.seqs = [seqs[i] for i in self.ok.tolist()]
        self.ok_tokens = tokens[np.repeat(keep, counts)]
        self.ok_counts = counts[keep]
        self.ok_budgets = budgets[keep] if budgets is not None else None

    def failed_drafting(self, row: int, refusal: Refusal) -> None:
        """The core failed the `row`-th step that drafted."""
        self.errors[row if self.ok is None else int(self.ok[row])] = refusal

    def fill(self, results: draft_pb2.PackedResults, out: BatchStep | None, first: int
             ) -> int:
        """The steps' results into `results` (their rows of `out` start at `first`);
        returns how many failed."""
        n = len(self.ids)
        if out is None:  # every step failed before drafting
            nodes, lens = np.zeros(n, "<u4"), np.zeros(n, "<u8")
            mls, expected = np.zeros((n, 3), "<u4"), np.zeros(n, "<f4")
        else:
            nodes = out.sizes()[first:].astype("<u4")
            lens = out.context_lens[first:].astype("<u8", copy=False)
            mls = out.match_lens[first:].astype("<u4")
            expected = out.expected[first:].astype("<f4")
            if self.ok is not None:
                nodes, lens, mls, expected = (_scattered(a, self.ok, n)
                                              for a in (nodes, lens, mls, expected))
        wire.put_step_results(results, nodes, lens, mls, expected, self.errors)
        return len(self.errors)


def _fit_reply(out: BatchStep, room: int, config: ServiceConfig) -> None:
    """Keep the call's trees within `room` nodes: the rows from the first that would go
    past it draft nothing and fail with RESOURCE_EXHAUSTED (their sequences end, as any
    failed entry's does), instead of the whole reply failing gRPC's size limit after
    every sequence was drafted (the caller then lost all of them, still held here)."""
    ends = out.offsets[1:]
    if not len(ends) or int(ends[-1]) <= room:
        return
    first = int(np.searchsorted(ends, room, "right"))
    cut = int(out.offsets[first])
    out.offsets = out.offsets.copy()
    out.offsets[first + 1:] = cut
    out.tokens, out.parents = out.tokens[:cut], out.parents[:cut]
    out.probs, out.bits = out.probs[:cut], out.bits[:cut]
    out.expected, out.used = out.expected.copy(), out.used.copy()
    out.expected[first:], out.used[first:] = 0, 0
    refusal = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"the call's trees would not fit the server's max_message_bytes "
                      f"{config.max_message_bytes} reply; ask smaller budgets or fewer "
                      "sequences per call")
    for i in range(first, len(ends)):
        out.errors.setdefault(i, refusal)


def _scattered(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """`values` (one per row of `rows`) at those rows of n zeros."""
    out = np.zeros((n, *values.shape[1:]), values.dtype)
    out[rows] = values
    return out


class _StepChecks:
    """A call's step entries checked as a session's step is (held, then the step rule,
    `RequestValidator.check_step`), with what every step needs looked up once per call:
    most of a call's entries are steps, and their checks run once per sequence per engine
    step."""

    def __init__(self, batch_rpc: BatchDrafting) -> None:
        self.batch_rpc = batch_rpc
        self.open = batch_rpc.table.open
        self.check = batch_rpc.service.checks.check_step

    def step(self, entry: _Entry, key: tuple, step: draft_pb2.SessionStep) -> None:
        seq = self.open.get(key)
        if seq is None or seq.busy:  # the refusal, from the general path
            seq = self.batch_rpc._held(entry.sequence, key)
        entry.seq = seq
        accepted = step.accepted
        self.check(accepted, step.budget, len(seq.drafter))
        entry.accepted = accepted
        entry.budget = step.budget or None
        entry.drafts = True


class _Defaults:
    """What a call's opens share, checked once and only if an open needs it."""

    def __init__(self, batch_rpc: BatchDrafting, request: draft_pb2.BatchRequest,
                 auth: str) -> None:
        self.checks = batch_rpc.service.checks
        self.request = request
        self.auth = auth
        self.tenant = request.tenant
        self._settings = None

    def settings(self):
        if self._settings is None:
            self._settings = self.checks.settings(self.request.params)
        return self._settings
