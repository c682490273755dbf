"""Learned outputs on the server: the index every session shares, shared in turn with every
other process serving the same datastore (`sharing`), persisted to the datastore exactly
once by whichever process gets to it (`persisting`), and reloaded at start."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time

from redraft.datastore.drafting import new_learned_index
from redraft.datastore.service.config import ServiceConfig
from redraft.datastore.service.integrity import IntegrityCheck
from redraft.datastore.service.persisting import (
    MarksDamaged,
    PersistBusy,
    load_persisted,
    persist_outputs,
)
from redraft.datastore.service.sharing import LogFollower, OutputJournal
from redraft.datastore.service.stats import ServiceStats
from redraft.datastore.service.tenants import shareable
from redraft.proto.errors import RedraftError

log = logging.getLogger("redraft.serve")


def _said(exc: BaseException) -> str:
    """An error in one line: the project's own and OS errors say what happened; anything
    else also says what it is (it is a bug, but a line, not a traceback, and no stop)."""
    if isinstance(exc, (RedraftError, OSError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


async def run_in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class LearnedOutputs:
    """The server's learned index (`index`: None with learning off), its sharing with the
    other processes of the datastore, and its persistence."""

    def __init__(self, reader, config: ServiceConfig, stats: ServiceStats,
                 integrity: IntegrityCheck, token_keys: list[str] = ()) -> None:
        self.reader = reader
        self.config = config
        self.stats = stats
        self.integrity = integrity  # a damaged datastore is never appended to
        self.token_keys = list(token_keys)  # to map outputs persisted before tenant keys
        self.fingerprint = str(reader.tokenizer_fingerprint)
        path = getattr(reader, "path", None)  # the datastore directory, or its file
        self.path = (None if path is None else
                     path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))
        self.index = (None if config.learn == "off" else
                      new_learned_index(config.learn_max_tokens, shared=config.learn == "global",
                                        choice=config.drafting))
        self.slot = stats.claim_worker()  # where this process publishes its index's sizes
        self.journal: OutputJournal | None = None
        self.follower: LogFollower | None = None
        if self.index is not None and self.path is not None:
            self.journal = OutputJournal(str(self.path), keep=config.learn_persist_s > 0,
                                         fingerprint=self.fingerprint,
                                         max_pending_tokens=config.learn_max_tokens)
            if self.journal.unwritable is not None:  # e.g. a read-only datastore
                log.warning("redraft serve: learned outputs stay in this process until the "
                            "datastore takes a log: %s", self.journal.unwritable)
            self.index.journal = self.journal
            self.follower = LogFollower(str(self.path), self.index, self.journal.names,
                                        vocab_size=int(reader.vocab_size),
                                        admit=self.admits, fingerprint=self.fingerprint)
        self._loaded = False
        self._marks_damage_said = False  # damaged learned marks are logged once
        self._tasks: list[asyncio.Future] = []
        self._in_flight: asyncio.Future | None = None  # a persist running on a thread
        self._loading: asyncio.Future | None = None
        self._syncing: asyncio.Future | None = None  # a sync running on a thread
        # a failing sync is said once until it works (a log that could not be created at
        # start was said then)
        self._sync_failing = None if self.journal is None else self.journal.unwritable
        self._dropped_said = 0  # outputs given up while no log could be written, said

    def admits(self, key: str) -> bool:
        """Whether an output of `key` (persisted, or logged by another process) may enter
        the index: always per tenant, and with `--learn global` (one pool) only when no
        session could draft it without presenting its token (`tenants.shareable`)."""
        return self.config.learn != "global" or shareable(key, self.token_keys)

    def start(self) -> None:
        """Reload persisted outputs, share with the other processes, persist periodically;
        none of it delays serving."""
        if self.journal is None:
            return
        self._loading = asyncio.ensure_future(run_in_thread(self._load))
        self._tasks.append(asyncio.ensure_future(self._sync_every(self.config.learn_sync_s)))
        if self.config.learn_persist_s > 0:
            self._tasks.append(asyncio.ensure_future(
                self._persist_every(self.config.learn_persist_s)))

    def publish(self) -> None:
        """Share this process's index sizes with the other workers (after every change)."""
        if self.index is not None:
            self.stats.publish_worker(self.slot, self.index.stats())

    def counters(self) -> dict:
        """The index's sizes and bound, what this process replayed from the other
        processes' logs, and every worker's own index sizes, labelled with its pid
        (`learned_per_worker`): none with learning off. The top-level sizes are this
        process's (`pid`); every process's index holds every output once synced."""
        if self.index is None:
            return {}
        self.publish()
        shared = self.follower.counters() if self.follower is not None else {}
        return {**self.index.stats(), **shared, "learned_per_worker": self.stats.per_worker()}

    # ---- start ---------------------------------------------------------------------------
    def _load(self) -> None:
        """The newest persisted outputs that fit the bound, then (from the next sync on)
        every logged output they are not. Runs on a thread; sessions keep drafting."""
        try:
            snapshot = load_persisted(str(self.path), self.index.max_tokens, self.token_keys,
                                      self.config.learn_persist_wait_s,
                                      opened=self.follower.open_all)
        except Exception as exc:  # whatever it is, serving goes on
            log.error("redraft serve: could not reload learned outputs: %s", _said(exc))
        else:
            if snapshot.damaged is not None:
                self._say_marks_damaged(snapshot.damaged)
            self.follower.skip = snapshot.skip
            documents = [d for d in snapshot.documents if self.admits(d[0])]
            for i in range(0, len(documents), 64):
                self.index.load(documents[i:i + 64])
            self.publish()
        self._loaded = True

    # ---- sharing -------------------------------------------------------------------------
    async def _sync_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            self._syncing = asyncio.ensure_future(run_in_thread(self._sync))
            try:
                await asyncio.shield(self._syncing)
            except Exception as exc:  # e.g. a full disk: the next sync
                # writes what this one could not (the journal keeps it)
                self.stats.metrics.add("share_failures")
                if _said(exc) != self._sync_failing:
                    outputs, tokens = self.journal.unwritten()
                    log.error("redraft serve: could not share learned outputs: %s; %d "
                              "output(s) (%d tokens) wait in memory for the next sync",
                              _said(exc), outputs, tokens)
                self._sync_failing = _said(exc)
                dropped, tokens = self.journal.dropped
                if dropped > self._dropped_said and self.config.learn_persist_s > 0:
                    self._dropped_said = dropped
                    log.error("redraft serve: %d learned output(s) (%d tokens) so far will "
                              "never be persisted: no log could be written while more than "
                              "--learn-max-tokens waited (they still draft from memory)",
                              dropped, tokens)
            else:
                if self._sync_failing is not None:
                    log.warning("redraft serve: learned outputs are written to the datastore "
                                "again")
                self._sync_failing = None

    def _sync(self) -> None:
        self.journal.flush()
        if self._loaded:
            self.follower.poll()
            self.publish()  # what the other processes' outputs added

    # ---- persisting ----------------------------------------------------------------------
    async def _persist_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await self._persist(self.journal.locked_names())

    async def _persist(self, alive: set[str]) -> None:
        """Persist what any process logged and nobody persisted yet. A failure is logged;
        the outputs stay in their logs for the next persist, by this or any process."""
        if self.integrity.damage is not None:
            return
        self._in_flight = asyncio.ensure_future(run_in_thread(functools.partial(
            persist_outputs, str(self.path), alive, self.fingerprint,
            self.config.learn_persist_wait_s)))
        try:
            done = await asyncio.shield(self._in_flight)
        except MarksDamaged as exc:  # the same every persist until repaired: said once
            self.stats.metrics.add("persist_failures")
            self._say_marks_damaged(str(exc))
        except PersistBusy as exc:
            log.warning("redraft serve: learned outputs not persisted yet (%s); "
                        "the next persist retries", exc)
        except Exception as exc:  # one persist's failure, whatever it is,
            # must not end the persisting: the outputs wait in their logs for the next one
            self.stats.metrics.add("persist_failures")
            log.error("redraft serve: could not persist learned outputs: %s; "
                      "the next persist retries", _said(exc))
        else:
            if done.outputs:
                self.stats.add(learned_persisted=done.outputs)
            self.stats.metrics.set_worker(self.slot, last_persist_unix=time.time())
            for name, (n, first) in done.rejected.items():
                self.stats.metrics.add("quarantined_records", n)
                log.error("redraft serve: learned-output log %s: %d output(s) quarantined, "
                          "neither persisted nor drafted (%s)", name, n, first)
            for line in done.set_aside:
                log.error("redraft serve: %s", line)

    def _say_marks_damaged(self, message: str) -> None:
        if not self._marks_damage_said:
            self._marks_damage_said = True
            log.error("redraft serve: learned marks damaged, nothing persists: %s", message)

    async def finish(self) -> None:
        """After the server stopped (every session ended): write the last outputs, give up
        this process's logs, and persist everything not persisted yet."""
        if self.journal is None:
            return
        for task in self._tasks:
            task.cancel()
        pending = [f for f in (self._loading, self._syncing, self._in_flight) if f is not None]
        await asyncio.gather(*pending, return_exceptions=True)
        try:
            await run_in_thread(self.journal.close)
        except Exception as exc:  # what is in the logs is persisted below
            outputs, tokens = self.journal.unwritten()
            if self.config.learn_persist_s > 0:  # memory only: nothing was to be kept
                log.error("redraft serve: could not write the last learned outputs: %s; %d "
                          "output(s) (%d tokens) learned here are lost", _said(exc),
                          outputs, tokens)
        self.follower.close()
        if self.config.learn_persist_s > 0:
            await self._persist(set())
