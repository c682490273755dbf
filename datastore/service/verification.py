"""Checking the datastore's checksums in the background once serving (opening stays O(1)): a
damaged datastore turns health NOT_SERVING, and drafting from it UNAVAILABLE."""

from __future__ import annotations

import asyncio
import functools
import logging

from grpc_health.v1 import health, health_pb2
from redraft.datastore.service.config import SERVICE_NAME

log = logging.getLogger("redraft.serve")


class BackgroundVerification:
    """One verification of `reader`, run on a thread; `damage` says why it failed, if it did.
    `skip`: segments already verified in an earlier snapshot (segments never change)."""

    def __init__(self, reader, enabled: bool, skip: frozenset[str] = frozenset()) -> None:
        self.reader = reader
        self.enabled = enabled
        self.skip = skip
        self.damage: str | None = None
        self._verifying: asyncio.Future | None = None

    def start(self, health_servicer: health.aio.HealthServicer) -> None:
        if self.enabled and self._verifying is None:
            self._verifying = asyncio.ensure_future(self._verify(health_servicer))

    @property
    def status(self) -> str:
        """skipped, running, passed, or failed: <why>."""
        if self._verifying is None:
            return "skipped"
        if not self._verifying.done():
            return "running"
        return "passed" if self.damage is None else f"failed: {self.damage}"

    async def _verify(self, health_servicer: health.aio.HealthServicer) -> None:
        try:
            verify = functools.partial(self.reader.verify, skip=self.skip) if self.skip \
                else self.reader.verify
            await asyncio.get_running_loop().run_in_executor(None, verify)
        except Exception as exc:  # whatever stops verification, the data is not trusted
            self.damage = str(exc) or repr(exc)
            log.error("redraft serve: %s; health is NOT_SERVING", exc)
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def wait(self) -> None:
        """Until a verification still running is done: its thread reads the Reader's map,
        which the caller may close next."""
        if self._verifying is not None:
            await self._verifying
