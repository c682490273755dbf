"""The gRPC draft service: REST and PLD candidate trees over streaming sessions.

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
import hmac
import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from redraft.datastore.draft import PLD, REST, Draft, source_bits
from redraft.datastore.errors import DatastoreError, RedraftError
from redraft.datastore.merge import REST_CALIBRATION, calibrate, merge_drafts
from redraft.datastore.pld import PromptLookup
from redraft.datastore.service_stats import ServiceStats
from redraft.proto import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
_SOURCE_NAMES = {draft_pb2.SOURCE_REST: REST, draft_pb2.SOURCE_PLD: PLD}


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
    default_min_match: int = 2  # REST; PLD's own default is PromptLookup's
    default_max_match: int = 16
    grace_s: float = 5.0  # how long in-flight calls may finish after SIGTERM
    # Occurrences of the longest match the Reader samples: 64 drafts as well as its default
    # 256 on held-out code (same accepted tokens per step) at ~70% of the lookup time.
    rest_max_occurrences: int = 64
    # REST probabilities p become scale * p**power (merge.REST_CALIBRATION; (1, 1) = raw)
    rest_calibration: tuple[float, float] = REST_CALIBRATION
    token: str | None = None  # shared secret expected as "authorization: Bearer <token>"


@dataclass
class _Params:
    budget: int
    max_depth: int
    sources: frozenset[str]
    corpora: list[str] | None
    min_match: int  # 0 = each source's default
    max_match: int


class _Abort(Exception):
    """A request the service refuses: carries the status code and the message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _bad(message: str) -> _Abort:
    return _Abort(grpc.StatusCode.INVALID_ARGUMENT, message)


class _Waiter:
    """A session as the idle sweeper and shutdown see it: its task and when it last spoke."""

    __slots__ = ("task", "since", "reason")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task = task
        self.since = time.monotonic()
        self.reason: tuple[grpc.StatusCode, str] | None = None

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """Interrupt the session's wait for a request; it then ends with this status."""
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
        self.corpora = set(getattr(reader, "corpora", {}) or {})
        self.stopping = False
        self._waiting: dict[int, _Waiter] = {}  # sessions now waiting for a request
        self._sweeper: asyncio.Future | None = None
        self._next_id = 0

    # ---- validation -------------------------------------------------------------------
    def _auth(self, context: grpc.aio.ServicerContext) -> None:
        token = self.config.token
        if not token:
            return
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and hmac.compare_digest(
                str(value).encode(), f"Bearer {token}".encode()
            ):
                return
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

    def _check_budget(self, budget: int, what: str) -> None:
        if budget > self.config.max_budget:
            raise _bad(f"{what} {budget} exceeds the server's max_budget {self.config.max_budget}")

    def _params(self, p: draft_pb2.DraftParams) -> _Params:
        c = self.config
        self._check_budget(p.budget, "budget")
        if p.max_depth > c.max_depth:
            raise _bad(f"max_depth {p.max_depth} exceeds the server's limit {c.max_depth}")
        sources = set()
        for s in p.sources:
            if s not in _SOURCE_NAMES:
                raise _bad(f"unknown source {s} (use SOURCE_REST={draft_pb2.SOURCE_REST} or "
                           f"SOURCE_PLD={draft_pb2.SOURCE_PLD})")
            sources.add(_SOURCE_NAMES[s])
        unknown = [name for name in p.corpora if name not in self.corpora]
        if unknown:
            known = ", ".join(sorted(self.corpora)) or "none"
            raise _bad(f"unknown corpora {unknown} (this datastore has: {known})")
        if p.max_match_len and p.min_match_len > p.max_match_len:
            raise _bad(f"min_match_len {p.min_match_len} > max_match_len {p.max_match_len}")
        if max(p.min_match_len, p.max_match_len) > 1024:
            raise _bad("min_match_len and max_match_len must be at most 1024")
        return _Params(
            budget=p.budget or c.default_budget,
            max_depth=p.max_depth or c.default_depth,
            sources=frozenset(sources or (REST, PLD)),
            corpora=list(p.corpora) or None,
            min_match=p.min_match_len,
            max_match=p.max_match_len,
        )

    def _new_pld(self, p: _Params) -> PromptLookup:
        max_ngram = p.max_match or 8
        min_ngram = min(p.min_match or 1, max_ngram)
        return PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram)

    # ---- drafting ----------------------------------------------------------------------
    def _draft(self, context: Sequence[int], pld: PromptLookup | None, p: _Params,
               budget: int, out: draft_pb2.DraftReply, kind: str | None) -> None:
        """Draft from the requested sources, merge under the budget, count, fill `out`."""
        t0 = time.perf_counter()
        drafts: list[Draft] = []
        rest_match = pld_match = 0
        if REST in p.sources and context:
            max_match = p.max_match or self.config.default_max_match
            min_match = min(p.min_match or self.config.default_min_match, max_match)
            try:
                rest = self.reader.propose(
                    list(context[-max_match:]),
                    budget=budget,
                    max_depth=p.max_depth,
                    max_match_len=max_match,
                    min_match_len=min_match,
                    max_occurrences=self.config.rest_max_occurrences,
                    corpora=p.corpora,
                )
            except DatastoreError as exc:
                raise _bad(str(exc)) from exc
            rest_match = rest.match_len
            drafts.append(calibrate(rest, *self.config.rest_calibration))
        if pld is not None:
            d = pld.propose(budget=budget, max_depth=p.max_depth)
            pld_match = d.match_len
            drafts.append(d)
        tree = merge_drafts(drafts, budget)
        expected = tree.expected_accepted
        t = out.tree
        t.tokens.extend(tree.tokens)
        t.parents.extend(tree.parents)
        t.probs.extend(tree.probs)
        t.sources.extend([source_bits(s) for s in tree.sources])
        out.match_len = rest_match
        out.expected_accepted = expected
        out.pld_match_len = pld_match
        self.stats.record(time.perf_counter() - t0, len(tree), expected, set(tree.sources), kind)

    # ---- RPCs --------------------------------------------------------------------------
    async def _fail(self, context: grpc.aio.ServicerContext, exc: _Abort) -> None:
        self.stats.add(errors=1)
        await context.abort(exc.code, exc.message)

    async def Propose(self, request, context):
        try:
            self._auth(context)
            if self.stopping:
                raise _Abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
            self._check_fingerprint(request.tokenizer_fingerprint, required=False)
            p = self._params(request.params)
            if len(request.context) > self.config.max_context_len:
                raise _Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"context of {len(request.context)} tokens exceeds max_context_len "
                    f"{self.config.max_context_len}",
                )
            self._check_tokens(request.context, "context")
            pld = None
            if PLD in p.sources:
                pld = self._new_pld(p)
                pld.extend(request.context)
            reply = draft_pb2.DraftReply()
            self._draft(request.context, pld, p, p.budget, reply, "propose_calls")
            return reply
        except _Abort as exc:
            await self._fail(context, exc)

    async def Session(self, request_iterator, context):
        try:
            self._auth(context)
            await self._session(context)
        except _Abort as exc:
            await self._fail(context, exc)

    async def _read(self, context, waiter: _Waiter):
        """Next request, or None at the client's end of stream.

        While it waits, the session is visible to the idle sweeper and to shutdown, which
        end it with a status (RESOURCE_EXHAUSTED / UNAVAILABLE) by cancelling the wait;
        a plain await keeps the per-step cost of the hot path at one read.
        """
        waiter.since = time.monotonic()
        self._waiting[id(waiter)] = waiter
        try:
            req = await context.read()
        except asyncio.CancelledError:
            if waiter.reason is None:
                raise  # the call itself was cancelled (client gone)
            raise _Abort(*waiter.reason) from None
        finally:
            self._waiting.pop(id(waiter), None)
        return None if req is grpc.aio.EOF else req

    async def _sweep(self) -> None:
        """End sessions that wait longer than the idle timeout."""
        idle = self.config.idle_timeout_s
        while True:
            await asyncio.sleep(min(1.0, idle / 4))
            now = time.monotonic()
            for w in list(self._waiting.values()):
                if now - w.since > idle and w.reason is None:
                    self.stats.add(sessions_idle_closed=1)
                    w.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"session idle for more than {idle:g} s; closed")

    async def _session(self, context) -> None:
        if self.stopping:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
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
        if len(opening.prompt) > self.config.max_context_len:
            raise _Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prompt of {len(opening.prompt)} tokens exceeds max_context_len "
                f"{self.config.max_context_len}",
            )
        self._check_tokens(opening.prompt, "open.prompt")
        if not self.stats.try_open_session(self.config.max_sessions):
            raise _Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server has max_sessions={self.config.max_sessions} sessions open; try later",
            )
        self._next_id += 1
        session_id = f"{id(self):x}-{self._next_id}"
        try:
            ctx: list[int] = list(opening.prompt)
            pld = None
            if PLD in p.sources:
                pld = self._new_pld(p)
                pld.extend(ctx)
            msg = draft_pb2.SessionReply(session_id=session_id, context_len=len(ctx))
            self._draft(ctx, pld, p, p.budget, msg.draft, None)
            await context.write(msg)
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
                ctx.extend(step.accepted)
                if pld is not None:
                    pld.extend(step.accepted)
                msg = draft_pb2.SessionReply(session_id=session_id, context_len=len(ctx))
                self._draft(ctx, pld, p, step.budget or p.budget, msg.draft, "session_steps")
                await context.write(msg)
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        finally:
            self.stats.close_session()

    async def Info(self, request, context):
        try:
            self._auth(context)
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
            format_version=int(manifest.get("format_version", 0) or 0),
            manifest_json=json.dumps(manifest, default=str, sort_keys=True),
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
            stats_json=s.to_json({"limits": limits, "datastore_tokens": int(
                getattr(self.reader, "n_tokens", 0) or 0)}),
        )

    async def shutdown(self) -> None:
        """Stop taking work, let in-flight steps finish, end idle sessions as UNAVAILABLE."""
        self.stopping = True
        for w in list(self._waiting.values()):
            w.end(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if self._sweeper is not None:
            self._sweeper.cancel()


# ---- server assembly --------------------------------------------------------------------

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
    draft_pb2_grpc.add_DrafterServicer_to_server(service, server)
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

