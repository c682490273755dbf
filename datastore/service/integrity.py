"""The served snapshot's integrity: its checksums checked in the background once serving
(opening stays O(1)), and damage found any other way. A damaged datastore turns health
NOT_SERVING, and drafting from it UNAVAILABLE. Damage found by drafting itself (ids past the
vocabulary in arrays not checked yet or never, a segment truncated or rewritten under its
map) does the same, with or without the check. (Not to be confused with `decoder.verify`,
which checks draft trees against the target model.)

Tested by: tests/datastore/service/test_server.py, tests/datastore/service/test_reload.py"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from grpc_health.v1 import health, health_pb2
from redraft.datastore.service.config import SERVICE_NAME

log = logging.getLogger("redraft.serve")


class IntegrityCheck:
    """One snapshot's integrity: its checksums checked on a thread, damage reported by drafting
    (`fail`); `damage` says why it is not trusted, if it is not. `skip`: segments whose
    checksums passed in an earlier snapshot (segments never change)."""

    def __init__(self, reader, enabled: bool, skip: frozenset[str] = frozenset()) -> None:
        self.reader = reader
        self.enabled = enabled
        self.skip = skip
        self.damage: str | None = None
        self._checking: asyncio.Future | None = None
        self._health: health.aio.HealthServicer | None = None
        self._said: asyncio.Future | None = None  # health turning NOT_SERVING after fail()
        # Called once when damage is found (the service: /readyz turns 503 with health).
        self.on_damage: Callable[[], None] | None = None

    def start(self, health_servicer: health.aio.HealthServicer) -> None:
        self._health = health_servicer
        if self.enabled and self._checking is None:
            self._checking = asyncio.ensure_future(self._check(health_servicer))

    @property
    def status(self) -> str:
        """skipped, running, passed, or failed: <why>."""
        if self.damage is not None:
            return f"failed: {self.damage}"
        if self._checking is None:
            return "skipped"
        return "running" if not self._checking.done() else "passed"

    def fail(self, why: str) -> bool:
        """The snapshot is damaged (found while drafting or following the files): logged
        once, health NOT_SERVING, drafting from it UNAVAILABLE. False if it was known."""
        if self.damage is not None:
            return False
        self.damage = why
        log.error("redraft serve: %s; health is NOT_SERVING", why)
        self._damaged()
        if self._health is not None:
            self._said = asyncio.ensure_future(self._not_serving(self._health))
        return True

    @staticmethod
    async def _not_serving(health_servicer: health.aio.HealthServicer) -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _check(self, health_servicer: health.aio.HealthServicer) -> None:
        try:
            check = functools.partial(self.reader.verify, skip=self.skip) if self.skip \
                else self.reader.verify
            await asyncio.get_running_loop().run_in_executor(None, check)
        except Exception as exc:  # whatever stops the check, the data is not trusted
            if self.damage is None:
                self.damage = str(exc) or repr(exc)
                log.error("redraft serve: %s; health is NOT_SERVING", exc)
                self._damaged()
                await self._not_serving(health_servicer)

    def _damaged(self) -> None:
        if self.on_damage is not None:
            self.on_damage()

    async def wait(self) -> None:
        """Until a checksum check still running is done: its thread reads the Reader's map,
        which the caller may close next."""
        if self._checking is not None:
            await self._checking
        if self._said is not None:
            await self._said
