"""Learned-output logs: how the processes serving one datastore share what they learn.

Why files in the datastore directory rather than a message broker: every process serving a
datastore already shares its directory, and append + flock + atomic rename are all it takes;
there is no extra service to run and no single process whose loss stops the sharing.

Each serving process owns one append-only log `DIR/learned/<uuid>.log` and holds an flock
on it while alive (the kernel releases it when the process dies, even by SIGKILL: a log
whose lock is free has a dead or finished owner). Every other process reads the log from
where it stopped (`LogTail`). A log is the magic, then records:

    u32 length of the payload, u32 crc32 of the payload, payload
    payload: u64 output (numbered 0, 1, ... per log), u8 flags (1: the output is final),
             u16 length of the tenant key, the tenant key (UTF-8), then tokens as <u4

An output is its records' tokens in order (the first record starts with the prompt tail).
A log is written by one process with one write per batch of records, so a reader sees
whole records, and at worst an incomplete last one (it waits for the rest; a write that
fails is truncated back to the last whole record); a record whose checksum fails ends what
is read of that log (`damaged`).
"""

from __future__ import annotations

import contextlib
import fcntl
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
LOG_SUFFIX = ".log"
PERSIST_LOCK = ".persist.lock"
MAGIC = b"redraft-learned-log\x001\n"
_TMP_PREFIX = ".new-"
_HEAD = struct.Struct("<II")
_FIXED = struct.Struct("<QBH")
FINAL = 1  # flags: the output is final
MAX_RECORD = 64 << 20  # a longer length field is damage, not a record


@dataclass
class Record:
    output: int
    tenant: str
    tokens: list[int]
    final: bool


@dataclass
class Output:
    """One output as a whole log tells it."""

    tenant: str
    tokens: list[int] = field(default_factory=list)
    final: bool = False


def log_dir(datastore: str | os.PathLike) -> Path:
    return Path(datastore) / LOG_DIR


def list_logs(datastore: str | os.PathLike) -> list[Path]:
    """The logs now in the datastore's log folder (none when it does not exist)."""
    try:
        names = os.listdir(log_dir(datastore))
    except FileNotFoundError:
        return []
    return sorted(log_dir(datastore) / n for n in names
                  if n.endswith(LOG_SUFFIX) and not n.startswith("."))


def encode(records: Iterable[Record]) -> bytes:
    out = bytearray()
    for r in records:
        tenant = r.tenant.encode("utf-8")
        payload = (_FIXED.pack(r.output, FINAL if r.final else 0, len(tenant)) + tenant
                   + np.asarray(r.tokens, dtype="<u4").tobytes())
        out += _HEAD.pack(len(payload), zlib.crc32(payload)) + payload
    return bytes(out)


def decode(data: bytes | memoryview, start: int = 0) -> tuple[list[Record], int, bool]:
    """The whole records in `data` from `start`: (records, where the next one starts,
    damaged)."""
    records = []
    pos, end = start, len(data)
    while pos + _HEAD.size <= end:
        length, crc = _HEAD.unpack_from(data, pos)
        if length < _FIXED.size or length > MAX_RECORD:
            return records, pos, True
        if pos + _HEAD.size + length > end:
            break  # the rest is not written yet
        payload = bytes(data[pos + _HEAD.size:pos + _HEAD.size + length])
        if zlib.crc32(payload) != crc:
            return records, pos, True
        output, flags, n = _FIXED.unpack_from(payload)
        body = _FIXED.size + n
        if body > length or (length - body) % 4:
            return records, pos, True
        try:
            tenant = payload[_FIXED.size:body].decode("utf-8")
        except UnicodeDecodeError:
            return records, pos, True
        tokens = np.frombuffer(payload, dtype="<u4", offset=body).tolist()
        records.append(Record(output, tenant, tokens, bool(flags & FINAL)))
        pos += _HEAD.size + length
    return records, pos, False


def read_log(path: str | os.PathLike) -> tuple[dict[int, Output], bool]:
    """Every output a log holds so far, and whether it is damaged (what precedes the damage
    is returned). A log that is gone reads as empty."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}, False
    if not data.startswith(MAGIC):
        return {}, len(data) >= len(MAGIC)  # a short one may still be being created
    records, _, damaged = decode(data, len(MAGIC))
    outputs: dict[int, Output] = {}
    for r in records:
        out = outputs.get(r.output)
        if out is None:
            out = outputs[r.output] = Output(r.tenant)
        out.tokens.extend(r.tokens)
        out.final = out.final or r.final
    return outputs, damaged


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


class OwnedLog:
    """A log this process writes: created whole (magic written, lock held) before it
    appears under its name, so no other process ever sees it without an owner."""

    def __init__(self, datastore: str | os.PathLike) -> None:
        folder = log_dir(datastore)
        try:
            folder.mkdir(exist_ok=True)
            name = uuid.uuid4().hex
            tmp = folder / f"{_TMP_PREFIX}{name}"
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_APPEND, 0o644)
        except OSError as exc:
            raise DatastoreError(f"{folder}: cannot create a learned-output log "
                                 f"({exc.strerror or exc})") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_all(fd, MAGIC)
            self.path = folder / f"{name}{LOG_SUFFIX}"
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.name = self.path.name
        self.size = len(MAGIC)
        self._fd: int | None = fd

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
                os.ftruncate(self._fd, self.size)
            raise
        self.size += len(data)

    def release(self) -> None:
        """Give up the lock: the log now reads as finished (its owner wrote all of it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        self.release()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class LogTail:
    """Follows one other process's log: each `read` returns the records added since."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.offset = 0
        self.damaged = False
        self._fd: int | None = None

    def open(self) -> bool:
        """Open the log now (a log removed later stays readable); False if it is gone."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return False
        return True

    def read(self, max_bytes: int = 16 << 20) -> list[Record]:
        if self.damaged or not self.open():
            return []
        data = os.pread(self._fd, max_bytes, self.offset)
        if len(data) == max_bytes and self.offset:  # a record longer than max_bytes?
            length = _HEAD.unpack_from(data)[0]
            if _HEAD.size + length > max_bytes and length <= MAX_RECORD:
                data = os.pread(self._fd, _HEAD.size + length, self.offset)
        if not data:
            return []
        start = 0
        if self.offset == 0:
            if len(data) < len(MAGIC):
                return []
            if not data.startswith(MAGIC):
                self.damaged = True
                return []
            start = len(MAGIC)
        records, used, damaged = decode(data, start)
        self.offset += used
        self.damaged = damaged
        return records

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def persist_lock(datastore: str | os.PathLike, wait_s: float) -> Iterator[bool]:
    """Hold the lock that makes learned-output persisting one process at a time; yields
    False (nothing held) when another process kept it for `wait_s` seconds."""
    folder = log_dir(datastore)
    try:
        folder.mkdir(exist_ok=True)
        fd = os.open(folder / PERSIST_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise DatastoreError(f"{folder}: cannot open the persist lock "
                             f"({exc.strerror or exc})") from exc
    try:
        yield flock_within(fd, wait_s, 0.05)
    finally:
        os.close(fd)


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
