"""Learned outputs on the server: the index every session shares, reloaded from the
datastore at start and appended to it as corpus `learned` while serving and at shutdown."""

from __future__ import annotations

import asyncio
import functools
import logging

from redraft.datastore.build import append_corpus
from redraft.datastore.drafting import LEARNED_CORPUS, LearnedIndex
from redraft.datastore.service.config import ServiceConfig
from redraft.datastore.service.stats import WORKER_FIELDS, ServiceStats
from redraft.datastore.service.verification import BackgroundVerification

log = logging.getLogger("redraft.serve")
LEARNED_NAME_PREFIX = "learned:"  # + tenant: the name of a persisted output


async def run_in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class LearnedOutputs:
    """The server's learned index (`index`: None with learning off) and its persistence."""

    def __init__(self, reader, config: ServiceConfig, stats: ServiceStats,
                 verification: BackgroundVerification) -> None:
        self.reader = reader
        self.config = config
        self.stats = stats
        self.verification = verification  # a damaged datastore is never appended to
        self.fingerprint = str(reader.tokenizer_fingerprint)
        self.index = (None if config.learn == "off" else
                      LearnedIndex(config.learn_max_tokens, shared=config.learn == "global"))
        self.slot = stats.claim_worker()  # where this process publishes its index's sizes
        self._loading: asyncio.Future | None = None  # persisted learned outputs, on a thread
        self._persisting: asyncio.Future | None = None  # the periodic persisting loop

    def start(self) -> None:
        """Reload persisted outputs and persist new ones periodically, without delaying
        serving."""
        if self.index is None:
            return
        if LEARNED_CORPUS in (getattr(self.reader, "corpora", None) or {}):
            self._loading = asyncio.ensure_future(run_in_thread(self._load))
        if self.config.learn_persist_s > 0:
            self._persisting = asyncio.ensure_future(self._persist_every(
                self.config.learn_persist_s))

    def publish(self) -> None:
        """Share this process's index sizes with the other workers (after every change)."""
        if self.index is not None:
            self.stats.publish_worker(self.slot, self.index.stats())

    def counters(self) -> dict:
        """The learned figures of the whole server (none with learning off): every worker's
        index sizes added up, the bound of them all, and each worker's own
        (`learned_per_worker`, whose `learned_max_tokens` is each one's bound)."""
        if self.index is None:
            return {}
        self.publish()
        bound = self.index.max_tokens
        workers = [{**w, "learned_max_tokens": bound} for w in self.stats.per_worker()]
        total = {name: sum(w[name] for w in workers) for name in WORKER_FIELDS[1:]}
        return {**total, "learned_max_tokens": bound * len(workers),
                "learned_per_worker": workers}

    def _load(self) -> None:
        """Reload the newest persisted outputs that fit the bound (on a thread, in batches,
        so sessions keep drafting meanwhile)."""
        newest: list[tuple[str, list[int]]] = []
        total = 0
        for _, name, tokens in self.reader.documents(LEARNED_CORPUS, newest_first=True):
            if total + len(tokens) > self.index.max_tokens:
                break
            tenant = name[len(LEARNED_NAME_PREFIX):] if name.startswith(
                LEARNED_NAME_PREFIX) else name
            newest.append((tenant, tokens))
            total += len(tokens)
        newest.reverse()
        for i in range(0, len(newest), 64):
            self.index.load(newest[i:i + 64])
        self.publish()

    async def _persist_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            await self._persist(include_open=False)

    async def _persist(self, include_open: bool) -> None:
        """Append learned outputs not yet persisted to the datastore as corpus `learned`
        (the datastore's own append path: a new file published atomically; this server keeps
        reading the snapshot it opened)."""
        path = getattr(self.reader, "path", None)
        if self.index is None or path is None or self.verification.damage is not None:
            return
        docs = self.index.take_unpersisted(include_open)
        if not docs:
            return
        documents = [(LEARNED_NAME_PREFIX + tenant, tokens) for tenant, tokens in docs]
        try:
            await run_in_thread(functools.partial(
                append_corpus, None, path, documents=documents, fingerprint=self.fingerprint,
                corpus=LEARNED_CORPUS))
        except Exception as exc:  # the server keeps serving; what failed stays in memory
            log.error("redraft serve: could not persist %d learned outputs: %s",
                      len(documents), exc)
        else:
            self.stats.add(learned_persisted=len(documents))

    async def finish(self) -> None:
        """After the server stopped: persist what was learned. A reload still running is
        awaited (its thread reads the Reader, which the caller may close next)."""
        if self._persisting is not None:
            self._persisting.cancel()
        if self._loading is not None:
            await asyncio.gather(self._loading, return_exceptions=True)
        if self.config.learn_persist_s > 0:
            await self._persist(include_open=True)
