"""Files redraft writes for itself: where its caches live, and how a file is replaced; and
how an input file given on a command line is read.

Why one place: every cache (tokenizer conversions, cost curves, calibration, recycling
tables, Medusa hidden states) must honour the same `REDRAFT_CACHE`, and every file a reader
may open (a datastore, a heads file, a cache entry) must appear whole or not at all.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

from redraft.proto.errors import RedraftError

CACHE_ENV = "REDRAFT_CACHE"


def read_input(path: str | os.PathLike) -> bytes:
    """An input file's bytes. Anything but a regular file is an OSError at once: reading a
    FIFO (or a device) blocks until a writer comes, or never ends."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return Path(path).read_bytes()


def cache_root() -> Path:
    """Where redraft keeps its caches: $REDRAFT_CACHE, else $XDG_CACHE_HOME/redraft, else
    ~/.cache/redraft."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "redraft")
    return Path(root)


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object], *,
                     tmp: str | os.PathLike | None = None, durable: bool = False) -> None:
    """Create `path` whole or not at all: `write(tmp)` fills a temporary sibling (a file or a
    directory), which is then renamed over `path`; on any failure it is removed.

    The temporary name keeps `path`'s suffix (some writers append one otherwise) unless `tmp`
    names it. `durable`: the file and the rename are synced to disk before returning (for
    data, not caches).
    """
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(
        f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    if durable:
        fsync_path(path.parent)


def check_writable(path: str | os.PathLike, what: str = "output") -> None:
    """Refuse, before any work, a file path that `write_atomically` could not replace: an
    existing directory, a path under a regular file, or a folder this process cannot write.

    Why up front: a long job (training) must not find out at its end that it has nowhere to
    put its result. Folders that do not exist yet are fine (writers create them).
    """
    path = Path(path)
    if path.is_dir():
        raise RedraftError(f"{what} {path} is a directory; give a file path")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # the nearest folder that exists (or what blocks the path)
    if not folder.is_dir():
        raise RedraftError(f"{what} {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RedraftError(f"{what} {path}: cannot write in {folder}")


def write_cache(path: str | os.PathLike, write: Callable[[Path], object]) -> bool:
    """`write_atomically` for a cache entry, its folder created first: a cache that cannot
    be written is no error (False), it only costs the next process its head start."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, write)
        return True
    except OSError:
        return False


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file (or a directory's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def flock_within(fd: int, wait_s: float, poll_s: float = 0.02) -> bool:
    """Take an exclusive flock on `fd`, waiting up to `wait_s` seconds for its holder (a
    polled non-blocking try: a blocking flock cannot time out); False if never taken."""
    deadline = time.monotonic() + max(0.0, float(wait_s))
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
