"""What one serving process learns reaches the others: its outputs go to its own log in the
datastore directory, and it replays everyone else's logs into its learned index.

Why: each `--workers` process and each replica keeps its own in-memory index; without
this, a session drafts only from outputs its own process happened to serve. Sessions write
to memory (the journal's `append` is a list append on the serving path); a sync every
`learn_sync_s` seconds writes them to the log in one write and reads the other logs from
where it stopped, so an output reaches every other process within about two syncs. The log
format and its locks: `redraft.datastore.learned_log`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from redraft.datastore.drafting import LearnedIndex
from redraft.datastore.drafting.learned_index import LearnedWriter
from redraft.datastore.learned_log import (
    LogTail,
    OwnedLog,
    Record,
    list_logs,
    new_log_name,
    owner_alive,
)
from redraft.datastore.service.records import record_problem
from redraft.proto.errors import DatastoreError

log = logging.getLogger("redraft.serve")
ROTATE_BYTES = 4 << 20  # a log this long is retired; its open outputs end in it
FULL_CHECK_S = 2.0  # every byte of this process's logs compared with its copy this often


class _Output:
    """A journaled output: its log, its number there, what is not written yet."""

    __slots__ = ("log", "number", "tenant", "pending", "final", "dirty", "written", "dropped")

    def __init__(self, log: _Log, number: int, tenant: str) -> None:
        self.log = log
        self.number = number
        self.tenant = tenant
        self.pending: list[int] = []
        self.final = False
        self.dirty = False
        self.written = 0  # tokens in the log so far (the next record's start)
        self.dropped = False  # given up while no log could be written (`_bound`)


class _Log:
    """One of this process's logs and its outputs not final yet. Its file is created at
    the first write (`file`: None before), so a datastore that cannot take a log yet (a
    read-only directory) gets it as soon as it can."""

    def __init__(self, datastore: str, fingerprint: str, memory_only: bool) -> None:
        self.datastore = datastore
        self.fingerprint = fingerprint
        self.memory_only = memory_only
        self.name = new_log_name()
        self.file: OwnedLog | None = None
        self.next_number = 0
        self.open = 0

    def created(self) -> OwnedLog:
        if self.file is None:
            self.file = OwnedLog(self.datastore, self.fingerprint, self.memory_only,
                                 name=self.name)
        return self.file

    @property
    def size(self) -> int:
        return 0 if self.file is None else self.file.size

    def release(self, keep: bool) -> None:
        if self.file is not None:
            if keep:
                self.file.release()
            else:
                self.file.remove()


class OutputJournal:
    """The learned index's journal in a serving process: its outputs, into its own logs.

    Thread-safe: sessions call `begin`/`append`/`end` on the event loop, `flush` runs on a
    worker thread. A log past `rotate_bytes` is retired: new outputs go to a new log, the old
    one's lock is released once its last open output ended (it then reads as finished, and a
    persister removes it once persisted; with `keep=False`, memory only, this process
    removes it itself, and its header tells every other process never to persist it).
    Every flush checks that this process's logs are still where and what it wrote (every
    byte of them every `FULL_CHECK_S` and at close), and writes one again from memory if
    it was deleted or damaged under it.
    """

    def __init__(self, datastore: str, keep: bool = True,
                 rotate_bytes: int = ROTATE_BYTES, fingerprint: str = "",
                 max_pending_tokens: int = 1 << 20) -> None:
        self.datastore = datastore
        self.keep = keep
        # tokens kept in memory while no log can be written; past it the oldest waiting
        # outputs are given up (counted in `dropped`): they still draft from memory
        self.max_pending_tokens = max_pending_tokens
        self.dropped = [0, 0]  # outputs, tokens given up so far
        self.fingerprint = fingerprint
        self.rotate_bytes = rotate_bytes
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one flush at a time, records in order
        self._dirty: list[_Output] = []
        self._current = self._new_log()
        self._retired: list[_Log] = []
        self.names: set[str] = {self._current.name}  # every log this process wrote
        self._checked = time.monotonic()
        self.unwritable: str | None = None  # why no log could be created at start
        try:
            self._current.created()
        except DatastoreError as exc:  # e.g. a read-only directory: kept until it can
            self.unwritable = str(exc)

    def _new_log(self) -> _Log:
        return _Log(self.datastore, self.fingerprint, not self.keep)

    # ---- the learned index's side ----------------------------------------------------
    def begin(self, tenant: str) -> _Output:
        with self._lock:
            log_ = self._current
            out = _Output(log_, log_.next_number, tenant)
            log_.next_number += 1
            log_.open += 1
            return out

    def append(self, output: _Output, tokens: Sequence[int]) -> None:
        with self._lock:
            if output.dropped:
                return
            output.pending.extend(tokens)
            if not output.dirty:
                output.dirty = True
                self._dirty.append(output)

    def append_all(self, pairs: Iterable[tuple[_Output, Sequence[int]]]) -> None:
        """append() of many outputs under one lock (a batched step's sequences)."""
        with self._lock:
            dirty = self._dirty
            for output, tokens in pairs:
                if output.dropped:
                    continue
                output.pending.extend(tokens)
                if not output.dirty:
                    output.dirty = True
                    dirty.append(output)

    def end(self, output: _Output) -> None:
        with self._lock:
            if output.dropped:
                return
            output.final = True
            if not output.dirty:
                output.dirty = True
                self._dirty.append(output)

    # ---- the sync's side --------------------------------------------------------------
    def unwritten(self) -> tuple[int, int]:
        """(outputs, tokens) waiting to be written: what a process that cannot write its
        log now would lose if it stopped."""
        with self._lock:
            return len(self._dirty), sum(len(o.pending) for o in self._dirty)

    def flush(self, full_check: bool = False) -> None:
        """Write what sessions added since the last flush, one write per log, then check
        the logs (`check_logs`). A write that fails (a full disk, a directory that takes no
        log) raises once every log was tried; what it carried goes back to the outputs,
        ahead of what they gained since, for the next flush."""
        with self._write_lock:
            with self._lock:
                dirty, self._dirty = self._dirty, []
                batches: dict[int, tuple[_Log, list[_Output], list[Record]]] = {}
                for out in dirty:
                    out.dirty = False
                    rec = Record(out.number, out.tenant, out.pending, out.final,
                                 out.written)
                    out.pending = []
                    batch = batches.setdefault(id(out.log), (out.log, [], []))
                    batch[1].append(out)
                    batch[2].append(rec)
            failed: Exception | None = None
            written = []
            for log_, outs, records in batches.values():
                try:
                    log_.created().append(records)
                except (OSError, DatastoreError) as exc:
                    failed = failed or exc
                    self._restore(outs, records)
                    self._bound()
                else:
                    written.append((log_, outs, records))
            with self._lock:
                for log_, outs, records in written:
                    log_.open -= sum(r.final for r in records)
                    for out, rec in zip(outs, records):
                        out.written += len(rec.tokens)
                self.names.update(g.name for g in (self._current, *self._retired)
                                  if g.file is not None)
                self._rotate()
            try:
                self.check_logs(full_check)
            except OSError as exc:
                failed = failed or exc
            if failed is not None:
                raise failed

    def check_logs(self, full: bool = False) -> None:
        """Write again from memory any of this process's logs deleted, replaced, cut or
        changed under it (every byte compared when `full` or every FULL_CHECK_S), saying so
        in one line each."""
        now = time.monotonic()
        full = full or now - self._checked >= FULL_CHECK_S
        if full:
            self._checked = now
        with self._lock:
            files = [g.file for g in (self._current, *self._retired) if g.file is not None]
        for f in files:
            said = f.check(full)
            if said is not None:
                log.warning("redraft serve: learned-output log %s", said)

    def _restore(self, outs: list[_Output], records: list[Record]) -> None:
        with self._lock:
            for out, rec in zip(outs, records):
                out.pending[:0] = rec.tokens
                if not out.dirty:
                    out.dirty = True
                    self._dirty.append(out)

    def _bound(self) -> None:
        """While nothing can be written, keep at most max_pending_tokens waiting: the
        outputs waiting longest are given up whole (a part given up would leave a gap in
        what the log says of them), counted in `dropped`."""
        with self._lock:
            total = sum(len(o.pending) for o in self._dirty)
            while total > self.max_pending_tokens and self._dirty:
                out = self._dirty.pop(0)
                total -= len(out.pending)
                self.dropped[0] += 1
                self.dropped[1] += len(out.pending)
                out.dropped, out.dirty, out.pending = True, False, []
                if not out.final:
                    out.log.open -= 1  # never ends in its log: the log may be released

    def _rotate(self) -> None:
        if self._current.size >= self.rotate_bytes:
            self._retired.append(self._current)
            self._current = self._new_log()
        for log_ in [g for g in self._retired if g.open <= 0]:
            self._retired.remove(log_)
            log_.release(self.keep)

    def locked_names(self) -> set[str]:
        """This process's logs it still writes (alive, whatever their lock reads as)."""
        with self._lock:
            return {g.name for g in (self._current, *self._retired) if g.file is not None}

    def close(self) -> None:
        """At shutdown, once every session ended: write everything, check every byte of the
        logs, give them up (an output still open then reads as ended by a dead owner), or
        remove them with `keep=False`."""
        try:
            self.flush(full_check=True)  # a failure (a full disk) is raised once the
            # logs are given up
        finally:
            with self._write_lock, self._lock:
                for g in (self._current, *self._retired):
                    g.release(self.keep)
                self._retired = []


class LogFollower:
    """Replays the other processes' logs into this process's learned index.

    `skip(name, number)`: whether output `number` of log `name` was persisted by the time
    this process loaded the persisted outputs (so it is in the index already). `admit(key)`:
    whether outputs of tenant key `key` may enter this process's index at all. An output
    with a record `records.record_problem` refuses (ids past `vocab_size`, a tenant key no
    session could have) is dropped from there on, with one line per log. A log whose header
    names another tokenizer than `fingerprint` is not replayed at all (one line per log); a
    memory-only log whose owner is gone is not replayed by a process that finds it so, and
    is removed (a memory-only run leaves nothing behind).
    """

    def __init__(self, datastore: str, index: LearnedIndex, own: set[str],
                 skip: Callable[[str, int], bool] = lambda name, number: False, *,
                 vocab_size: int = 1 << 32,
                 admit: Callable[[str], bool] = lambda key: True,
                 fingerprint: str = "") -> None:
        self.datastore = datastore
        self.fingerprint = fingerprint
        self._foreign: set[str] = set()  # logs of another tokenizer, said once
        self._left: dict[str, int] = {}  # where reading stopped in logs gone for now
        self.index = index
        self.own = own
        self.skip = skip
        self.vocab_size = vocab_size
        self.admit = admit
        self._tails: dict[str, LogTail] = {}
        self._writers: dict[tuple[str, int], LearnedWriter] = {}
        self._dropped: set[tuple[str, int]] = set()  # outputs not replayed (any more)
        self._reported: set[str] = set()  # damaged logs already logged once
        self._quarantined: set[str] = set()  # logs whose refused outputs were logged once
        self.replayed = 0  # records applied so far

    def counters(self) -> dict:
        return {"learned_logs_followed": len(self._tails),
                "learned_records_replayed": self.replayed}

    def open_all(self) -> None:
        """Open every log there now: it stays readable if a persister removes it next."""
        for path in list_logs(self.datastore):
            if path.name not in self.own and path.name not in self._tails:
                tail = self._tails[path.name] = LogTail(path)
                tail.open()

    def poll(self) -> int:
        """Apply what the other logs gained since the last poll; the records applied."""
        listed = {p.name: p for p in list_logs(self.datastore)}
        n = 0
        for name in [k for k in self._tails if k not in listed]:  # removed: read the rest
            n += self._apply(name, self._tails[name].read())
            self._forget(name)
        for name, path in listed.items():
            if name in self.own:
                continue
            tail = self._tails.get(name)
            if tail is None:
                tail = self._tails[name] = LogTail(path, self._left.pop(name, 0))
            fresh = tail.header is None
            records = tail.read()
            header = tail.header
            if header is not None and header.fingerprint and \
                    header.fingerprint != self.fingerprint:
                if name not in self._foreign:
                    self._foreign.add(name)
                    log.error("redraft serve: learned-output log %s was written for another "
                              "tokenizer (%s; this datastore's is %s): not replayed", path,
                              header.fingerprint, self.fingerprint)
                continue
            if header is not None and header.memory_only and not owner_alive(path):
                # its owner is gone: what it learned went with it (a process following it
                # while it lived keeps what it read, and reads the rest)
                n += self._apply(name, [] if fresh else records)
                self._forget(name)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            n += self._apply(name, records)
            if not tail.damaged:
                self._reported.discard(name)
            elif name not in self._reported:
                self._reported.add(name)
                log.error("redraft serve: learned-output log %s is damaged after byte %d; "
                          "the rest of it is not replayed until it is written again", path,
                          tail.offset)
        self.replayed += n
        return n

    def _apply(self, name: str, records: list[Record]) -> int:
        for r in records:
            key = (name, r.output)
            writer = self._writers.get(key)
            if key in self._dropped or (writer is None and self.skip(name, r.output)):
                continue  # refused before, or persisted (or quarantined) by the load
            problem = record_problem(r.tenant, r.tokens, self.vocab_size)
            if problem is not None:
                self._drop(key, problem)
                continue
            if writer is None:
                if not self.admit(r.tenant):
                    continue
                writer = self._writers[key] = self.index.writer(r.tenant, (), journal=False)
            writer.extend(r.tokens)
            if r.final:
                writer.close()
                del self._writers[key]
        return len(records)

    def _drop(self, key: tuple[str, int], problem: str) -> None:
        """Replay no more of an output (what it added before had sane ids and stays)."""
        self._dropped.add(key)
        writer = self._writers.pop(key, None)
        if writer is not None:
            writer.close()
        if key[0] not in self._quarantined:
            self._quarantined.add(key[0])
            log.error("redraft serve: learned-output log %s: output %d is not drafted (%s); "
                      "such outputs of it are skipped", self._tails[key[0]].path, key[1],
                      problem)

    def _forget(self, name: str) -> None:
        tail = self._tails.pop(name)
        tail.close()
        if tail.header is not None:  # were it written again under its name: go on there
            self._left[name] = tail.offset
            while len(self._left) > 4096:
                del self._left[next(iter(self._left))]
        self._reported.discard(name)
        self._quarantined.discard(name)
        self._dropped = {k for k in self._dropped if k[0] != name}
        for key in [k for k in self._writers if k[0] == name]:
            self._writers.pop(key).close()

    def close(self) -> None:
        for name in list(self._tails):
            self._forget(name)
