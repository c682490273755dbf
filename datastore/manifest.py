"""The commit point of a datastore directory: `manifest.json`, naming the segments that make
up the datastore now, replaced as a whole by an atomic rename.

Why a manifest: segment files are immutable. A change (build, append, delete, a learned
persist, a merge) writes new segment files, then publishes a new manifest naming the whole
set. The rename is the commit, as Lucene commits segments: a reader sees the old set or the
new one, never a mix; a writer killed at any point leaves the previous commit whole (what it
wrote is named by no manifest, and the next writer removes it).

    {"format": "redraft-datastore", "version": 3, "generation": N,
     "tokenizer": {"name", "fingerprint", "vocab_size"}, "token_dtype", "separator",
     "segments": [{"file", "bytes", "crc32" (of the segment's own manifest bytes),
                   "first_doc" (global id of its local document 0), "n_docs" (ids it spans,
                   deleted ones included), "n_tokens", "n_deleted", "n_shards",
                   "corpora": {name: {"n_docs", "n_tokens"}}, "kind"}],
     "n_docs", "n_tokens" (live), "n_deleted", "n_shards", "n_segments", "corpora",
     "build": {"shard_tokens", "field", "history": [...]},
     "learned": {...} (opaque to storage: the draft service's watermarks),
     "crc32": crc32 of the canonical JSON of everything else}

A directory holding only `datastore.lmdb` (the single-file layout of format 2 and before)
reads as a snapshot of one segment; any write converts it first (`upgrade`).

Tested by: tests/datastore/test_commit.py, tests/datastore/test_corrupt.py
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from pathlib import Path

from redraft.datastore import format as fmt
from redraft.proto.errors import DatastoreCorrupt, DatastoreNotFound
from redraft.proto.files import write_atomically

MANIFEST_FILE = "manifest.json"
DIRECTORY_VERSION = 3
SEGMENT_KINDS = ("corpus", "learned", "merged")
LEARNED_CORPUS = "learned"  # the corpus learned outputs are persisted as
_SEGMENT_NAME = re.compile(r"seg-[0-9]{6,12}-[0-9a-f]{8}\.lmdb")
MAX_MANIFEST_BYTES = 64 << 20  # a manifest of a million segments is still far below this
MAX_HISTORY = 1000  # build events kept in the manifest (learned persists never stop coming)

# How often a serving process looks for a new commit, and the bound it promises: a commit
# is drafted from within this long (the poll, the open, the swap between two steps).
POLL_INTERVAL_S = 0.5
PICKUP_BOUND_S = 2.0


def segment_name(generation: int) -> str:
    """A fresh segment file name: the generation that will first name it, and a random tag
    (two writers never race for a name: they hold the lock, but a killed one left files)."""
    return f"seg-{generation:06d}-{secrets.token_hex(4)}.lmdb"


def is_segment_name(name: str) -> bool:
    return _SEGMENT_NAME.fullmatch(name) is not None


def locate(path: str | os.PathLike) -> tuple[Path, str]:
    """(directory, layout) of the datastore at `path`: layout "segments" when it holds a
    manifest.json, "legacy" for a lone datastore.lmdb. `path` may name the directory, its
    manifest.json or a legacy file itself."""
    p = Path(os.fspath(path))
    if not os.path.lexists(p):
        raise DatastoreNotFound(f"{p}: no such datastore")
    if p.is_dir():
        if (p / MANIFEST_FILE).is_file():
            return p, "segments"
        if (p / fmt.DATA_FILE).is_file():
            return p, "legacy"
        raise DatastoreNotFound(f"{p}: no datastore here (missing {MANIFEST_FILE} and "
                                f"{fmt.DATA_FILE})")
    if p.name == MANIFEST_FILE:
        return p.parent, "segments"
    if p.is_file():
        return p, "legacy"  # a legacy file named directly (its directory is its parent)
    raise DatastoreNotFound(f"{p}: no datastore here")


def commit_stamp(path: str | os.PathLike) -> tuple:
    """What identifies the commit published at `path` now, cheaply (a stat and a read of
    the small manifest): equal stamps, same commit. ("missing",) when there is none.

    The manifest's bytes are hashed, not only stat'ed: two commits within one tick of the
    file system's clock can reuse the inode number and the size.
    """
    p = Path(os.fspath(path))
    if p.is_dir() or not p.exists():
        candidates = [(p / MANIFEST_FILE, "segments"), (p / fmt.DATA_FILE, "legacy")]
    elif p.name == MANIFEST_FILE:
        candidates = [(p, "segments")]
    else:
        candidates = [(p, "legacy")]
    for file, layout in candidates:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            ident = (layout, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if layout == "legacy" or not stat.S_ISREG(st.st_mode):
                return ident
            data = os.read(fd, MAX_MANIFEST_BYTES + 1)
            return (*ident, fmt.crc32(data))
        except OSError:
            continue
        finally:
            os.close(fd)
    return ("missing",)


# ---- encoding ------------------------------------------------------------------------
def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False,
                      ensure_ascii=True).encode("ascii")


def encode(manifest: dict) -> bytes:
    """The file's bytes: readable JSON whose "crc32" covers the canonical form of the rest."""
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    return (json.dumps({**body, "crc32": fmt.crc32(_canonical(body))}, indent=1,
                       sort_keys=True, allow_nan=False) + "\n").encode("ascii")


def publish(directory: Path, manifest: dict) -> None:
    """Replace the directory's manifest.json by `manifest`, durably: the commit."""
    data = encode(manifest)
    write_atomically(directory / MANIFEST_FILE, lambda tmp: tmp.write_bytes(data),
                     tmp=directory / f"{fmt.TMP_PREFIX}manifest-{os.getpid()}.json",
                     durable=True)


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def read(directory: Path) -> tuple[dict, tuple]:
    """The manifest of `directory` (checked: crc32 and every field) and the stamp of the
    file it was read from. DatastoreCorrupt names what is wrong in one line."""
    file = directory / MANIFEST_FILE
    fd = os.open(file, os.O_RDONLY)  # FileNotFoundError: the caller decides what it means
    try:
        st = os.fstat(fd)
        chunks, size = [], 0
        while size <= MAX_MANIFEST_BYTES:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    stamp = ("segments", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
             fmt.crc32(raw))
    if len(raw) > MAX_MANIFEST_BYTES:
        raise DatastoreCorrupt(f"{file}: larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise DatastoreCorrupt(f"{file}: not valid JSON (damaged or truncated)") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != "redraft-datastore":
        raise DatastoreCorrupt(f"{file}: not a redraft datastore manifest")
    crc = manifest.get("crc32")
    if not isinstance(crc, int) or isinstance(crc, bool) or crc != fmt.crc32(_canonical(manifest)):
        raise DatastoreCorrupt(f"{file}: manifest checksum mismatch")
    if manifest.get("version") != DIRECTORY_VERSION:
        raise DatastoreCorrupt(f"{file}: format version {manifest.get('version')!r}, this "
                               f"redraft reads directory version {DIRECTORY_VERSION}")
    try:
        check(manifest)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise DatastoreCorrupt(f"{file}: inconsistent manifest ({exc})") from exc
    return manifest, stamp


def _count(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, not {value!r}")
    return value


def check(m: dict) -> None:
    """Every field a reader relies on has its type and the segments tile the ids. Raises
    ValueError/TypeError/KeyError naming the field (a crc that holds over nonsense, or a
    manifest written by something else, must still be one line)."""
    _count(m["generation"], "generation")
    tok = m["tokenizer"]
    if not isinstance(tok.get("name"), str) or not isinstance(tok.get("fingerprint"), str):
        raise ValueError("tokenizer name and fingerprint must be strings")
    vocab = _count(tok["vocab_size"], "tokenizer.vocab_size")
    if m["token_dtype"] != fmt.token_dtype(vocab) or m["separator"] != vocab:
        raise ValueError("token_dtype or separator does not fit the vocabulary")
    segments = m["segments"]
    if not isinstance(segments, list):
        raise TypeError("segments must be a list")
    next_doc = 0
    seen: set[str] = set()
    for n, seg in enumerate(segments):
        if not isinstance(seg, dict):
            raise TypeError(f"segment {n} is not an object")
        name = seg["file"]
        if not isinstance(name, str) or not is_segment_name(name):
            raise ValueError(f"segment {n}: {name!r} is not a segment file name")
        if name in seen:
            raise ValueError(f"segment {name} is named twice")
        seen.add(name)
        for field in ("bytes", "crc32", "first_doc", "n_docs", "n_tokens", "n_deleted",
                      "n_shards"):
            _count(seg[field], f"segment {n} {field}")
        if seg["first_doc"] != next_doc or seg["n_deleted"] > seg["n_docs"]:
            raise ValueError(f"segment {n}: document ids out of sequence")
        if seg["kind"] not in SEGMENT_KINDS:
            raise ValueError(f"segment {n}: kind {seg['kind']!r}")
        _check_corpora(seg["corpora"], f"segment {n} corpora")
        next_doc += seg["n_docs"]
    for field in ("n_docs", "n_tokens", "n_deleted", "n_shards", "n_segments"):
        _count(m[field], field)
    _check_corpora(m["corpora"], "corpora")
    if not isinstance(m.get("learned", {}), dict):
        raise TypeError("learned must be an object")
    if not isinstance(m["build"], dict) or not isinstance(m["build"].get("history", []), list):
        raise TypeError("build.history must be a list")
    for field in ("shard_tokens", "history_dropped"):  # None or 0: the default
        if m["build"].get(field) is not None:
            _count(m["build"][field], f"build.{field}")


def _check_corpora(corpora, what: str) -> None:
    if not isinstance(corpora, dict):
        raise TypeError(f"{what} must be an object")
    for name, c in corpora.items():
        _count(c["n_docs"], f"{what} {name} n_docs")
        _count(c["n_tokens"], f"{what} {name} n_tokens")


# ---- building one ----------------------------------------------------------------------
def new(*, tokenizer: dict, build: dict, generation: int = 1) -> dict:
    """An empty manifest of `generation` (segments are added, then `retotal` fills sums)."""
    vocab = int(tokenizer["vocab_size"])
    return {
        "format": "redraft-datastore",
        "version": DIRECTORY_VERSION,
        "generation": int(generation),
        "tokenizer": {"name": str(tokenizer["name"]),
                      "fingerprint": str(tokenizer["fingerprint"]), "vocab_size": vocab},
        "token_dtype": fmt.token_dtype(vocab),
        "separator": vocab,
        "segments": [],
        "build": build,
        "learned": {},
    }


def retotal(m: dict) -> dict:
    """Assign first_doc in order and recompute the sums over the segments."""
    corpora: dict[str, dict] = {}
    first = 0
    for seg in m["segments"]:
        seg["first_doc"] = first
        first += seg["n_docs"]
        for name, c in seg["corpora"].items():
            acc = corpora.setdefault(name, {"n_docs": 0, "n_tokens": 0})
            acc["n_docs"] += c["n_docs"]
            acc["n_tokens"] += c["n_tokens"]
    m["corpora"] = corpora
    m["n_docs"] = sum(c["n_docs"] for c in corpora.values())
    m["n_tokens"] = sum(c["n_tokens"] for c in corpora.values())
    m["n_deleted"] = sum(s["n_deleted"] for s in m["segments"])
    m["n_shards"] = sum(s["n_shards"] for s in m["segments"])
    m["n_segments"] = len(m["segments"])
    history = m["build"].setdefault("history", [])
    if len(history) > MAX_HISTORY:
        m["build"]["history_dropped"] = int(m["build"].get("history_dropped", 0)) + \
            len(history) - MAX_HISTORY
        del history[:len(history) - MAX_HISTORY]
    return m


def segment_entry(file: str, size: int, inner: dict, inner_crc: int, kind: str) -> dict:
    """The manifest's entry for a finished segment file (first_doc is set by `retotal`)."""
    n_ids = sum(int(sh["n_docs"]) for sh in inner["shards"])
    return {
        "file": file,
        "bytes": int(size),
        "crc32": int(inner_crc),
        "first_doc": 0,
        "n_docs": n_ids,
        "n_tokens": int(inner["n_tokens"]),
        "n_deleted": int(inner["n_deleted"]),
        "n_shards": len(inner["shards"]),
        "corpora": {name: {"n_docs": int(c["n_docs"]), "n_tokens": int(c["n_tokens"])}
                    for name, c in inner["corpora"].items()},
        "kind": kind,
    }

