"""Changing a datastore: one writer at a time, new segment files, one atomic commit, the
files no commit names any more removed.

Every change runs as a `Transaction` under the directory's write lock (`.write.lock`,
flock; a writer waits for it up to `wait_s`, default 30 s, then gives up with one line):

1. leftovers of writers killed earlier are removed: temporary files, segment files the
   current manifest does not name, a legacy `datastore.lmdb` a finished upgrade left;
2. the current commit is opened (a legacy single-file datastore is verified and converted
   first: its file becomes a segment by a hard link, or a copy where links fail);
3. the change writes new segment files (`SegmentWriter`: temporary name, renamed when
   complete);
4. the merge policy (`tiers.py`) may replace runs of small segments, old or just written,
   by one merged segment each;
5. the segment files the new manifest names are synced, then the manifest is published
   (temporary file, fsync, rename, fsync of the directory): the commit;
6. files it replaced are unlinked (readers that still map them keep their snapshot).

A writer killed anywhere before the rename of 5 leaves the previous commit as it was;
after it, the new one. Segments are verified (every checksum) before anything is copied
out of them, so a writer never carries damage into a new file (a damaged one is refused
with one line and nothing changes); an append that merges nothing reads no old segment.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
from redraft.datastore import format as fmt
from redraft.datastore import manifest as mf
from redraft.datastore import tiers
from redraft.datastore.reader import Reader
from redraft.datastore.segment import SegmentWriter
from redraft.proto.errors import DatastoreCorrupt, DatastoreError, DatastoreNotFound
from redraft.proto.files import flock_within, fsync_path

DEFAULT_WAIT_S = 30.0
_LOCK_POLL_S = 0.02


def write_error(out: Path, exc: BaseException) -> DatastoreError:
    """One line for a failure of the file system while writing (full, read-only, ...)."""
    if isinstance(exc, OSError) and exc.strerror:
        reason = exc.strerror
    else:  # LMDB reports a short write on a full disk as an I/O error: say how full it is
        reason = str(exc)
        with contextlib.suppress(OSError):
            st = os.statvfs(out)
            reason += f"; {st.f_bavail * st.f_frsize:,} bytes free on its file system"
    return DatastoreError(f"{out}: cannot write the datastore ({reason}); "
                          f"nothing was changed")


@contextlib.contextmanager
def write_lock(out: Path, wait_s: float = DEFAULT_WAIT_S) -> Iterator[None]:
    """Hold the directory's write lock; wait for another writer up to `wait_s` seconds."""
    try:
        fd = os.open(out / fmt.WRITE_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise write_error(out, exc) from exc
    try:
        if not flock_within(fd, wait_s, _LOCK_POLL_S):
            raise DatastoreError(f"{out}: another process is writing this datastore (waited "
                                 f"{wait_s:g} s); try again later")
        yield
    finally:
        os.close(fd)


def remove_leftovers(out: Path, keep: set[str] | None) -> None:
    """Under the lock: remove what killed or failed writers left. `keep`: the segment files
    the current commit names (None: unknown, e.g. a damaged manifest; then only temporary
    files go). With a manifest in place, a legacy datastore.lmdb is a leftover too."""
    try:
        names = os.listdir(out)
    except OSError:
        return
    has_manifest = mf.MANIFEST_FILE in names
    for name in names:
        gone = name.startswith((fmt.TMP_PREFIX, fmt.LEGACY_TMP_PREFIX))
        if keep is not None and mf.is_segment_name(name):
            gone = name not in keep
        if name == fmt.DATA_FILE and has_manifest and keep is not None:
            gone = True
        if gone:
            _unlink_quietly(out / name)


def _unlink_quietly(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


class CommitConflict(DatastoreError):
    """The commit is no longer the one a conditional write was prepared against."""


def refuse_damaged(exc: DatastoreCorrupt, verb: str = "modify") -> DatastoreCorrupt:
    return DatastoreCorrupt(f"refusing to {verb} a damaged datastore: {exc}")


class Transaction:
    """One change of the datastore at `out`, under its write lock (see the module doc).

    `reader`: the current commit (None when there is none, or when a rebuild replaces it);
    `manifest`: the manifest being prepared (a copy of the current one, without the
    Reader's per-shard view); `generation`: the one it will publish.
    """

    def __init__(self, out: Path, reader: Reader | None, manifest: dict, *,
                 progress: bool = False) -> None:
        self.out = out
        self.reader = reader
        self.manifest = manifest
        self.generation = int(manifest["generation"]) + 1
        self.progress = progress
        self.replaced: set[str] = set()  # files the new commit no longer names
        self.aliases: dict[str, str] = {}  # a converted legacy file's segment name -> its name
        self._writers: list[SegmentWriter] = []

    def writer(self, kind: str, build: dict) -> SegmentWriter:
        """A new segment file of this commit."""
        w = SegmentWriter(self.out, self.generation, self.manifest["tokenizer"], build,
                          kind=kind, progress=self.progress)
        self._writers.append(w)
        return w

    def verify(self, names: list[str]) -> None:
        """Every checksum of these segments of the current commit: nothing damaged is
        copied into a new file."""
        if not names:
            return
        try:
            self.reader.verify(only={self.aliases.get(n, n) for n in names})
        except DatastoreCorrupt as exc:
            raise refuse_damaged(exc) from exc

    def segment_shards(self, name: str) -> list[dict]:
        """The Reader's entries (global ids) of a current segment's shards, in order."""
        name = self.aliases.get(name, name)
        return [sh for sh in self.reader.manifest["shards"] if sh["segment"] == name]

    def replace(self, index: int, entries: list[dict]) -> None:
        """Segments `entries` take the place of segment `index` (its documents, in order)."""
        segs = self.manifest["segments"]
        self.replaced.add(segs[index]["file"])
        segs[index:index + 1] = entries

    def merge(self) -> None:
        """Apply the tier policy to the manifest being prepared: runs of small segments (old
        ones verified first) become one merged segment each."""
        mf.retotal(self.manifest)  # the first_doc of segments this transaction added
        groups = tiers.plan(self.manifest["segments"])
        if not groups:
            return
        old = set(self.reader.segments) if self.reader is not None else set()
        names = [self.manifest["segments"][i]["file"] for g in groups for i in g]
        self.verify([n for n in names if self.aliases.get(n, n) in old])
        with Reader.staged(self.out, self.manifest) as staged:
            for group in reversed(groups):  # replace from the end: indexes stay valid
                _merge_group(self, staged, group)

    def publish(self) -> dict:
        m = self.manifest
        m["generation"] = self.generation
        mf.retotal(m)
        named = {s["file"] for s in m["segments"]}
        for w in self._writers:
            if w.finished and w.name in named:
                w.sync()
        mf.publish(self.out, m)
        for name in self.replaced - named:
            _unlink_quietly(self.out / name)
        with contextlib.suppress(OSError):
            if (self.out / fmt.DATA_FILE).exists():
                (self.out / fmt.DATA_FILE).unlink()  # converted: the manifest names a copy
        with contextlib.suppress(OSError):
            fsync_path(self.out)
        return m

    def abort(self) -> None:
        for w in self._writers:
            w.abort()
        keep = None
        with contextlib.suppress(Exception):
            keep = {s["file"] for s in mf.read(self.out)[0]["segments"]}
        if keep is None and not (self.out / mf.MANIFEST_FILE).exists():
            keep = set()  # no commit yet (first build, or a legacy datastore): none named
        for w in self._writers:  # at least this transaction's own files
            _unlink_quietly(self.out / w.name)
        remove_leftovers(self.out, keep)


def current_manifest(reader: Reader) -> dict:
    """The manifest a transaction starts from: the commit's, without the Reader's view."""
    m = copy.deepcopy({k: v for k, v in reader.manifest.items() if k not in ("shards",)})
    m.pop("legacy", None)
    return m


def _open_current(out: Path, verify_legacy: bool) -> Reader:
    try:
        reader = Reader(out)
    except DatastoreCorrupt as exc:
        raise refuse_damaged(exc) from exc
    if reader.layout == "legacy" and verify_legacy:
        try:
            reader.verify()
        except DatastoreCorrupt as exc:
            reader.close()
            raise refuse_damaged(exc) from exc
    return reader


def upgraded(tx: Transaction) -> None:
    """Turn the transaction's legacy single-file commit into segments: its file becomes a
    segment by a hard link (the same bytes, so nothing to rewrite) or, where the file system
    has no links or the file is format 1, by copying its shards into a new format-2 file."""
    r = tx.reader
    m = tx.manifest
    m.update(version=mf.DIRECTORY_VERSION, generation=0)
    tx.generation = 1
    entry = m["segments"][0]
    build = m.setdefault("build", {})
    build.setdefault("history", []).append({
        "op": "upgrade", "corpus": None, "n_docs": 0, "n_tokens": 0, "seconds": 0.0,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    name = mf.segment_name(tx.generation)
    if r.version >= 2:
        try:
            os.link(r.file, tx.out / name)
            tx.replace(0, [{**entry, "file": name}])
            tx.aliases[name] = entry["file"]
            tx.replaced.discard(entry["file"])
            return
        except OSError:
            pass  # no hard links here: copy
    w = tx.writer("corpus", {"op": "upgrade"})
    for sh in r.manifest["shards"]:
        w.carry_shard(r, sh)
    tx.replace(0, [w.finish()])
    tx.replaced.discard(entry["file"])


def run(out: Path, change: Callable[[Transaction], bool], *, wait_s: float = DEFAULT_WAIT_S,
        progress: bool = False) -> dict:
    """Apply `change` to the datastore at `out` as one commit (see the module doc).

    `change(tx)` edits `tx.manifest` (adding segments it wrote, replacing others) and says
    whether there is anything to publish. Returns the manifest now current.
    """
    with write_lock(out, wait_s):
        reader = _open_current(out, verify_legacy=True)
        with reader:
            remove_leftovers(out, set(reader.segments) if reader.layout == "segments"
                             else set())
            tx = Transaction(out, reader, current_manifest(reader), progress=progress)
            try:
                legacy = reader.layout == "legacy"
                if legacy:
                    upgraded(tx)
                if not (change(tx) or legacy):
                    return tx.manifest
                tx.merge()
                return tx.publish()
            except BaseException as exc:
                tx.abort()
                if isinstance(exc, (OSError, lmdb.Error)):
                    raise write_error(out, exc) from exc
                raise


def _merge_group(tx: Transaction, staged: Reader, group: list[int]) -> None:
    """Write the segments `group` (consecutive indexes) as one: consecutive shards of one
    corpus are re-sorted together up to the datastore's shard size, a shard alone is copied
    as it is; documents keep their ids (deleted ones stay, empty)."""
    segs = tx.manifest["segments"]
    names = [segs[i]["file"] for i in group]
    kinds = {segs[i]["kind"] for i in group}
    w = tx.writer(kinds.pop() if len(kinds) == 1 else "merged", {"op": "merge"})
    limit = int(tx.manifest.get("build", {}).get("shard_tokens") or fmt.MAX_SHARD_LEN)
    limit = max(1, min(limit, fmt.MAX_SHARD_LEN))
    run_: list[dict] = []
    wanted = set(names)
    for sh in (sh for sh in staged.manifest["shards"] if sh["segment"] in wanted):
        if run_ and (sh["corpus"] != run_[0]["corpus"]
                     or sum(s["length"] for s in run_) + sh["length"] > limit):
            _flush(w, staged, run_)
            run_ = []
        run_.append(sh)
    _flush(w, staged, run_)
    entry = w.finish()
    segs[group[0]:group[-1] + 1] = [entry]
    tx.replaced.update(names)


def _flush(w: SegmentWriter, reader: Reader, shards: list[dict]) -> None:
    if len(shards) == 1:
        w.carry_shard(reader, shards[0])
    elif shards:
        w.rewrite_shards(reader, shards)


def upgrade_datastore(path: str | os.PathLike, *, wait_s: float = DEFAULT_WAIT_S
                      ) -> tuple[dict, bool]:
    """Convert a legacy single-file datastore to segments in place (verified first: a
    damaged one is refused). Idempotent. Returns (manifest, whether anything changed)."""
    out, layout = mf.locate(path)
    if not out.is_dir():
        raise DatastoreNotFound(f"{out}: a datastore directory is needed to upgrade")
    if layout == "segments":
        with Reader(out) as r:
            return current_manifest(r), False
    return run(out, lambda tx: False, wait_s=wait_s), True
