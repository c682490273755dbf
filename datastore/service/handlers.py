"""The servicer of redraft.v1.Drafter: each RPC from the wire to drafting and back.

Each session drafts through a session drafter of `redraft.datastore.drafting` (the compiled
core unless configured otherwise; the decoder's in-process path runs the same); a batched
call drafts many sequences in one step of it (`batch_rpc`). Around it the service validates
every request before
it touches the datastore (`validation`), keeps sessions in bounds (`session_limits`), shares the
learned outputs between them (`learned_outputs`) and stops drafting from a datastore found damaged
(`integrity`). A bad request ends only its own call with INVALID_ARGUMENT /
FAILED_PRECONDITION / RESOURCE_EXHAUSTED and a message that says what was wrong. A huge
step or prompt (up to max_context_len tokens) never stalls the others: steps are indexed in
pieces with the event loop free in between, long prompts on a thread.

Tested by: tests/datastore/service/test_server.py, tests/datastore/service/test_batch_rpc.py
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import asdict

import grpc
from grpc_health.v1 import health
from redraft.datastore.drafting import LEARNED_CORPUS, DraftSettings, new_session_drafter
from redraft.datastore.service import wire
from redraft.datastore.service.batch_rpc import BatchDrafting
from redraft.datastore.service.config import SERVICE_NAME, ServiceConfig
from redraft.datastore.service.integrity import IntegrityCheck
from redraft.datastore.service.learned_outputs import LearnedOutputs, run_in_thread
from redraft.datastore.service.metrics import walk_accepted
from redraft.datastore.service.refusals import Refusal, bad, check_parsed, lenient
from redraft.datastore.service.reload import SnapshotReloader
from redraft.datastore.service.session_limits import Sessions
from redraft.datastore.service.stats import ServiceStats
from redraft.datastore.service.validation import RequestValidator
from redraft.datastore.service.wire import ServiceInfo
from redraft.proto import draft_pb2, draft_pb2_grpc
from redraft.proto.errors import DatastoreCorrupt, DatastoreError
from redraft.proto.tree import path_probs

# Tokens a step adds, or a prompt indexes, before other calls get the event loop again:
# about 15 ms of indexing on a CPU core (a step of max_context_len tokens takes ~1 s).
PIECE_TOKENS = 2048


class DrafterService(draft_pb2_grpc.DrafterServicer):
    """Implements redraft.v1.Drafter over one open datastore Reader."""

    def __init__(self, reader, config: ServiceConfig, stats: ServiceStats) -> None:
        self.reader = reader
        self.config = config
        self.stats = stats
        self.checks = RequestValidator(reader, config)
        if stats.tenants < len(self.checks.token_keys):
            raise ValueError(f"ServiceStats counts {stats.tenants} tenant slots for "
                             f"{len(self.checks.token_keys)} tokens")
        self.checks.buckets = min(self.checks.buckets, stats.tenants)
        self.session_limits = Sessions(config, stats)
        self.integrity = IntegrityCheck(reader, config.verify_checksums)
        self.integrity.on_damage = self._not_ready
        self.learned_outputs = LearnedOutputs(reader, config, stats,
                                              self.integrity,
                                              self.checks.token_keys)
        self.reloader: SnapshotReloader | None = None
        self.batch_rpc = BatchDrafting(self)
        self.stopping = False
        self._publishing: asyncio.Future | None = None  # /metrics' counts, every 0.1 s

    def swap_reader(self, reader, integrity: IntegrityCheck) -> None:
        """Serve `reader`, a newer snapshot of the same datastore, from the next step on
        (reload.py): each session switches at its next step; none is dropped."""
        self.reader = reader
        self.checks.corpora = set(reader.corpora) - {LEARNED_CORPUS}
        self.integrity = integrity
        integrity.on_damage = self._not_ready
        self.learned_outputs.integrity = integrity
        self.batch_rpc.follow(reader)
        self.publish_snapshot()

    def _not_ready(self) -> None:
        """The snapshot served is damaged: /readyz 503, as gRPC health turns NOT_SERVING (a
        clean snapshot reloaded turns both back: `reload.SnapshotReloader`)."""
        self.publish_snapshot(ready=False)

    def publish_snapshot(self, ready: bool | None = None) -> None:
        """This worker's gauges for /metrics: the snapshot it serves (tokens, segments,
        commit) and, when given, whether it takes sessions (listening, not stopping)."""
        manifest = getattr(self.reader, "manifest", None) or {}
        gauges = {"datastore_tokens": int(getattr(self.reader, "n_tokens", 0) or 0),
                  "datastore_segments": len(manifest.get("segments", ()) or ()),
                  "commit": int(manifest.get("generation", 0) or 0)}
        if ready is not None:
            gauges["ready"] = int(ready)
        self.stats.metrics.set_worker(self.learned_outputs.slot, **gauges)
    def _check_serving(self) -> None:
        if self.stopping:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        self._check_damage()

    def _check_damage(self) -> None:
        damage = self.integrity.damage
        if damage is not None:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, f"datastore is damaged: {damage}")

    def damaged(self, exc: Exception, reader) -> Refusal:
        """Drafting from `reader` met damaged data (ids past the vocabulary in arrays not
        verified, a segment truncated under its map): if it is still the snapshot served,
        it is marked damaged (one logged line, health NOT_SERVING); the call UNAVAILABLE."""
        if reader is self.reader:
            self.integrity.fail(str(exc))
        return Refusal(grpc.StatusCode.UNAVAILABLE, f"datastore is damaged: {exc}")

    # ---- drafting ----------------------------------------------------------------------
    def _draft(self, drafter, budget: int, out: draft_pb2.DraftReply,
               kind: str | None) -> tuple[tuple[list, list, list], set[int]]:
        """Tree from the session's sources under the budget, count, fill `out`; the tree's
        (tokens, parents, source bits) and its nodes' distinct source bits. The nodes go as
        the drafter gives them, sources as bits: no label between the core and the wire."""
        t0 = time.perf_counter()
        self._check_damage()  # an open session's step too
        try:
            drafter.use_reader(self.reader)  # the newest snapshot, between two steps
            tokens, parents, probs, bits = (a.tolist() for a in drafter.propose_arrays(budget))
        except DatastoreCorrupt as exc:
            raise self.damaged(exc, self.reader) from exc
        except DatastoreError as exc:
            raise bad(str(exc)) from exc
        expected = float(sum(path_probs(probs, parents)))
        wire.put_nodes(out, tokens, parents, probs, bits, drafter.rest_match_len,
                       drafter.pld_match_len, drafter.learned_match_len, expected)
        kinds = set(bits)
        used = 0
        for b in kinds:
            used |= b
        self.stats.record(time.perf_counter() - t0, len(tokens), expected, used, kind)
        return (tokens, parents, bits), kinds

    async def _drafter(self, tokens, noun: str, field: str, settings: DraftSettings,
                       tenant: str):
        """A session drafter over `tokens` (the context or an opening prompt, message `field`),
        checked first: length within max_context_len, every id in the vocabulary. A long one
        is indexed on a thread (the drafter is nobody else's yet), not on the event loop."""
        self.checks.check_context(tokens, noun, field)
        make = functools.partial(self.new_drafter, tokens, settings, tenant)
        return make() if len(tokens) <= PIECE_TOKENS else await run_in_thread(make)

    def new_drafter(self, tokens, settings: DraftSettings, tenant: str):
        """A session drafter over checked tokens, from the current snapshot, learning into
        the server's learned index for `tenant`."""
        try:
            return new_session_drafter(tokens, settings, self.reader, self.learned_outputs.index,
                                       tenant, choice=self.config.drafting)
        except DatastoreCorrupt as exc:  # the core's tables met damaged or truncated arrays
            raise self.damaged(exc, self.reader) from exc
        except DatastoreError as exc:
            raise bad(str(exc)) from exc

    @staticmethod
    async def _extend(drafter, accepted) -> None:
        """Add a step's tokens in pieces, letting every other call run in between: a step of
        100,000 tokens costs about a second of indexing, which must not stall the server.
        (Not on a thread: the learned index it writes is shared with every session.)"""
        for i in range(0, len(accepted), PIECE_TOKENS):
            if i:
                await asyncio.sleep(0)
            drafter.extend(accepted[i:i + PIECE_TOKENS])

    # ---- RPCs --------------------------------------------------------------------------
    async def _fail(self, context: grpc.aio.ServicerContext, exc: Refusal) -> None:
        self.stats.add(errors=1)
        self.stats.metrics.refused(exc.code.value[0])
        await context.abort(exc.code, exc.message)

    async def Propose(self, request, context):
        try:
            tenant = self.checks.auth(context)
            check_parsed(request)
            self._check_serving()
            self.checks.check_fingerprint(request.tokenizer_fingerprint, required=False)
            settings = self.checks.settings(request.params)
            tenant = self.checks.tenant(tenant, request.tenant)
            # learns nothing: no tokens are accepted in a one-off call
            drafter = await self._drafter(request.context, "context", "context", settings,
                                          tenant)
            reply = draft_pb2.DraftReply()
            # counted in Stats only
            self._draft(drafter, settings.params.budget, reply, "propose_calls")
            return reply
        except Refusal as exc:
            await self._fail(context, exc)

    async def Session(self, request_iterator, context):
        try:
            tenant = self.checks.auth(context)
            await self._session(context, tenant)
        except Refusal as exc:
            await self._fail(context, exc)

    async def _session(self, context, tenant: str) -> None:
        self._check_serving()
        limits = self.session_limits
        # the token's share of max_sessions; without auth, the declared tenant's, once the
        # open says which
        slot = [self.checks.slot(tenant)]
        # counted from the stream's start, open or not: streams that never send `open`
        # would otherwise cost memory without bound (and are given OPEN_WAIT_S to send it)
        session_id = limits.open(slot[0])
        try:
            await self._opened_session(context, tenant, slot, session_id)
        finally:
            limits.close(slot[0])
            self.learned_outputs.publish()

    async def _opened_session(self, context, tenant: str, slot: list[int],
                              session_id: str) -> None:
        limits = self.session_limits
        waiter = limits.waiter()
        waiter.limit = limits.open_wait_s
        first = await limits.read(context, waiter)
        waiter.limit = None
        if first is None:
            return
        opening = wire.session_open(first)
        self.checks.check_fingerprint(opening.tokenizer_fingerprint, required=True)
        settings = self.checks.settings(opening.params)
        p = settings.params
        tenant = self.checks.tenant(tenant, opening.tenant)
        if slot[0] < 0:  # without auth: its declared tenant's share from now on
            joined = self.checks.slot("", tenant)
            limits.join(joined)
            slot[0] = joined  # where it was counted, given back at the end
        drafter = await self._drafter(opening.prompt, "prompt", "open.prompt", settings,
                                      tenant)
        try:
            # Headers go out on their own first: gRPC marks them sent only when a write
            # completes, so ending a session whose first write was interrupted (by the
            # sweeper or shutdown) would otherwise send them twice and fail.
            await context.send_initial_metadata(())
            msg = draft_pb2.SessionReply(session_id=session_id, context_len=len(drafter))
            last, kinds = self._draft(drafter, p.budget, msg.draft, None)
            metrics = self.stats.metrics if self.stats.metrics.enabled else None
            if metrics is not None:  # each step's accepted tokens walk the tree before
                counter = metrics.key(slot[0], p.corpora)  # its tenant's and corpora's
                metrics.drafted(counter, None, last[2], kinds, ())
            await limits.wait(waiter, context.write(msg), writing=True)
            while not self.stopping:
                req = await limits.read(context, waiter)
                if req is None:
                    return
                t0 = time.perf_counter()
                step = wire.session_step(req, session_id)
                n = self.checks.check_step(step.accepted, step.budget, len(drafter))
                await self._extend(drafter, step.accepted)  # learned at once, for every session
                self.learned_outputs.publish()
                msg = draft_pb2.SessionReply(session_id=session_id, context_len=n)
                tree, kinds = self._draft(drafter, step.budget or p.budget, msg.draft,
                                          "session_steps")
                seconds = time.perf_counter() - t0
                try:
                    await limits.wait(waiter, context.write(msg), writing=True)
                finally:  # counted once the reply is on its way (off its latency), or failed
                    if metrics is not None:
                        tokens, parents, bits = last
                        walked = walk_accepted(tokens, parents, bits, 0, len(tokens),
                                               step.accepted)
                        metrics.drafted(counter, seconds, tree[2], kinds, walked)
                        last = tree
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        finally:
            drafter.close()

    async def Batch(self, request, context):
        try:
            tenant = self.checks.auth(context)
            check_parsed(request)
            self._check_serving()
            return await self.batch_rpc.run(request, tenant)
        except Refusal as exc:
            await self._fail(context, exc)

    async def Info(self, request, context):
        try:
            self.checks.auth(context)
            check_parsed(request)
        except Refusal as exc:
            await self._fail(context, exc)
        return self.info_reply()

    def info_reply(self) -> draft_pb2.InfoReply:
        r = self.reader
        manifest = dict(getattr(r, "manifest", {}) or {})
        c = self.config
        return wire.info_message(ServiceInfo(
            tokenizer_fingerprint=self.checks.fingerprint,
            tokenizer_name=str(getattr(r, "tokenizer_name", "") or ""),
            vocab_size=self.checks.vocab_size,
            n_tokens=int(getattr(r, "n_tokens", 0) or 0),
            n_docs=int(getattr(r, "n_docs", 0) or 0),
            n_shards=len(manifest.get("shards", []) or []),
            format_version=int(manifest.get("version", 0) or 0),
            learn=self.config.learn,
            corpora=dict(getattr(r, "corpora", {}) or {}),
            limits={"max_context_len": c.max_context_len, "max_budget": c.max_budget,
                    "max_sessions": c.max_sessions, "idle_timeout_s": int(c.idle_timeout_s),
                    "max_message_bytes": c.max_message_bytes},
            manifest=manifest,
        ))

    async def Stats(self, request, context):
        try:
            self.checks.auth(context)
            check_parsed(request)
        except Refusal as exc:
            await self._fail(context, exc)
        limits = {k: v for k, v in asdict(self.config).items() if k != "token"}
        return wire.stats_message(self.stats.snapshot({
            "limits": limits, "datastore_tokens": int(getattr(self.reader, "n_tokens", 0) or 0),
            "checksums": self.integrity.status, "learn": self.config.learn,
            **self.learned_outputs.counters()}))

    def start_background(self, health_servicer: health.aio.HealthServicer) -> None:
        """Work that must not delay serving: verifying the datastore's checksums, reloading
        persisted learned outputs, persisting new ones periodically, following the
        datastore's commits."""
        self.integrity.start(health_servicer)
        self.learned_outputs.start()
        self.publish_snapshot(ready=self.integrity.damage is None)
        if self.stats.metrics.enabled:
            self._publishing = asyncio.ensure_future(self.stats.metrics.publish_every())
        self.reloader = SnapshotReloader(self, health_servicer, self.config.reload_interval_s)
        self.reloader.start()

    async def shutdown(self) -> None:
        """Stop taking work, let in-flight steps finish, end idle sessions as UNAVAILABLE.

        A checksum check still running is awaited: its thread reads the Reader's
        map, which the caller may close once the server has stopped.
        """
        self.stopping = True
        self.publish_snapshot(ready=False)
        if self.reloader is not None:
            self.reloader.stop()
        self.session_limits.end_all(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        await self.batch_rpc.idle()
        self.batch_rpc.table.end_all()
        await self.integrity.wait()

    async def finish(self) -> None:
        """After the server stopped: persist what was learned, close the snapshots the
        reloader opened."""
        await self.learned_outputs.finish()
        if self.reloader is not None:
            await self.reloader.close()
        if self._publishing is not None:
            self._publishing.cancel()
        self.stats.metrics.publish()  # the last counts, persists included


def add_drafter_service(service: DrafterService, server: grpc.aio.Server) -> None:
    """Register the Drafter methods as the generated stubs do, but with lenient request
    parsing: undecodable bytes reach the handler, which answers INVALID_ARGUMENT."""
    pb = draft_pb2
    handlers = {
        "Session": grpc.stream_stream_rpc_method_handler(
            service.Session, request_deserializer=lenient(pb.SessionRequest),
            response_serializer=pb.SessionReply.SerializeToString),
        "Propose": grpc.unary_unary_rpc_method_handler(
            service.Propose, request_deserializer=lenient(pb.ProposeRequest),
            response_serializer=pb.DraftReply.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(
            service.Info, request_deserializer=lenient(pb.InfoRequest),
            response_serializer=pb.InfoReply.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            service.Stats, request_deserializer=lenient(pb.StatsRequest),
            response_serializer=pb.StatsReply.SerializeToString),
        "Batch": grpc.unary_unary_rpc_method_handler(
            service.Batch, request_deserializer=lenient(pb.BatchRequest),
            response_serializer=pb.BatchReply.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
