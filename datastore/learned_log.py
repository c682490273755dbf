"""Learned-output logs: how the processes serving one datastore share what they learn.

Why files in the datastore directory rather than a message broker: every process serving a
datastore already shares its directory, and append + flock + atomic rename are all it takes;
there is no extra service to run and no single process whose loss stops the sharing.

Each serving process owns one append-only log `DIR/learned/<uuid>.log2` and holds an flock
on it while alive (the kernel releases it when the process dies, even by SIGKILL: a log
whose lock is free has a dead or finished owner). Every other process reads the log from
where it stopped (`LogTail`). A log (version 2) is the magic, a header, then records:

    header:  u16 length, u32 crc32 of the JSON, JSON {"fingerprint": the tokenizer's,
             "memory_only": whether its outputs may ever be persisted}
    record:  u32 length of the payload, u32 crc32 of the payload, payload
    payload: u64 output (numbered 0, 1, ... per log), u64 start (where its tokens begin in
             the output), u8 flags (1: the output is final), u16 length of the tenant key,
             the tenant key (UTF-8), then tokens as <u4

An output is its records' tokens in order (the first record starts with the prompt tail);
`start` lets a reader tell an output with a missing record from a whole one, and lets the
writer split an output longer than a record may hold. A log is written by one process with
one write per batch of records, so a reader sees whole records, and at worst an incomplete
last one (it waits for the rest; a write that fails is truncated back to the last whole
record). Version-1 logs (`<uuid>.log`: no header, no `start`) are still read.

The owner keeps a copy of every byte it wrote while it holds the log (`OwnedLog.check`): a
log deleted, replaced, cut or changed under a live owner is written again from that copy
under the same name, so nothing it learned is lost and no reader's position moves. A log
damaged after its owner is gone is read past the damage (`scan_log`), and the reader learns
exactly which outputs the damage cost.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from redraft.proto.errors import DatastoreError
from redraft.proto.files import flock_within

LOG_DIR = "learned"
LOG_SUFFIX = ".log2"  # what this version writes
LEGACY_SUFFIX = ".log"  # version 1, still read
PERSIST_LOCK = ".persist.lock"
MAGIC_V1 = b"redraft-learned-log\x001\n"
MAGIC = b"redraft-learned-log\x002\n"
_TMP_PREFIX = ".new-"
_HEAD = struct.Struct("<II")
_LOG_HEAD = struct.Struct("<HI")
_FIXED = {1: struct.Struct("<QBH"), 2: struct.Struct("<QQBH")}
FINAL = 1  # flags: the output is final
MAX_RECORD = 64 << 20  # a longer length field is damage, not a record
RECORD_TOKENS = 1 << 20  # a longer output is written as several records


@dataclass
class Record:
    output: int
    tenant: str
    tokens: list[int]
    final: bool
    start: int = 0  # where `tokens` begin in the output (version 2)


@dataclass
class Output:
    """One output as a whole log tells it."""

    tenant: str
    tokens: list[int] = field(default_factory=list)
    final: bool = False


@dataclass(frozen=True)
class LogHeader:
    """Who may use a log: outputs learned for tokenizer `fingerprint` ("" in version 1:
    unknown), persisted never when `memory_only`."""

    fingerprint: str = ""
    memory_only: bool = False
    version: int = 2


def log_dir(datastore: str | os.PathLike) -> Path:
    return Path(datastore) / LOG_DIR


def is_log_name(name: str) -> bool:
    return name.endswith((LOG_SUFFIX, LEGACY_SUFFIX)) and not name.startswith(".")


def list_logs(datastore: str | os.PathLike) -> list[Path]:
    """The logs now in the datastore's log folder (none when it does not exist)."""
    try:
        names = os.listdir(log_dir(datastore))
    except FileNotFoundError:
        return []
    return sorted(log_dir(datastore) / n for n in names if is_log_name(n))


def new_log_name() -> str:
    return f"{uuid.uuid4().hex}{LOG_SUFFIX}"


def encode_header(header: LogHeader) -> bytes:
    body = json.dumps({"fingerprint": header.fingerprint, "memory_only": header.memory_only},
                      sort_keys=True).encode()
    return MAGIC + _LOG_HEAD.pack(len(body), zlib.crc32(body)) + body


def parse_header(data: bytes | memoryview) -> tuple[LogHeader | None, int, bool]:
    """(header, where the records start, damaged); the header is None while the log is
    still shorter than its header (it is being created) or when it is damaged."""
    if bytes(data[:len(MAGIC_V1)]) == MAGIC_V1:
        return LogHeader("", False, 1), len(MAGIC_V1), False
    if len(data) < len(MAGIC):  # still being created, unless it is no log's beginning
        head = bytes(data)
        return None, 0, head != MAGIC[:len(head)] and head != MAGIC_V1[:len(head)]
    if bytes(data[:len(MAGIC)]) != MAGIC:
        return None, 0, True
    at = len(MAGIC) + _LOG_HEAD.size
    if len(data) < at:
        return None, 0, False
    n, crc = _LOG_HEAD.unpack_from(data, len(MAGIC))
    if len(data) < at + n:
        return None, 0, False
    body = bytes(data[at:at + n])
    try:
        if zlib.crc32(body) != crc:
            raise ValueError("crc")
        doc = json.loads(body)
        header = LogHeader(str(doc["fingerprint"]), bool(doc["memory_only"]), 2)
    except (ValueError, KeyError, TypeError):
        return None, 0, True
    return header, at + n, False


def encode(records: Iterable[Record], version: int = 2) -> bytes:
    """Records as a log holds them; in version 2 an output's tokens past RECORD_TOKENS go
    to further records (a longer record would read as damage)."""
    fixed = _FIXED[version]
    out = bytearray()
    for r in records:
        tenant = r.tenant.encode("utf-8")
        tokens = np.asarray(r.tokens, dtype="<u4")
        pieces = range(0, max(1, len(tokens)), RECORD_TOKENS) if version == 2 else [0]
        for i in pieces:
            last = i + RECORD_TOKENS >= len(tokens) or version == 1
            flags = FINAL if r.final and last else 0
            head = (fixed.pack(r.output, r.start + i, flags, len(tenant)) if version == 2
                    else fixed.pack(r.output, flags, len(tenant)))
            chunk = tokens if version == 1 else tokens[i:i + RECORD_TOKENS]
            payload = head + tenant + chunk.tobytes()
            out += _HEAD.pack(len(payload), zlib.crc32(payload)) + payload
    return bytes(out)


_INCOMPLETE = object()
_DAMAGED = object()


def _record_at(data, pos: int, end: int, version: int):
    """The record at `pos` and where the next one starts, _INCOMPLETE or _DAMAGED."""
    fixed = _FIXED[version]
    if pos + _HEAD.size > end:
        return _INCOMPLETE
    length, crc = _HEAD.unpack_from(data, pos)
    if length < fixed.size or length > MAX_RECORD:
        return _DAMAGED
    if pos + _HEAD.size + length > end:
        return _INCOMPLETE
    payload = bytes(data[pos + _HEAD.size:pos + _HEAD.size + length])
    if zlib.crc32(payload) != crc:
        return _DAMAGED
    if version == 2:
        output, start, flags, n = fixed.unpack_from(payload)
    else:
        (output, flags, n), start = fixed.unpack_from(payload), 0
    body = fixed.size + n
    if body > length or (length - body) % 4:
        return _DAMAGED
    try:
        tenant = payload[fixed.size:body].decode("utf-8")
    except UnicodeDecodeError:
        return _DAMAGED
    tokens = np.frombuffer(payload, dtype="<u4", offset=body).tolist()
    return Record(output, tenant, tokens, bool(flags & FINAL), start), pos + _HEAD.size + length


def decode(data: bytes | memoryview, start: int = 0,
           version: int = 2) -> tuple[list[Record], int, bool]:
    """The whole records in `data` from `start`: (records, where the next one starts,
    damaged)."""
    records = []
    pos, end = start, len(data)
    while True:
        got = _record_at(data, pos, end, version)
        if got is _INCOMPLETE:
            return records, pos, False
        if got is _DAMAGED:
            return records, pos, True
        records.append(got[0])
        pos = got[1]


def _next_record(data, pos: int, version: int) -> int | None:
    """Where the next whole record starts at or after `pos` (a damaged stretch skipped);
    None when none does. Candidates are found with array operations (a tenant key begins
    `k:` or `t:`, the high half of the output number is zero), then checked whole: its
    crc32 makes a false start about one in 2^32."""
    fixed = _FIXED[version]
    buf = np.frombuffer(data, dtype=np.uint8)
    n = len(buf)
    key_at = _HEAD.size + fixed.size  # the tenant key's first byte
    last = n - key_at - 2
    window = 1 << 20
    for lo in range(pos, last + 1, window):
        hi = min(last + 1, lo + window)
        m = hi - lo
        k0, k1 = buf[lo + key_at:hi + key_at], buf[lo + key_at + 1:hi + key_at + 1]
        ok = ((k0 == ord("k")) | (k0 == ord("t"))) & (k1 == ord(":"))
        for b in range(4):  # the output number's high half
            ok &= buf[lo + _HEAD.size + 4 + b:lo + _HEAD.size + 4 + b + m] == 0
        for p in np.flatnonzero(ok) + lo:
            got = _record_at(data, int(p), n, version)
            if got is not _INCOMPLETE and got is not _DAMAGED:
                return int(p)
    return None


def read_log(path: str | os.PathLike) -> tuple[dict[int, Output], bool]:
    """Every output a log holds up to any damage, and whether it is damaged (what precedes
    the damage is returned). A log that is gone reads as empty."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}, False
    header, at, damaged = parse_header(data)
    if header is None:
        return {}, damaged
    records, _, damaged = decode(data, at, header.version)
    outputs: dict[int, Output] = {}
    for r in records:
        out = outputs.get(r.output)
        if out is None:
            out = outputs[r.output] = Output(r.tenant)
        out.tokens.extend(r.tokens)
        out.final = out.final or r.final
    return outputs, damaged


@dataclass
class LogScan:
    """A whole log read past any damage: its outputs as far as they are whole (`cut`:
    outputs with a record missing, kept up to the gap), the damaged bytes skipped, and an
    incomplete last record (`tail_bytes`: normal while the owner writes, damage after)."""

    header: LogHeader | None
    outputs: dict[int, Output] = field(default_factory=dict)
    cut: set[int] = field(default_factory=set)
    damaged_bytes: int = 0
    damage_at: int | None = None
    tail_bytes: int = 0
    size: int = 0  # the log's bytes as read

    @property
    def damaged(self) -> bool:
        return self.header is None or self.damaged_bytes > 0 or bool(self.cut)

    def lost(self) -> set[int]:
        """Outputs numbered below the last one seen of which no record is left."""
        return set(range(max(self.outputs, default=-1) + 1)) - set(self.outputs)


def scan_log(path: str | os.PathLike) -> LogScan | None:
    """`path` read whole, past damage (None: it is gone)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    header, pos, damaged = parse_header(data)
    if header is None:
        return LogScan(None, damaged_bytes=len(data) if damaged else 0,
                       damage_at=0 if damaged else None, size=len(data))
    scan = LogScan(header, size=len(data))
    nexts: dict[int, int] = {}  # per output: the start its next record must have
    while True:
        got = _record_at(data, pos, len(data), header.version)
        if got is _INCOMPLETE:
            scan.tail_bytes = len(data) - pos
            break
        if got is _DAMAGED:
            skip_to = _next_record(data, pos + 1, header.version)
            end = len(data) if skip_to is None else skip_to
            scan.damaged_bytes += end - pos
            scan.damage_at = pos if scan.damage_at is None else scan.damage_at
            if skip_to is None:
                break
            pos = skip_to
            continue
        r, pos = got
        if header.version == 1:  # no starts: its records follow each other
            r.start = nexts.get(r.output, 0)
        out = scan.outputs.get(r.output)
        if out is None:
            out = scan.outputs[r.output] = Output(r.tenant)
            nexts[r.output] = r.start
            if r.start:  # its beginning is gone
                scan.cut.add(r.output)
        if r.start != nexts[r.output]:  # a record of it is gone: kept up to the gap
            scan.cut.add(r.output)
            continue
        out.tokens.extend(r.tokens)
        nexts[r.output] += len(r.tokens)
        out.final = out.final or r.final
    return scan


def owner_alive(path: str | os.PathLike) -> bool:
    """Whether a process still holds the log's lock (its owner, alive and writing it).
    A log that is gone has no owner."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the probe's own lock
    return False


def _create_locked(folder: Path, name: str, data: bytes | bytearray) -> int:
    """A file holding `data`, locked, then renamed to `name` (replacing what is there):
    no other process ever sees it without its owner."""
    tmp = folder / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _write_all(fd, data)
        os.rename(tmp, folder / name)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


class OwnedLog:
    """A log this process writes: created whole (magic and header written, lock held)
    before it appears under its name, so no other process ever sees it without an owner.
    While it holds the lock it keeps a copy of what it wrote, to write the log again if it
    is removed or damaged under it (`check`)."""

    def __init__(self, datastore: str | os.PathLike, fingerprint: str = "",
                 memory_only: bool = False, name: str | None = None) -> None:
        self.folder = log_dir(datastore)
        self.header = LogHeader(fingerprint, memory_only)
        self.name = name or new_log_name()
        self.path = self.folder / self.name
        self._copy = bytearray(encode_header(self.header))
        try:
            self.folder.mkdir(exist_ok=True)
            fd = _create_locked(self.folder, self.name, self._copy)
        except OSError as exc:
            raise DatastoreError(f"{self.folder}: cannot create a learned-output log "
                                 f"({exc.strerror or exc})") from exc
        self._fd: int | None = fd
        self._ident = self._stat_ident(os.fstat(fd))

    @staticmethod
    def _stat_ident(st: os.stat_result) -> tuple[int, int]:
        return st.st_dev, st.st_ino

    @property
    def size(self) -> int:
        return len(self._copy)

    @property
    def locked(self) -> bool:
        return self._fd is not None

    def append(self, records: Sequence[Record]) -> None:
        """Write records at the end, in one write (others read whole records). A write
        that fails (a full disk) is cut back to the last whole record before the error is
        raised: a partial record would hide every record written after it."""
        if not records or self._fd is None:
            return
        data = encode(records)
        try:
            _write_all(self._fd, data)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, len(self._copy))
            raise
        self._copy += data

    def check(self, full: bool = False) -> str | None:
        """Whether the log on disk is still what this process wrote (its name, its size,
        with `full` every byte); if not, write it again from the copy, under the same name
        (readers keep their place: the bytes are the same), and say what was found. An
        OSError when it cannot be written again."""
        if self._fd is None:
            return None
        st = os.fstat(self._fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            now = None
        if st.st_nlink == 0 or now is None:
            problem = "was deleted"
        elif self._stat_ident(now) != self._ident:
            problem = "was replaced by another file"
        elif st.st_size != len(self._copy):
            problem = f"was cut to {st.st_size} bytes" if st.st_size < len(self._copy) \
                else f"grew to {st.st_size} bytes"
        elif full and os.pread(self._fd, len(self._copy) + 1, 0) != self._copy:
            problem = "was changed"
        else:
            return None
        self.folder.mkdir(exist_ok=True)
        fd = _create_locked(self.folder, self.name, self._copy)
        os.close(self._fd)
        self._fd = fd
        self._ident = self._stat_ident(os.fstat(fd))
        return f"{self.path} {problem} under this server; written again from memory " \
               f"({len(self._copy)} bytes)"

    def release(self) -> None:
        """Give up the lock: the log now reads as finished (its owner wrote all of it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._copy = bytearray()

    def remove(self) -> None:
        self.release()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class LogTail:
    """Follows one other process's log: each `read` returns the records added since. A
    log written again under the same name (its owner's repair) is followed in the new file
    from the same place; damage stops the reading until the file changes."""

    def __init__(self, path: str | os.PathLike, resume: int = 0) -> None:
        self.path = Path(path)
        self.resume = resume  # a place read before (the log was gone for a moment)
        self.offset = 0
        self.damaged = False
        self.header: LogHeader | None = None
        self._fd: int | None = None
        self._seen: tuple | None = None  # the file as damage was met (dev, ino, size, mtime)

    def open(self) -> bool:
        """Open the log now (a log removed later stays readable); False if it is gone."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return False
        return True

    def _follow_rewrite(self) -> None:
        """Switch to the file now under the name if it is another one (a repair)."""
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return
        st = os.fstat(self._fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(self.path, os.O_RDONLY)
                os.close(self._fd)
                self._fd = fd

    def read(self, max_bytes: int = 16 << 20) -> list[Record]:
        if not self.open():
            return []
        self._follow_rewrite()
        if self.damaged:
            st = os.fstat(self._fd)
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == self._seen:
                return []
        if self.header is None:
            head = os.pread(self._fd, 1 << 16, 0)
            header, at, damaged = parse_header(head)
            if header is None:
                self._note_damage(damaged)
                return []
            self.header, self.offset = header, max(at, self.resume)
        data = os.pread(self._fd, max_bytes, self.offset)
        if len(data) == max_bytes and len(data) >= _HEAD.size:  # a record over max_bytes?
            length = _HEAD.unpack_from(data)[0]
            if _HEAD.size + length > max_bytes and length <= MAX_RECORD:
                data = os.pread(self._fd, _HEAD.size + length, self.offset)
        if not data:
            return []
        records, used, damaged = decode(data, 0, self.header.version)
        self.offset += used
        self._note_damage(damaged)
        return records

    def _note_damage(self, damaged: bool) -> None:
        self.damaged = damaged
        if damaged:
            st = os.fstat(self._fd)
            self._seen = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def persist_lock(datastore: str | os.PathLike, wait_s: float,
                 reading: bool = False) -> Iterator[bool]:
    """Hold the lock that makes learned-output persisting one process at a time; yields
    False (nothing held) when another process kept it for `wait_s` seconds. `reading`: a
    reader of a datastore it cannot write (read-only) takes the lock if the file is there
    and goes on without it otherwise, instead of failing."""
    folder = log_dir(datastore)
    try:
        folder.mkdir(exist_ok=True)
        fd = os.open(folder / PERSIST_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        if not reading:
            raise DatastoreError(f"{folder}: cannot open the persist lock "
                                 f"({exc.strerror or exc})") from exc
        try:
            fd = os.open(folder / PERSIST_LOCK, os.O_RDONLY)
        except OSError:
            yield False
            return
    try:
        yield flock_within(fd, wait_s, 0.05)
    finally:
        os.close(fd)


def set_aside(path: str | os.PathLike, why: str) -> Path:
    """Rename a log no process may use again out of the logs' names (`<name>.<why>`), so
    that nobody reads or removes it: it still holds outputs nobody persisted."""
    path = Path(path)
    aside = path.with_name(f"{path.name}.{why}")
    os.rename(path, aside)
    return aside


def remove_stale_new_logs(datastore: str | os.PathLike, older_than_s: float = 60.0) -> None:
    """Remove logs a process was killed while creating (never named, so never read)."""
    folder = log_dir(datastore)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    now = time.time()
    for n in names:
        if not n.startswith(_TMP_PREFIX):
            continue
        path = folder / n
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > older_than_s and not owner_alive(path):
                path.unlink()
