"""A running server follows its datastore's commits: a new manifest (an append, a delete, a
learned persist, a merge, a rebuild with the same tokenizer) is drafted from within
`PICKUP_BOUND_S` (2 s) of its publication, without a restart and without dropping sessions.

Why polling: the commit point is one small file replaced by rename; a stat and a read of it
every `reload_interval_s` (0.5 s) cost microseconds, work on every file system (inotify does
not see other machines' writes over NFS) and need no other process.

On a new commit the snapshot is opened on a thread (opening is O(segments), never O(data))
and swapped into the service on the event loop, between two drafting steps: each session
drafts from the service's current snapshot at its next step. Segments the old snapshot had
already verified are not verified again (they are immutable); the new ones are checked in
the background, as at start-up. The old snapshot is closed once the work that reads it on
threads is done (a running checksum check, the reload of learned outputs): drafting itself
runs on the event loop, or on a thread for a large batched call, which is awaited too, so no
drafting call can still be inside it. That releases its maps,
so deleted documents leave the disk too; the snapshot the server was started with is closed
the same way once replaced (its owner's own close() then does nothing). A commit that cannot
be opened (damaged, or built with another tokenizer) keeps the old snapshot and is logged
once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from grpc_health.v1 import health, health_pb2
from redraft.datastore.drafting import prepare_reader
from redraft.datastore.manifest import commit_stamp
from redraft.datastore.reader import Reader
from redraft.datastore.service.config import SERVICE_NAME
from redraft.datastore.service.integrity import IntegrityCheck
from redraft.proto.errors import RedraftError

log = logging.getLogger("redraft.serve")


class SnapshotReloader:
    """Polls the datastore of `service` and swaps newer snapshots in (module doc)."""

    def __init__(self, service, health_servicer: health.aio.HealthServicer,
                 interval_s: float) -> None:
        self.service = service
        self.health = health_servicer
        self.interval_s = interval_s
        reader = service.reader
        self.path = getattr(reader, "path", None)
        self.stamp = getattr(reader, "stamp", None)
        self.refused: tuple | None = None  # the stamp of a commit that failed to open
        self.verified: set[str] = set()  # segments of earlier snapshots that passed
        self.reloads = 0
        self._opened: list[Reader] = []  # snapshots this reloader opened (it closes them)
        self._task: asyncio.Future | None = None
        self._retiring: set[asyncio.Future] = set()
        self._watch(service.integrity, reader)

    def start(self) -> None:
        if self.path is not None and self.interval_s > 0 and self._task is None:
            self._task = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                stamp, changed = await loop.run_in_executor(None, self._look,
                                                            self.service.reader)
                if changed is not None:
                    self._changed(changed)  # reopened until a commit opens whole
                elif stamp in (self.stamp, self.refused):
                    continue
                reader = await loop.run_in_executor(None, self._open)
            except (RedraftError, OSError) as exc:
                self._refuse(stamp, str(exc))
                continue
            if (reader.tokenizer_fingerprint, reader.vocab_size) != (
                    self.service.reader.tokenizer_fingerprint, self.service.reader.vocab_size):
                reader.close()
                self._refuse(stamp, "it was built with another tokenizer; restart the server "
                             "to serve it")
                continue
            self._swap(reader)

    def _look(self, reader) -> tuple[tuple, str | None]:
        """The commit's stamp, and why the served snapshot's files are no longer what it
        mapped (None: they are): a stat of manifest.json and one of each segment."""
        changed = getattr(reader, "files_changed", None)
        return commit_stamp(self.path), changed() if changed is not None else None

    def _changed(self, why: str) -> None:
        """A segment served was truncated or rewritten in place (`cp -r` over the served
        directory): the snapshot is damaged (one line, UNAVAILABLE), and what was verified
        is verified again (segments are immutable only while nobody rewrites them)."""
        self.service.integrity.fail(f"{why}; reopening the datastore until it opens")
        self.verified.clear()

    def _open(self) -> Reader:
        """The new snapshot, with the drafting core's tables over its new segments built
        here on the thread, not by the first step that drafts from it."""
        reader = Reader(self.path)
        try:
            prepare_reader(reader, self.service.config.drafting)
        except BaseException:
            reader.close()
            raise
        return reader

    def _refuse(self, stamp: tuple, why: str) -> None:
        if stamp != self.refused:
            self.service.stats.metrics.add("reload_failures")
            log.error("redraft serve: keeping the datastore snapshot it serves; the new one "
                      "cannot be used: %s", why)
        self.refused = stamp

    def _swap(self, reader: Reader) -> None:
        service = self.service
        old, old_integrity = service.reader, service.integrity
        integrity = IntegrityCheck(reader, service.config.verify_checksums,
                                   skip=frozenset(self.verified))
        service.swap_reader(reader, integrity)
        self._opened.append(reader)
        self.stamp = getattr(reader, "stamp", None)
        self.reloads += 1
        service.stats.metrics.add("reloads")
        integrity.start(self.health)
        self._watch(integrity, reader, recovering=old_integrity.damage is not None)
        loading = getattr(service.learned_outputs, "_loading", None)  # reads the first snapshot
        self._later(self._retire(old, [old_integrity.wait(), service.batch_rpc.idle(), *(
            [asyncio.shield(loading)] if loading is not None and not loading.done() else [])]))

    def _watch(self, integrity: IntegrityCheck, reader,
               recovering: bool = False) -> None:
        """Remember the segments whose checksums passed; a clean snapshot after a damaged one
        turns health back to SERVING (and /readyz back to 200)."""
        async def watch() -> None:
            await integrity.wait()
            if integrity.damage is None and integrity.status in ("passed", "skipped"):
                if integrity.status == "passed":
                    self.verified.update(getattr(reader, "segments", ()))
                if recovering and self.service.integrity is integrity and \
                        not self.service.stopping:
                    for name in ("", SERVICE_NAME):
                        await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
                    self.service.publish_snapshot(ready=True)
        self._later(watch())

    def _later(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, old, readers_of_old: list) -> None:
        await asyncio.gather(*readers_of_old, return_exceptions=True)
        with contextlib.suppress(Exception):
            old.close()
        if old in self._opened:
            self._opened.remove(old)

    def stop(self) -> None:
        """No more reloads (shutdown)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def close(self) -> None:
        """After the server stopped: retire what is pending, close the snapshots opened
        here (the caller owns the one it passed in)."""
        self.stop()
        await asyncio.gather(*list(self._retiring), return_exceptions=True)
        for reader in self._opened:
            reader.close()
        self._opened.clear()
