"""The on-disk layout of one segment: a single-file LMDB, its keys, its manifest, checksums.

A datastore directory holds segment files and a manifest.json naming them (manifest.py). A
segment (`seg-*.lmdb`) is a single-file LMDB environment (no lock file: it is never modified
in place) with document ids local to it; before format 3 a datastore was one such file,
`datastore.lmdb`, with the same keys. Keys:

    magic                      MAGIC (identifies the file and the major layout)
    manifest                   UTF-8 JSON, see `new_manifest`
    manifest.crc32             crc32 of the manifest bytes, 4 bytes little-endian
    shard/NNNNNN/tokens        token array: big-endian uint16 or uint32, one separator
                               (= vocab_size) after every document
    shard/NNNNNN/sa            suffix array of the token array, little-endian uint32
    shard/NNNNNN/docs          document start offsets (n_docs + 1 entries, last = length), <u4
    shard/NNNNNN/bucket        SA start of each first token (vocab_size + 2 entries), <u4
    shard/NNNNNN/names         zlib-compressed, newline-separated document names
    corpus/<name>              pyroaring bitmap: the segment's doc ids of a named corpus
    deleted                    pyroaring bitmap: its deleted doc ids (their tokens are gone)

Tokens are stored big-endian so that comparing raw bytes orders suffixes exactly as tokens
order them: a binary search compares slices of the mmap with one memcmp each.

Version 2 added the crc32 of every shard's `names` and removes deleted documents' tokens
from their shard (version 1 only tombstoned them). Version 1 files without deleted
documents are still read (their names are checked by zlib's own checksum) and converting
one to segments rewrites it as version 2.

Tested by: tests/datastore/test_corrupt.py, tests/datastore/test_build.py
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib

import lmdb
from redraft.datastore.lmdbfile import LmdbFile
from redraft.proto.errors import DatastoreCorrupt

MAGIC = b"redraft-datastore\x00"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
DATA_FILE = "datastore.lmdb"
WRITE_LOCK = ".write.lock"
TMP_PREFIX = ".tmp-"  # every file a writer has not finished: removed by the next writer
LEGACY_TMP_PREFIX = ".datastore.lmdb.tmp-"  # what writers of format 2 left when killed

KEY_MAGIC = b"magic"
KEY_MANIFEST = b"manifest"
KEY_MANIFEST_CRC = b"manifest.crc32"
KEY_DELETED = b"deleted"
SHARD_ARRAYS = ("tokens", "sa", "docs", "bucket")
SHARD_KEYS = (*SHARD_ARRAYS, "names")

# Largest token array one shard may hold: suffix-array offsets are uint32 and an LMDB value
# (the SA, 4 bytes per token) must stay under 4 GiB.
MAX_SHARD_LEN = (1 << 30) - 1


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
    raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return raw, struct.pack("<I", crc32(raw))


def write_header(txn, manifest: dict) -> int:
    """Magic, manifest and its crc32 (returned: the datastore manifest names the segment
    by it)."""
    raw, crc = encode_manifest(manifest)
    txn.put(KEY_MAGIC, MAGIC)
    txn.put(KEY_MANIFEST, raw)
    txn.put(KEY_MANIFEST_CRC, crc)
    return crc32(raw)


def open_writer(file: str, map_size: int):
    """A new single-file environment to write (only ever on a file no reader sees yet)."""
    return lmdb.open(os.fsencode(file), subdir=False, lock=False, map_size=map_size,
                     sync=False, metasync=False, max_dbs=0, readahead=False)


def read_manifest(lm: LmdbFile) -> tuple[dict, int]:
    """Check magic, version and manifest checksum; return the manifest and that checksum."""
    file = lm.file
    magic, raw, crc = lm.get(KEY_MAGIC), lm.get(KEY_MANIFEST), lm.get(KEY_MANIFEST_CRC)
    if magic is None or bytes(magic) != MAGIC:
        raise DatastoreCorrupt(f"{file}: wrong magic, not a redraft datastore")
    if raw is None or crc is None:
        raise DatastoreCorrupt(f"{file}: manifest missing")
    raw = bytes(raw)
    if struct.pack("<I", crc32(raw)) != bytes(crc):
        raise DatastoreCorrupt(f"{file}: manifest checksum mismatch")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise DatastoreCorrupt(f"{file}: manifest is not valid JSON") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != "redraft-datastore":
        raise DatastoreCorrupt(f"{file}: the manifest is not a redraft datastore's")
    version = manifest.get("version")
    if version not in READABLE_VERSIONS:
        raise DatastoreCorrupt(f"{file}: format version {version!r}, this redraft reads "
                               f"{' and '.join(map(str, READABLE_VERSIONS))}")
    return manifest, crc32(raw)
