"""The on-disk layout of a datastore: one LMDB file, its keys, the manifest and checksums.

A datastore is a directory holding `datastore.lmdb`, a single-file LMDB environment (no
lock file: it is never modified in place, see build.py). Keys:

    magic                      MAGIC (identifies the file and the major layout)
    manifest                   UTF-8 JSON, see `new_manifest`
    manifest.crc32             crc32 of the manifest bytes, 4 bytes little-endian
    shard/NNNNNN/tokens        token array: big-endian uint16 or uint32, one separator
                               (= vocab_size) after every document
    shard/NNNNNN/sa            suffix array of the token array, little-endian uint32
    shard/NNNNNN/docs          document start offsets (n_docs + 1 entries, last = length), <u4
    shard/NNNNNN/bucket        SA start of each first token (vocab_size + 2 entries), <u4
    shard/NNNNNN/names         zlib-compressed, newline-separated document names
    corpus/<name>              pyroaring bitmap: global doc ids of a named corpus
    deleted                    pyroaring bitmap: tombstoned global doc ids

Tokens are stored big-endian so that comparing raw bytes orders suffixes exactly as tokens
order them: a binary search compares slices of the mmap with one memcmp each.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import zlib

import lmdb
from redraft.datastore.errors import DatastoreCorrupt, DatastoreNotFound

MAGIC = b"redraft-datastore\x00"
FORMAT_VERSION = 1
DATA_FILE = "datastore.lmdb"
WRITE_LOCK = ".write.lock"
TMP_PREFIX = ".datastore.lmdb.tmp-"

KEY_MAGIC = b"magic"
KEY_MANIFEST = b"manifest"
KEY_MANIFEST_CRC = b"manifest.crc32"
KEY_DELETED = b"deleted"
SHARD_ARRAYS = ("tokens", "sa", "docs", "bucket")

# Largest token array one shard may hold: suffix-array offsets are uint32 and an LMDB value
# (the SA, 4 bytes per token) must stay under 4 GiB.
MAX_SHARD_LEN = (1 << 30) - 1


# LMDB stores a large value in "overflow" pages: a 16-byte page header (page number u64,
# pad u16, flags u16, page count u32) followed by the value's bytes, contiguous in the file.
PAGE_HEADER = 16
P_OVERFLOW = 0x04


def overflow_header_ok(header: bytes, offset: int, size: int, psize: int) -> bool:
    """Whether `header` is the LMDB overflow-page header of a `size`-byte value at `offset`."""
    if len(header) != PAGE_HEADER or offset < PAGE_HEADER:
        return False
    pgno, _, flags, pages = struct.unpack("<QHHI", header)
    return (bool(flags & P_OVERFLOW) and pgno * psize == offset - PAGE_HEADER
            and pages * psize >= size + PAGE_HEADER)


def shard_key(shard: int, what: str) -> bytes:
    return f"shard/{shard:06d}/{what}".encode()


def corpus_key(name: str) -> bytes:
    return b"corpus/" + name.encode("utf-8")


def token_dtype(vocab_size: int) -> str:
    """uint16 when every id and the separator (= vocab_size) fit, else uint32."""
    if vocab_size < 1:
        raise ValueError("vocab_size must be positive")
    if vocab_size <= 0xFFFF:
        return "uint16"
    if vocab_size < 0xFFFFFFFF:
        return "uint32"
    raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")


def crc32(buf) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


def data_path(path: str | os.PathLike) -> str:
    """The LMDB file of a datastore given its directory (or the file itself)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        return os.path.join(p, DATA_FILE)
    return p


def new_manifest(*, tokenizer_name: str, fingerprint: str, vocab_size: int,
                 build: dict) -> dict:
    """An empty manifest: shards and corpora are filled in as they are written."""
    return {
        "format": "redraft-datastore",
        "version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tokenizer": {"name": tokenizer_name, "fingerprint": fingerprint,
                      "vocab_size": int(vocab_size)},
        "token_dtype": token_dtype(vocab_size),
        "separator": int(vocab_size),
        "n_tokens": 0,
        "n_docs": 0,
        "n_deleted": 0,
        "n_shards": 0,
        "shards": [],
        "corpora": {},
        "checksums": {},
        "build": build,
    }


def encode_manifest(manifest: dict) -> tuple[bytes, bytes]:
    import json

    raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return raw, struct.pack("<I", crc32(raw))


def write_header(txn: lmdb.Transaction, manifest: dict) -> None:
    raw, crc = encode_manifest(manifest)
    txn.put(KEY_MAGIC, MAGIC)
    txn.put(KEY_MANIFEST, raw)
    txn.put(KEY_MANIFEST_CRC, crc)


def open_env(file: str, *, write: bool = False, map_size: int | None = None) -> lmdb.Environment:
    """Open the single-file environment. Readers never lock: the file is immutable."""
    if write:
        return lmdb.open(file, subdir=False, lock=False, map_size=map_size or (1 << 30),
                         sync=False, metasync=False, max_dbs=0, readahead=False)
    size = os.path.getsize(file)
    return lmdb.open(file, subdir=False, lock=False, readonly=True,
                     map_size=max(size, 1 << 20), max_dbs=0, readahead=False)


# LMDB refuses to open one file twice in a process, yet several Readers (a service and a
# writer checking the manifest, say) may want the same file: they share one environment,
# each with its own read transaction. Keyed by pid too: an environment never crosses fork().
_ENVS: dict[tuple, list] = {}
_ENVS_LOCK = threading.Lock()


def _file_id(file: str) -> tuple:
    st = os.stat(file)
    return (os.getpid(), st.st_dev, st.st_ino)


def acquire_env(file: str) -> tuple[tuple, lmdb.Environment]:
    """A shared read-only environment of `file` and the key to release it with."""
    with _ENVS_LOCK:
        for _ in range(3):
            key = _file_id(file)
            if key in _ENVS:
                _ENVS[key][1] += 1
                return key, _ENVS[key][0]
            env = open_env(file)
            if _file_id(file) == key:  # not replaced while we opened it
                _ENVS[key] = [env, 1]
                return key, env
            env.close()
        raise lmdb.Error(f"{file} keeps being replaced")


def release_env(key: tuple) -> None:
    with _ENVS_LOCK:
        entry = _ENVS.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _ENVS[key]
            entry[0].close()


def open_checked(path: str | os.PathLike) -> tuple[str, tuple, lmdb.Environment]:
    """Open a datastore file and check what O(1) allows: file, LMDB header, size."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise DatastoreNotFound(f"{p}: no such datastore")
    file = data_path(p)
    if not os.path.isfile(file):
        raise DatastoreNotFound(f"{p}: no datastore here (missing {DATA_FILE})")
    try:
        key, env = acquire_env(file)
    except (lmdb.Error, OSError) as exc:
        raise DatastoreCorrupt(f"{file}: not a readable datastore file ({exc})") from exc
    try:
        # A truncated file would fault (SIGBUS) on first touch of a missing page: refuse it.
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        size = os.path.getsize(file)
        if size < need:
            raise DatastoreCorrupt(f"{file}: truncated ({size} bytes, the index needs {need})")
    except BaseException:
        release_env(key)
        raise
    return file, key, env


def read_manifest(txn: lmdb.Transaction, file: str) -> dict:
    """Check magic, version and manifest checksum; return the manifest."""
    import json

    try:
        magic = txn.get(KEY_MAGIC)
        raw = txn.get(KEY_MANIFEST)
        crc = txn.get(KEY_MANIFEST_CRC)
    except lmdb.Error as exc:
        raise DatastoreCorrupt(f"{file}: damaged index ({exc})") from exc
    if magic is None or bytes(magic) != MAGIC:
        raise DatastoreCorrupt(f"{file}: wrong magic, not a redraft datastore")
    if raw is None or crc is None:
        raise DatastoreCorrupt(f"{file}: manifest missing")
    raw = bytes(raw)
    if struct.pack("<I", crc32(raw)) != bytes(crc):
        raise DatastoreCorrupt(f"{file}: manifest checksum mismatch")
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise DatastoreCorrupt(f"{file}: manifest is not valid JSON") from exc
    version = manifest.get("version")
    if manifest.get("format") != "redraft-datastore" or version != FORMAT_VERSION:
        raise DatastoreCorrupt(
            f"{file}: format version {version!r}, this redraft reads {FORMAT_VERSION}")
    return manifest
