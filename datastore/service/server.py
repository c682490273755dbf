"""The gRPC draft service: REST, PLD and learned candidate trees over streaming sessions.

Each session drafts through `redraft.datastore.session.SessionDrafter` (the decoder's
in-process path runs the same class); the service adds the wire, limits, auth, tenants, the
learned index shared by all sessions and its persistence.

Why asyncio: a decoder keeps one `Session` stream open per generation and steps it hundreds
of times a second; a thread-per-stream server would pin a thread to every idle session.
Drafting itself is short CPU work (microseconds to a millisecond), so it runs inline on the
event loop and a slow session never blocks another for longer than one draft. For more than
one core, `serve(..., workers=N)` starts N such processes on one port (SO_REUSEPORT) with
shared counters.

Every request is validated before it touches the datastore; a bad one ends only its own call
with INVALID_ARGUMENT / FAILED_PRECONDITION / RESOURCE_EXHAUSTED and a message that says what
was wrong.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from redraft.datastore.build import append_corpus
from redraft.datastore.draft import LEARNED, PLD, REST, source_bits
from redraft.datastore.errors import DatastoreError, RedraftError
from redraft.datastore.learned import LearnedIndex
from redraft.datastore.service.stats import ServiceStats
from redraft.datastore.session import LEARNED_CORPUS, DraftSettings, SessionDrafter
from redraft.proto import draft_pb2, draft_pb2_grpc

log = logging.getLogger("redraft.serve")
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
_SOURCE_NAMES = {draft_pb2.SOURCE_REST: REST, draft_pb2.SOURCE_PLD: PLD,
                 draft_pb2.SOURCE_LEARNED: LEARNED}


@dataclass
class ServiceConfig:
    """Limits and defaults of one server. Every limit is enforced, never just advertised."""

    # A session costs ~300 bytes per context token (context + prompt-lookup index), so the
    # worst case is about max_sessions * max_context_len * 300 B (64 * 128 Ki: ~2.5 GB).
    max_context_len: int = 1 << 17  # tokens a session may hold
    max_budget: int = 1024  # nodes per tree a client may ask for
    max_depth: int = 128
    max_sessions: int = 64
    idle_timeout_s: float = 300.0
    max_message_bytes: int = 16 << 20
    default_budget: int = 64
    default_depth: int = 16
    grace_s: float = 5.0  # how long in-flight calls may finish after SIGTERM
    rest_max_occurrences: int = DraftSettings.rest_max_occurrences
    rest_calibration: tuple[float, float] = DraftSettings.rest_calibration
    # Shared secrets expected as "authorization: Bearer <token>"; each one is a tenant.
    token: str | tuple[str, ...] | None = None
    # Learning from served outputs: "tenant" (drafts only for the same tenant), "global"
    # (shared by all) or "off"; at most learn_max_tokens tokens kept, oldest evicted first.
    learn: str = "tenant"
    learn_max_tokens: int = 1_000_000
    # Append what was learned to the datastore (corpus "learned") this often and at
    # shutdown; 0 = keep it in memory only.
    learn_persist_s: float = 0.0
    # Check every array's crc32 in the background once serving (opening stays O(1)); a
    # damaged datastore turns health NOT_SERVING and drafting UNAVAILABLE.
    verify_checksums: bool = True


LEARN_MODES = ("tenant", "global", "off")
LEARNED_NAME_PREFIX = "learned:"  # + tenant: the name of a persisted output
_MAX_TENANT_LEN = 200


class _Abort(Exception):
    """A request the service refuses: carries the status code and the message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _bad(message: str) -> _Abort:
    return _Abort(grpc.StatusCode.INVALID_ARGUMENT, message)


class _Malformed:
    """Stands for a request whose bytes do not parse, so the handler can refuse it with
    INVALID_ARGUMENT (gRPC itself would end the call with UNKNOWN)."""

    def __init__(self, what: str, error: Exception) -> None:
        self.message = f"malformed {what}: {error}"


def _lenient(message_type):
    """A request deserializer that returns `_Malformed` instead of raising."""

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return _Malformed(message_type.DESCRIPTOR.name, exc)

    return parse


def _check_parsed(request) -> None:
    if isinstance(request, _Malformed):
        raise _bad(request.message)


class _Waiter:
    """A session as the idle sweeper and shutdown see it: its task, since when it has been
    waiting, and whether for the client's next request or for the client to read a reply."""

    __slots__ = ("task", "since", "writing", "reason")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task = task
        self.since = time.monotonic()
        self.writing = False
        self.reason: tuple[grpc.StatusCode, str] | None = None

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """Interrupt the session's wait (for a request, or for its reply to be read); it then
        ends with this status."""
        if self.reason is None and self.task is not None:
            self.reason = (code, message)
            self.task.cancel()


class DrafterService(draft_pb2_grpc.DrafterServicer):
    """Implements redraft.v1.Drafter over one open datastore Reader."""

    def __init__(self, reader, config: ServiceConfig, stats: ServiceStats) -> None:
        self.reader = reader
        self.config = config
        self.stats = stats
        self.vocab_size = int(reader.vocab_size)
        self.fingerprint = str(reader.tokenizer_fingerprint)
        self.corpora = set(getattr(reader, "corpora", {}) or {}) - {LEARNED_CORPUS}
        self.learned = (None if config.learn == "off" else
                        LearnedIndex(config.learn_max_tokens, shared=config.learn == "global"))
        tokens = config.token if isinstance(config.token, tuple) else (config.token,)
        self._tokens = [f"Bearer {t}".encode() for t in tokens if t]
        self.stopping = False
        self.damage: str | None = None  # why the datastore failed verification, if it did
        self._verifying: asyncio.Future | None = None
        self._loading: asyncio.Future | None = None  # persisted learned outputs, on a thread
        self._persisting: asyncio.Future | None = None  # the periodic persisting loop
        self._waiting: dict[int, _Waiter] = {}  # sessions now waiting for a request
        self._sweeper: asyncio.Future | None = None
        self._next_id = 0

    # ---- validation -------------------------------------------------------------------
    def _auth(self, context: grpc.aio.ServicerContext) -> str:
        """Check the bearer token; returns the tenant it stands for ("" without auth)."""
        if not self._tokens:
            return ""
        for key, value in context.invocation_metadata() or ():
            if key != "authorization":
                continue
            sent = str(value).encode()
            for expected in self._tokens:
                if hmac.compare_digest(sent, expected):
                    # a digest, not the secret itself: tenants are persisted as names
                    return "token-" + hashlib.sha256(expected).hexdigest()[:16]
        raise _Abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong token: send metadata 'authorization: Bearer <token>'",
        )

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        if not tokens:
            return
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise _bad(f"{what}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _check_fingerprint(self, fingerprint: str, required: bool) -> None:
        if not fingerprint:
            if required:
                raise _Abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "open.tokenizer_fingerprint is required (the datastore's is "
                    f"{self.fingerprint})",
                )
            return
        if fingerprint != self.fingerprint:
            raise _Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tokenizer fingerprint {fingerprint} does not match the datastore's "
                f"{self.fingerprint} (built with {getattr(self.reader, 'tokenizer_name', '?')})",
            )

    def _check_serving(self) -> None:
        if self.stopping:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if self.damage is not None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"datastore is damaged: {self.damage}")

    def _tenant(self, authenticated: str, declared: str) -> str:
        """Whose outputs a session learns from: the token's tenant, else the declared one
        (with a token, a declared tenant subdivides it)."""
        if len(declared) > _MAX_TENANT_LEN or not declared.isprintable():
            raise _bad(f"tenant must be at most {_MAX_TENANT_LEN} printable characters")
        if authenticated and declared:
            return f"{authenticated}/{declared}"
        return authenticated or declared

    def _check_budget(self, budget: int, what: str) -> None:
        if budget > self.config.max_budget:
            raise _bad(f"{what} {budget} exceeds the server's max_budget {self.config.max_budget}")

    def _params(self, p: draft_pb2.DraftParams) -> DraftSettings:
        c = self.config
        self._check_budget(p.budget, "budget")
        if p.max_depth > c.max_depth:
            raise _bad(f"max_depth {p.max_depth} exceeds the server's limit {c.max_depth}")
        sources = set()
        for s in p.sources:
            if s not in _SOURCE_NAMES:
                raise _bad(f"unknown source {s} (use SOURCE_REST={draft_pb2.SOURCE_REST}, "
                           f"SOURCE_PLD={draft_pb2.SOURCE_PLD} or "
                           f"SOURCE_LEARNED={draft_pb2.SOURCE_LEARNED})")
            sources.add(_SOURCE_NAMES[s])
        if LEARNED_CORPUS in p.corpora:
            raise _bad(f"corpus {LEARNED_CORPUS!r} is drafted through SOURCE_LEARNED (which "
                       "keeps tenants apart), not through retrieval")
        unknown = [name for name in p.corpora if name not in self.corpora]
        if unknown:
            known = ", ".join(sorted(self.corpora)) or "none"
            raise _bad(f"unknown corpora {unknown} (this datastore has: {known})")
        if p.max_match_len and p.min_match_len > p.max_match_len:
            raise _bad(f"min_match_len {p.min_match_len} > max_match_len {p.max_match_len}")
        if max(p.min_match_len, p.max_match_len) > 1024:
            raise _bad("min_match_len and max_match_len must be at most 1024")
        return DraftSettings(
            budget=p.budget or c.default_budget,
            max_depth=p.max_depth or c.default_depth,
            sources=frozenset(sources or (REST, PLD)),
            corpora=tuple(p.corpora) or None,
            min_match=p.min_match_len,
            max_match=p.max_match_len,
            rest_max_occurrences=c.rest_max_occurrences,
            rest_calibration=c.rest_calibration,
        )

    # ---- drafting ----------------------------------------------------------------------
    def _draft(self, drafter: SessionDrafter, budget: int, out: draft_pb2.DraftReply,
               kind: str | None) -> None:
        """Draft from the session's sources under the budget, count, fill `out`."""
        t0 = time.perf_counter()
        try:
            tree = drafter.propose(budget)
        except DatastoreError as exc:
            raise _bad(str(exc)) from exc
        expected = tree.expected_accepted
        t = out.tree
        t.tokens.extend(tree.tokens)
        t.parents.extend(tree.parents)
        t.probs.extend(tree.probs)
        t.sources.extend([source_bits(s) for s in tree.sources])
        out.match_len = drafter.rest_match_len
        out.expected_accepted = expected
        out.pld_match_len = drafter.pld_match_len
        out.learned_match_len = drafter.learned_match_len
        sources = {name for label in set(tree.sources) for name in label.split("+")}
        self.stats.record(time.perf_counter() - t0, len(tree), expected, sources, kind)

    # ---- RPCs --------------------------------------------------------------------------
    async def _fail(self, context: grpc.aio.ServicerContext, exc: _Abort) -> None:
        self.stats.add(errors=1)
        await context.abort(exc.code, exc.message)

    def _drafter(self, tokens, noun: str, field: str, params, tenant) -> SessionDrafter:
        """A session drafter over `tokens` (the context or an opening prompt, message `field`),
        checked first: length within max_context_len, every id in the vocabulary."""
        if len(tokens) > self.config.max_context_len:
            raise _Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{noun} of {len(tokens)} tokens exceeds max_context_len "
                f"{self.config.max_context_len}",
            )
        self._check_tokens(tokens, field)
        try:
            return SessionDrafter(tokens, params, self.reader, self.learned, tenant)
        except DatastoreError as exc:
            raise _bad(str(exc)) from exc

    async def Propose(self, request, context):
        try:
            tenant = self._auth(context)
            _check_parsed(request)
            self._check_serving()
            self._check_fingerprint(request.tokenizer_fingerprint, required=False)
            p = self._params(request.params)
            tenant = self._tenant(tenant, request.tenant)
            # learns nothing: no tokens are accepted in a one-off call
            drafter = self._drafter(request.context, "context", "context", p, tenant)
            reply = draft_pb2.DraftReply()
            self._draft(drafter, p.budget, reply, "propose_calls")
            return reply
        except _Abort as exc:
            await self._fail(context, exc)

    async def Session(self, request_iterator, context):
        try:
            tenant = self._auth(context)
            await self._session(context, tenant)
        except _Abort as exc:
            await self._fail(context, exc)

    async def _wait(self, waiter: _Waiter, io, writing: bool = False):
        """Await a read or a write of the session's stream, visible to the sweeper meanwhile.

        While it waits, the session is visible to the idle sweeper and to shutdown, which
        end it with a status (RESOURCE_EXHAUSTED / UNAVAILABLE) by cancelling the wait.
        Writes count too: a client that stops reading its replies blocks the write (HTTP/2
        flow control), and without a deadline there it would hold its session slot forever.
        A plain await keeps the per-step cost of the hot path at one read and one write.
        """
        waiter.since = time.monotonic()
        waiter.writing = writing
        self._waiting[id(waiter)] = waiter
        try:
            return await io
        except asyncio.CancelledError:
            if waiter.reason is None:
                raise  # the call itself was cancelled (client gone)
            raise _Abort(*waiter.reason) from None
        finally:
            self._waiting.pop(id(waiter), None)

    async def _read(self, context, waiter: _Waiter):
        """Next request, or None at the client's end of stream."""
        req = await self._wait(waiter, context.read())
        if req is grpc.aio.EOF:
            return None
        _check_parsed(req)
        return req

    async def _sweep(self) -> None:
        """End sessions that wait longer than the idle timeout, for a request or for the
        client to read a reply."""
        idle = self.config.idle_timeout_s
        while True:
            await asyncio.sleep(min(1.0, idle / 4))
            now = time.monotonic()
            for w in list(self._waiting.values()):
                if now - w.since <= idle or w.reason is not None:
                    continue
                if w.writing:
                    self.stats.add(sessions_unread_closed=1)
                    w.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"replies not read for more than {idle:g} s; session closed")
                else:
                    self.stats.add(sessions_idle_closed=1)
                    w.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"session idle for more than {idle:g} s; closed")

    async def _session(self, context, tenant: str) -> None:
        self._check_serving()
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep())
        waiter = _Waiter(asyncio.current_task())
        first = await self._read(context, waiter)
        if first is None:
            return
        if first.WhichOneof("kind") != "open":
            raise _bad("a session must start with an `open` message (got "
                       f"`{first.WhichOneof('kind') or 'nothing'}`)")
        opening = first.open
        self._check_fingerprint(opening.tokenizer_fingerprint, required=True)
        p = self._params(opening.params)
        tenant = self._tenant(tenant, opening.tenant)
        drafter = self._drafter(opening.prompt, "prompt", "open.prompt", p, tenant)
        if not self.stats.try_open_session(self.config.max_sessions):
            raise _Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server has max_sessions={self.config.max_sessions} sessions open; try later",
            )
        self._next_id += 1
        session_id = f"{id(self):x}-{self._next_id}"
        try:
            # Headers go out on their own first: gRPC marks them sent only when a write
            # completes, so ending a session whose first write was interrupted (by the
            # sweeper or shutdown) would otherwise send them twice and fail.
            await context.send_initial_metadata(())
            ctx = drafter.context
            msg = draft_pb2.SessionReply(session_id=session_id, context_len=len(ctx))
            self._draft(drafter, p.budget, msg.draft, None)
            await self._wait(waiter, context.write(msg), writing=True)
            while not self.stopping:
                req = await self._read(context, waiter)
                if req is None:
                    return
                if req.WhichOneof("kind") != "step":
                    raise _bad(f"session {session_id} is already open: send `step` messages")
                step = req.step
                self._check_tokens(step.accepted, "step.accepted")
                self._check_budget(step.budget, "step.budget")
                if len(ctx) + len(step.accepted) > self.config.max_context_len:
                    raise _Abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"session context would reach {len(ctx) + len(step.accepted)} tokens, "
                        f"over max_context_len {self.config.max_context_len}",
                    )
                drafter.extend(step.accepted)  # learned at once, for every session
                msg = draft_pb2.SessionReply(session_id=session_id, context_len=len(ctx))
                self._draft(drafter, step.budget or p.budget, msg.draft, "session_steps")
                await self._wait(waiter, context.write(msg), writing=True)
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        finally:
            drafter.close()
            self.stats.close_session()

    async def Info(self, request, context):
        try:
            self._auth(context)
            _check_parsed(request)
        except _Abort as exc:
            await self._fail(context, exc)
        return self.info_reply()

    def info_reply(self) -> draft_pb2.InfoReply:
        r = self.reader
        manifest = dict(getattr(r, "manifest", {}) or {})
        c = self.config
        return draft_pb2.InfoReply(
            tokenizer_fingerprint=self.fingerprint,
            tokenizer_name=str(getattr(r, "tokenizer_name", "") or ""),
            vocab_size=self.vocab_size,
            n_tokens=int(getattr(r, "n_tokens", 0) or 0),
            n_docs=int(getattr(r, "n_docs", 0) or 0),
            n_shards=len(manifest.get("shards", []) or []),
            corpora=[
                draft_pb2.Corpus(name=name, n_docs=int(v.get("n_docs", 0)),
                                 n_tokens=int(v.get("n_tokens", 0)))
                for name, v in sorted((getattr(r, "corpora", {}) or {}).items())
            ],
            format_version=int(manifest.get("version", 0) or 0),
            manifest_json=json.dumps(manifest, default=str, sort_keys=True),
            learn=self.config.learn,
            limits=draft_pb2.Limits(
                max_context_len=c.max_context_len,
                max_budget=c.max_budget,
                max_sessions=c.max_sessions,
                idle_timeout_s=int(c.idle_timeout_s),
                max_message_bytes=c.max_message_bytes,
            ),
        )

    async def Stats(self, request, context):
        try:
            self._auth(context)
            _check_parsed(request)
        except _Abort as exc:
            await self._fail(context, exc)
        s = self.stats
        limits = {k: v for k, v in asdict(self.config).items() if k != "token"}
        return draft_pb2.StatsReply(
            requests=int(s.get("requests")),
            sessions_opened=int(s.get("sessions_opened")),
            sessions_active=int(s.get("sessions_active")),
            errors=int(s.get("errors")),
            hits=int(s.get("hits")),
            latency_p50_us=s.percentile_us(0.5),
            latency_p99_us=s.percentile_us(0.99),
            uptime_s=time.time() - s.started,
            stats_json=s.to_json({
                "limits": limits, "datastore_tokens": int(getattr(self.reader, "n_tokens", 0) or 0),
                "checksums": self.verification, "learn": self.config.learn,
                **(self.learned.stats() if self.learned is not None else {})}),
        )

    @property
    def verification(self) -> str:
        """skipped, running, passed, or failed: <why>."""
        if self._verifying is None:
            return "skipped"
        if not self._verifying.done():
            return "running"
        return "passed" if self.damage is None else f"failed: {self.damage}"

    def start_background(self, health_servicer: health.aio.HealthServicer) -> None:
        """Work that must not delay serving: verifying the datastore's checksums, reloading
        persisted learned outputs, persisting new ones periodically."""
        if self.config.verify_checksums and self._verifying is None:
            self._verifying = asyncio.ensure_future(self._verify(health_servicer))
        if self.learned is None:
            return
        if LEARNED_CORPUS in (getattr(self.reader, "corpora", None) or {}):
            self._loading = asyncio.ensure_future(self._run_in_thread(self._load_learned))
        if self.config.learn_persist_s > 0:
            self._persisting = asyncio.ensure_future(self._persist_every(
                self.config.learn_persist_s))

    @staticmethod
    async def _run_in_thread(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _load_learned(self) -> None:
        """Reload the newest persisted outputs that fit the bound (on a thread, in batches,
        so sessions keep drafting meanwhile)."""
        newest: list[tuple[str, list[int]]] = []
        total = 0
        for _, name, tokens in self.reader.documents(LEARNED_CORPUS, newest_first=True):
            if total + len(tokens) > self.learned.max_tokens:
                break
            tenant = name[len(LEARNED_NAME_PREFIX):] if name.startswith(
                LEARNED_NAME_PREFIX) else name
            newest.append((tenant, tokens))
            total += len(tokens)
        newest.reverse()
        for i in range(0, len(newest), 64):
            self.learned.load(newest[i:i + 64])

    async def _persist_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await self._persist(include_open=False)

    async def _persist(self, include_open: bool) -> None:
        """Append learned outputs not yet persisted to the datastore as corpus `learned`
        (the datastore's own append path: a new file published atomically; this server keeps
        reading the snapshot it opened)."""
        path = getattr(self.reader, "path", None)
        if self.learned is None or path is None or self.damage is not None:
            return
        docs = self.learned.take_unpersisted(include_open)
        if not docs:
            return
        documents = [(LEARNED_NAME_PREFIX + tenant, tokens) for tenant, tokens in docs]
        try:
            await self._run_in_thread(functools.partial(
                append_corpus, None, path, documents=documents, fingerprint=self.fingerprint,
                corpus=LEARNED_CORPUS))
        except Exception as exc:  # the server keeps serving; what failed stays in memory
            log.error("redraft serve: could not persist %d learned outputs: %s",
                      len(documents), exc)
        else:
            self.stats.add(learned_persisted=len(documents))

    async def _verify(self, health_servicer: health.aio.HealthServicer) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.reader.verify)
        except Exception as exc:  # whatever stops verification, the data is not trusted
            self.damage = str(exc) or repr(exc)
            log.error("redraft serve: %s; health is NOT_SERVING", exc)
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def shutdown(self) -> None:
        """Stop taking work, let in-flight steps finish, end idle sessions as UNAVAILABLE.

        A checksum verification still running is awaited: its thread reads the Reader's
        map, which the caller may close once the server has stopped.
        """
        self.stopping = True
        for w in list(self._waiting.values()):
            w.end(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._verifying is not None:
            await self._verifying

    async def finish(self) -> None:
        """After the server stopped: persist what was learned. A reload still running is
        awaited (its thread reads the Reader, which the caller may close next)."""
        if self._persisting is not None:
            self._persisting.cancel()
        if self._loading is not None:
            await asyncio.gather(self._loading, return_exceptions=True)
        if self.config.learn_persist_s > 0:
            await self._persist(include_open=True)


# ---- server assembly --------------------------------------------------------------------

def add_drafter_service(service: DrafterService, server: grpc.aio.Server) -> None:
    """Register the Drafter methods as the generated stubs do, but with lenient request
    parsing: undecodable bytes reach the handler, which answers INVALID_ARGUMENT."""
    pb = draft_pb2
    handlers = {
        "Session": grpc.stream_stream_rpc_method_handler(
            service.Session, request_deserializer=_lenient(pb.SessionRequest),
            response_serializer=pb.SessionReply.SerializeToString),
        "Propose": grpc.unary_unary_rpc_method_handler(
            service.Propose, request_deserializer=_lenient(pb.ProposeRequest),
            response_serializer=pb.DraftReply.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info, request_deserializer=_lenient(pb.InfoRequest),
            response_serializer=pb.InfoReply.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            service.Stats, request_deserializer=_lenient(pb.StatsRequest),
            response_serializer=pb.StatsReply.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


@dataclass
class TLSFiles:
    cert: str
    key: str


def server_options(config: ServiceConfig, reuse_port: bool) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]


async def start_server(
    reader,
    host: str = "127.0.0.1",
    port: int = 50051,
    config: ServiceConfig | None = None,
    stats: ServiceStats | None = None,
    tls: TLSFiles | None = None,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, DrafterService, health.aio.HealthServicer, int]:
    """Build and start a server on host:port (0 = any free port); returns the bound port."""
    config = config or ServiceConfig()
    stats = stats or ServiceStats()
    server = grpc.aio.server(options=server_options(config, reuse_port))
    service = DrafterService(reader, config, stats)
    add_drafter_service(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls is not None:
            with open(tls.key, "rb") as f:
                key = f.read()
            with open(tls.cert, "rb") as f:
                cert = f.read()
            creds = grpc.ssl_server_credentials([(key, cert)])
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
    except (RuntimeError, OSError) as exc:
        raise RedraftError(f"cannot listen on {address}: {exc}") from exc
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    service.start_background(health_servicer)
    return server, service, health_servicer, bound


async def serve_forever(reader, host: str, port: int, config: ServiceConfig,
                        stats: ServiceStats | None = None, tls: TLSFiles | None = None,
                        reuse_port: bool = False, announce=print,
                        parent_pid: int | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully (in-flight work finishes).

    A worker process passes `parent_pid`: if that parent dies (even by SIGKILL, which it
    cannot forward), the worker stops too instead of holding the port forever.
    """
    server, service, health_servicer, bound = await start_server(
        reader, host, port, config, stats, tls, reuse_port
    )
    announce(f"redraft serve: listening on {host}:{bound}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    orphan_watch = None
    if parent_pid is not None:
        orphan_watch = asyncio.ensure_future(_watch_parent(parent_pid, stop))
    await stop.wait()
    if orphan_watch is not None:
        orphan_watch.cancel()
    await health_servicer.enter_graceful_shutdown()
    await service.shutdown()
    await server.stop(config.grace_s)
    await service.finish()
    announce("redraft serve: stopped")


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    stop.set()


class ServerThread:
    """A real server on a background event-loop thread, for tests, benchmarks and embedding.

    Why: the decoder and the tests need the actual gRPC service in-process (no subprocess
    start-up, no mocks); `with ServerThread(reader) as srv: DraftClient(srv.address)`.
    """

    def __init__(self, reader, host: str = "127.0.0.1", port: int = 0,
                 config: ServiceConfig | None = None, tls: TLSFiles | None = None) -> None:
        self.reader = reader
        self.host = host
        self.port = port
        self.config = config or ServiceConfig()
        self.tls = tls
        self.stats = ServiceStats()
        self.service: DrafterService | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._health = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread = threading.Thread(target=self._run, daemon=True, name="redraft-server")
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def main() -> None:
            try:
                self._server, self.service, self._health, self.port = await start_server(
                    self.reader, self.host, self.port, self.config, self.stats, self.tls
                )
            except BaseException as exc:  # reported to start()'s caller
                self._error = exc
                self._ready.set()
                return
            self._stopped = asyncio.Event()
            self._ready.set()
            await self._stopped.wait()  # set by stop() once the server has fully stopped

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    def stop(self, grace: float | None = None) -> None:
        """Graceful stop as on SIGTERM: health NOT_SERVING, idle sessions ended, then stop."""
        if self._loop is None or self._server is None or self._loop.is_closed():
            return

        async def shutdown() -> None:
            await self._health.enter_graceful_shutdown()
            await self.service.shutdown()
            await self._server.stop(self.config.grace_s if grace is None else grace)
            await self.service.finish()
            self._stopped.set()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(60)
        except RuntimeError:  # loop already gone
            pass
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=0.5)

