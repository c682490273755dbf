"""Streaming sessions as the server keeps them in bounds: the max_sessions limit (each
token's or tenant's share of it too; a stream counts from its start, before its `open`),
and the idle sweeper that ends a session waiting too long for its client (a new stream
waits for its `open` at most OPEN_WAIT_S).

A session waits either for its client's next request or for its client to read a reply
(HTTP/2 flow control blocks the write of a client that stops reading). Both count: without
a deadline there, a stalled client would hold its session slot forever.

Tested by: tests/datastore/service/test_session_limits.py,
tests/datastore/service/test_server.py, tests/datastore/service/test_client.py,
tests/datastore/service/test_batch_rpc.py
"""

from __future__ import annotations

import asyncio
import time

import grpc
from redraft.datastore.service.config import ServiceConfig
from redraft.datastore.service.refusals import Refusal, check_parsed
from redraft.datastore.service.stats import Full, ServiceStats

OPEN_WAIT_S = 10.0  # a Session stream that sends no `open` this long is ended


def take_slot(stats: ServiceStats, config: ServiceConfig, slot: int) -> None:
    """Take a slot under max_sessions for a session or sequence of tenant slot `slot`
    (`RequestValidator.slot`): RESOURCE_EXHAUSTED when the server is full, or when that
    token (or tenant) already holds its share (so one engine cannot lock the others out)."""
    full = stats.try_open_session(config.max_sessions, slot, config.tenant_share(),
                                  config.fair_room())
    if full is None:
        return
    if full.what == "server":
        raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"server has max_sessions={config.max_sessions} sessions and sequences "
                      "open; try later")
    raise share_refusal(config, full)


def share_refusal(config: ServiceConfig, full: Full) -> Refusal:
    """RESOURCE_EXHAUSTED: the caller's token (with auth) or declared tenant (without)
    holds its share of max_sessions; a fair share says how it was reckoned, since it
    changes as tenants come and go."""
    who = "this token" if config.tokens() else "this tenant"
    of = f"of max_sessions={config.max_sessions}"
    if full.holders:
        s = "s" if full.holders > 1 else ""
        of += (f": {config.fair_room()} shared by {full.holders} tenant{s} now, "
               f"{config.kept_free()} kept for tenants to come")
    return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"{who} holds its share of {full.share} sessions and sequences ({of}); "
                   "close some or try later")


class Waiter:
    """A session as the idle sweeper and shutdown see it: its task, since when it has been
    waiting, and whether for the client's next request or for the client to read a reply."""

    __slots__ = ("task", "since", "writing", "reason", "limit")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task = task
        self.since = time.monotonic()
        self.writing = False
        self.limit: float | None = None  # a wait shorter than the idle timeout (the open)
        self.reason: tuple[grpc.StatusCode, str] | None = None

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """Interrupt the session's wait (for a request, or for its reply to be read); it then
        ends with this status."""
        if self.reason is None and self.task is not None:
            self.reason = (code, message)
            self.task.cancel()


class Sessions:
    """The open sessions of one server: their limit, their waits, the idle sweeper."""

    def __init__(self, config: ServiceConfig, stats: ServiceStats) -> None:
        self.config = config
        self.stats = stats
        self._waiting: dict[int, Waiter] = {}  # sessions now waiting for a request
        self._sweeper: asyncio.Future | None = None
        self._next_id = 0
        # how long a new stream may take to send its `open`: a client sends it at once
        self.open_wait_s = min(OPEN_WAIT_S, config.idle_timeout_s)

    def waiter(self) -> Waiter:
        """The waiter of the session now starting on this task (the sweeper starts with the
        first session)."""
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep())
        return Waiter(asyncio.current_task())

    def open(self, slot: int = 0) -> str:
        """Count a new session against max_sessions and its tenant slot's share; its id."""
        take_slot(self.stats, self.config, slot)
        self._next_id += 1
        return f"{id(self):x}-{self._next_id}"

    def join(self, slot: int) -> None:
        """Count a session opened without a tenant slot (-1) against `slot` now."""
        full = self.stats.join_tenant(slot, self.config.tenant_share(), self.config.fair_room())
        if full is not None:
            raise share_refusal(self.config, full)

    def close(self, slot: int = 0) -> None:
        self.stats.close_session(slot)

    async def wait(self, waiter: Waiter, io, writing: bool = False):
        """Await a read or a write of the session's stream, visible to the sweeper meanwhile.

        While it waits, the session is visible to the idle sweeper and to shutdown, which
        end it with a status (RESOURCE_EXHAUSTED / UNAVAILABLE) by cancelling the wait.
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
            raise Refusal(*waiter.reason) from None
        finally:
            self._waiting.pop(id(waiter), None)

    async def read(self, context, waiter: Waiter):
        """Next request, or None at the client's end of stream."""
        req = await self.wait(waiter, context.read())
        if req is grpc.aio.EOF:
            return None
        check_parsed(req)
        return req

    async def _sweep(self) -> None:
        """End sessions that wait longer than the idle timeout, for a request or for the
        client to read a reply."""
        idle = self.config.idle_timeout_s
        while True:
            await asyncio.sleep(min(1.0, idle / 4, self.open_wait_s / 4))
            now = time.monotonic()
            for w in list(self._waiting.values()):
                if now - w.since <= (w.limit or idle) or w.reason is not None:
                    continue
                if w.limit is not None:
                    self.stats.add(sessions_idle_closed=1)
                    w.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"no open within {w.limit:g} s of the stream's start; closed")
                elif w.writing:
                    self.stats.add(sessions_unread_closed=1)
                    w.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"replies not read for more than {idle:g} s; session closed")
                else:
                    self.stats.add(sessions_idle_closed=1)
                    w.end(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"session idle for more than {idle:g} s; closed")

    def end_all(self, code: grpc.StatusCode, message: str) -> None:
        """End every waiting session with this status and stop the sweeper (shutdown)."""
        for w in list(self._waiting.values()):
            w.end(code, message)
        if self._sweeper is not None:
            self._sweeper.cancel()
