"""Learned outputs persisted exactly once, whichever serving process persists them and
however it dies.

Any process may persist (every `learn_persist_s` and at shutdown): under the persist lock
(one persister at a time, bounded wait) it reads the marks of the last commit (which outputs
of which log are persisted), reads every log, and persists the outputs that are final, or
whose owner died, and are not marked yet: as one learned segment whose marks are committed
in the same atomic publish. Nothing counts as persisted before that commit: a persister
killed anywhere before it leaves the logs and the marks as they were, and the next persister
(any process, or a restart) does the work again. After the commit, logs whose owner is gone
and whose outputs are all persisted are removed (never before: the marks alone could not
tell a removed log's outputs from new ones).

Startup (`load_persisted`) takes the same lock for a consistent view: the persisted outputs,
the marks that say which logged outputs they are, and every log opened, so that the logs'
other outputs are replayed exactly once in memory too.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from redraft.datastore.build import learned_marks, persist_learned
from redraft.datastore.drafting import LEARNED_CORPUS
from redraft.datastore.learned_log import (
    list_logs,
    owner_alive,
    persist_lock,
    remove_stale_new_logs,
    scan_log,
    set_aside,
)
from redraft.datastore.reader import Reader
from redraft.datastore.service.records import record_problem
from redraft.datastore.service.tenants import persisted_key
from redraft.proto.errors import DatastoreError

MARKS_KEY = "logs"  # marks: {"logs": {log name: [[start, end), ...] persisted}}


class PersistBusy(DatastoreError):
    """Another process kept the persist or write lock past the wait; retried later."""


class Ranges:
    """Output numbers of one log, as sorted disjoint [start, end) ranges: a log's outputs
    end roughly in the order they began, so this stays a few ranges long."""

    def __init__(self, ranges: Iterable[Iterable[int]] = ()) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        for start, end in ranges:
            self.starts.append(int(start))
            self.ends.append(int(end))

    def __contains__(self, n: int) -> bool:
        i = bisect.bisect_right(self.starts, n) - 1
        return i >= 0 and n < self.ends[i]

    def add(self, n: int) -> None:
        if n in self:
            return
        i = bisect.bisect_right(self.starts, n)
        self.starts.insert(i, n)
        self.ends.insert(i, n + 1)
        if i + 1 < len(self.starts) and self.starts[i + 1] == n + 1:  # joins the next
            self.ends[i] = self.ends.pop(i + 1)
            del self.starts[i + 1]
        if i > 0 and self.ends[i - 1] == n:  # joins the previous
            self.ends[i - 1] = self.ends.pop(i)
            del self.starts[i]

    def to_json(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self.starts, self.ends)]


@dataclass
class Persisted:
    outputs: int = 0  # outputs persisted by this call
    tokens: int = 0
    removed_logs: int = 0
    # outputs quarantined by this call, per log: (how many, why the first one was):
    # marked as done without persisting them, so no persist reads them again
    rejected: dict[str, tuple[int, str]] = field(default_factory=dict)
    # logs of gone owners set aside, each with one line saying what it cost: damaged ones
    # (outputs lost whole or cut short, counted) and ones of another tokenizer
    set_aside: list[str] = field(default_factory=list)


class MarksDamaged(DatastoreError):
    """The commit's learned marks are not of the shape persisting writes: no persist can
    tell which logged outputs are persisted, so none persists (they wait in their logs)."""


def log_marks(marks: dict) -> dict[str, Ranges]:
    """The marks' ranges per log; MarksDamaged unless they are what `persist_outputs`
    writes: {"logs": {log name: [[start, end), ...] ascending and disjoint}}."""
    logs = marks.get(MARKS_KEY) if isinstance(marks, dict) else None
    if logs is None:
        return {}
    if not isinstance(logs, dict):
        raise MarksDamaged(f"the learned marks' {MARKS_KEY!r} are a {type(logs).__name__}, "
                           f"not a dict of logs")
    out = {}
    for name, ranges in logs.items():
        if not _ranges_ok(ranges):
            raise MarksDamaged(f"the learned marks of log {name[:80]!r} are not ascending "
                               f"disjoint [start, end) ranges: {str(ranges)[:80]}")
        out[name] = Ranges(ranges)
    return out


def _ranges_ok(ranges) -> bool:
    if not isinstance(ranges, list):
        return False
    last = 0
    for r in ranges:
        if not (isinstance(r, list) and len(r) == 2
                and all(type(x) is int for x in r) and last <= r[0] < r[1]):
            return False
        last = r[1]
    return True


def persist_outputs(datastore: str, alive: set[str], fingerprint: str,
                    wait_s: float) -> Persisted:
    """Persist every final or orphaned output not persisted yet, exactly once. `alive`:
    this process's own logs it still writes (their lock is its own). Raises PersistBusy
    when another process kept a lock longer than `wait_s`."""
    deadline = time.monotonic() + wait_s
    with persist_lock(datastore, wait_s) as held:
        if not held:
            raise PersistBusy(f"{datastore}: another process kept persisting learned outputs "
                              f"for more than {wait_s:g} s")
        remove_stale_new_logs(datastore)
        committed = learned_marks(datastore)
        try:
            done = log_marks(committed)
        except MarksDamaged as exc:
            raise MarksDamaged(f"{datastore}: {exc}; learned outputs stay in their logs "
                               f"until the marks are repaired") from None
        with Reader(datastore) as now:  # the ids and the tokenizer the commit will accept
            vocab_size = now.vocab_size
            tokenizer = str(now.tokenizer_fingerprint)
        result = Persisted()
        documents: list[tuple[str, list[int]]] = []
        marks: dict[str, list[list[int]]] = {}
        finished = []  # logs of gone owners, removable once all is persisted
        aside: list[tuple[object, str, str]] = []  # (log, suffix, what it cost)
        for path in list_logs(datastore):
            # the owner's liveness first: a dead owner wrote all it ever will, so what is
            # read next is the whole log
            live = path.name in alive or owner_alive(path)
            scan = scan_log(path)
            if scan is None:
                continue  # removed since it was listed
            header = scan.header
            if header is None:  # its header is damaged or cut (or still being written)
                if not live:
                    aside.append((path, "damaged", f"its header is damaged or cut: every "
                                  f"output in it is lost ({scan.size} bytes)"))
                continue
            if header.memory_only:  # never persisted; gone with its owner
                if not live:
                    finished.append(path)
                continue
            if header.fingerprint and header.fingerprint != tokenizer:
                if not live:
                    aside.append((path, "other-tokenizer", f"it was written for tokenizer "
                                  f"{header.fingerprint}, not this datastore's {tokenizer}: "
                                  f"{len(scan.outputs)} output(s) not persisted"))
                continue
            outputs = scan.outputs
            ranges = done.get(path.name) or Ranges()
            cost = [] if live else [n for n in sorted(scan.lost() | scan.cut)
                                    if n not in ranges]
            for number in sorted(outputs):
                out = outputs[number]
                if number in ranges:
                    continue
                if live and not (out.final and number not in scan.cut):
                    continue  # its owner still writes it (or writes its log again)
                problem = record_problem(out.tenant, out.tokens, vocab_size)
                if problem is not None:
                    n, first = result.rejected.get(path.name, (0, f"output {number}: "
                                                                 f"{problem}"))
                    result.rejected[path.name] = (n + 1, first)
                elif out.tokens:
                    documents.append((out.tenant, out.tokens))
                ranges.add(number)
            if ranges.starts:
                marks[path.name] = ranges.to_json()
            if live:
                continue
            if scan.damaged or scan.tail_bytes:
                lost = [n for n in cost if n not in scan.outputs]
                cut = [n for n in cost if n in scan.outputs]
                where = (f"{scan.damaged_bytes} bytes unreadable from byte {scan.damage_at}"
                         if scan.damaged_bytes else "")
                if scan.tail_bytes:
                    where += (", and " if where else "") + \
                        f"it ends inside a record ({scan.tail_bytes} bytes)"
                after = max(scan.outputs, default=-1)
                aside.append((path, "damaged", f"{where or 'a record is missing'}; its owner "
                              f"is gone: {len(lost)} output(s) lost whole{_numbers(lost)}, "
                              f"{len(cut)} persisted only up to the damage{_numbers(cut)}"
                              + (f", and any output after {after} is lost"
                                 if scan.damaged_bytes or scan.tail_bytes else "")))
            elif all(n in ranges for n in outputs):
                finished.append(path)
        if documents or result.rejected:  # the commit: documents and marks, both or neither
            persist_learned(datastore, documents, {MARKS_KEY: marks}, fingerprint=fingerprint,
                            wait_s=max(0.0, deadline - time.monotonic()), expect=committed)
            result.outputs = len(documents)
            result.tokens = sum(len(t) for _, t in documents)
        for path in finished:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            result.removed_logs += 1
        for path, why, cost in aside:  # after the commit: kept, never removed
            with contextlib.suppress(FileNotFoundError):
                kept = set_aside(path, why)
                result.set_aside.append(f"learned-output log {path}: {cost}; kept as "
                                        f"{kept.name}")
        return result


def _numbers(numbers: list[int]) -> str:
    if not numbers:
        return ""
    shown = ", ".join(map(str, numbers[:8]))
    return f" (output {shown}{', ...' if len(numbers) > 8 else ''})"


@dataclass
class Snapshot:
    """What a starting process loads: persisted outputs (tenant key, tokens) oldest first,
    and which logged outputs they are."""

    documents: list[tuple[str, list[int]]]
    persisted: dict[str, Ranges]
    damaged: str | None = None  # why the marks are unusable (every logged output replays)

    def skip(self, name: str, number: int) -> bool:
        ranges = self.persisted.get(name)
        return ranges is not None and number in ranges


def load_persisted(datastore: str, max_tokens: int, token_keys: list[str],
                   wait_s: float, opened=lambda: None) -> Snapshot:
    """The newest persisted outputs that fit `max_tokens` and the marks of the same commit;
    `opened()` runs under the same lock (to open the logs as they are at that commit)."""
    with persist_lock(datastore, wait_s, reading=True):  # not held: a best effort view
        newest: list[tuple[str, list[int]]] = []
        total = 0
        with Reader(datastore) as reader:
            damaged = None
            try:
                marks = log_marks(reader.manifest.get("learned") or {})  # this commit's
            except MarksDamaged as exc:
                marks, damaged = {}, f"{datastore}: {exc}"
            if LEARNED_CORPUS in (reader.corpora or {}):
                for _, name, tokens in reader.documents(LEARNED_CORPUS, newest_first=True):
                    key = persisted_key(name, token_keys)
                    if key is None:
                        continue  # no session of this server may draft it
                    if total + len(tokens) > max_tokens:
                        break
                    newest.append((key, list(tokens)))
                    total += len(tokens)
        opened()
    newest.reverse()
    return Snapshot(newest, marks, damaged)
