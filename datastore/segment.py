"""Writing one segment file: shards (token array, suffix array, document offsets, first-token
buckets, names), corpus and deleted bitmaps and the segment's own manifest, in the
single-file LMDB layout of `format.py`, with document ids local to the segment.

A segment is written under a temporary name and renamed to its final `seg-*` name; it is
immutable from then on, and synced before a commit names it. Nothing reads it before a
manifest names it (manifest.py), so a segment that is never published is only a leftover
for the next writer to remove.

Tested by: tests/datastore/test_build.py, tests/datastore/test_commit.py
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pydivsufsort
from pydivsufsort import divsufsort
from pyroaring import BitMap
from redraft.datastore import format as fmt
from redraft.datastore import manifest as mf
from redraft.proto.files import fsync_path

_MAP_SIZE = 1 << 40 if sys.maxsize > 2**32 else 1 << 31


# Below this many tokens a suffix array is sorted on one thread. pydivsufsort runs OpenMP
# threads, and on a busy machine a parallel region waits for a core: a 100-token sort took a
# median 16 ms with two threads on two loaded cores, 0.2 ms on one. Learned persists and
# merges of small segments sort small arrays all the time.
SMALL_SORT_TOKENS = 1 << 17


def _openmp_threads() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """omp_get_max_threads / omp_set_num_threads of the OpenMP runtime pydivsufsort ships
    (None where there is none to find: then sorts keep its default)."""
    where = os.path.join(os.path.dirname(pydivsufsort.__file__), os.pardir,
                         "pydivsufsort.libs", "libgomp*.so*")
    for lib in glob.glob(where):
        try:
            gomp = ctypes.CDLL(lib)
            return gomp.omp_get_max_threads, gomp.omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


_OPENMP = _openmp_threads()


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Token-order suffix array of a uint16/uint32 array, as little-endian uint32."""
    if len(tokens) > fmt.MAX_SHARD_LEN:
        raise ValueError("shard too large for uint32 offsets")
    if _OPENMP is None or len(tokens) >= SMALL_SORT_TOKENS:
        return divsufsort(tokens).astype("<u4", copy=False)
    get, set_ = _OPENMP
    threads = get()  # a setting of this thread only
    set_(1)
    try:
        return divsufsort(tokens).astype("<u4", copy=False)
    finally:
        set_(threads)


class SegmentWriter:
    """Writes shards, bitmaps and the header of one new segment file.

    `header`: the datastore's tokenizer ({"name", "fingerprint", "vocab_size"}) and `build`
    (recorded in the segment's own manifest). Shards carried or rewritten from a Reader take
    their global ids there and get local ones here.
    """

    def __init__(self, directory: Path, generation: int, tokenizer: dict, build: dict, *,
                 kind: str = "corpus", progress: bool = False) -> None:
        self.directory = directory
        self.name = mf.segment_name(generation)
        self.tmp = directory / f"{fmt.TMP_PREFIX}{self.name}"
        self.kind = kind
        self.progress = progress
        self.manifest = fmt.new_manifest(tokenizer_name=tokenizer["name"],
                                         fingerprint=tokenizer["fingerprint"],
                                         vocab_size=tokenizer["vocab_size"], build=build)
        self.env = None
        self.env = fmt.open_writer(str(self.tmp), map_size=_MAP_SIZE)
        self.vocab = int(tokenizer["vocab_size"])
        self.sep = self.vocab
        self.dtype = np.dtype(self.manifest["token_dtype"])
        self.be = self.dtype.newbyteorder(">")
        self.corpora: dict[str, BitMap] = {}
        self.deleted = BitMap()  # local ids
        self.length = 0  # tokens written, separators included
        self.finished = False

    @property
    def next_doc(self) -> int:
        shards = self.manifest["shards"]
        return shards[-1]["first_doc"] + shards[-1]["n_docs"] if shards else 0

    def _put(self, key: bytes, value) -> None:
        # One transaction per value: LMDB holds a value's pages in memory until commit.
        with self.env.begin(write=True) as txn:
            txn.put(key, value)

    def _add_entry(self, entry: dict) -> None:
        first = self.next_doc
        entry.update(id=len(self.manifest["shards"]), first_doc=first)
        self.manifest["shards"].append(entry)
        self.corpora.setdefault(entry["corpus"], BitMap()).add_range(
            first, first + entry["n_docs"])
        self.length += int(entry["length"])

    def _carry_deleted(self, deleted: BitMap, first: int, n_docs: int) -> None:
        """Deleted global ids [first, first + n_docs) of a source, at this writer's next ids."""
        if deleted and n_docs:
            gone = deleted & BitMap(range(first, first + n_docs))
            if gone:
                self.deleted |= gone.shift(self.next_doc - first)

    def add_shard(self, docs: list[np.ndarray], names: list[str], corpus: str) -> None:
        """Sort and write a new shard of these documents (empty ones keep their ids)."""
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        starts = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(lengths + 1, out=starts[1:])
        length = int(starts[-1])
        tokens = np.empty(length, dtype=self.dtype)
        for d, s in zip(docs, starts[:-1]):
            tokens[s:s + len(d)] = d
        tokens[starts[1:] - 1] = self.sep
        t0 = time.perf_counter()
        if self.progress:
            print(f"sorting shard {len(self.manifest['shards'])} ({length:,} tokens)",
                  file=sys.stderr, flush=True)
        sa = suffix_array(tokens)
        sa_s = time.perf_counter() - t0
        counts = np.bincount(tokens, minlength=self.sep + 1)
        bucket = np.zeros(self.sep + 2, dtype="<u4")
        np.cumsum(counts, out=bucket[1:])
        idx = len(self.manifest["shards"])
        values = {
            "tokens": tokens.astype(self.be),
            "sa": sa,
            "docs": starts.astype("<u4"),
            "bucket": bucket,
            # File names that are not UTF-8 arrive as surrogate escapes: store their bytes.
            "names": zlib.compress("\n".join(n.replace("\n", "\\n") for n in names)
                                   .encode("utf-8", "surrogateescape"), 6),
        }
        del tokens
        checks = {}
        for what, arr in values.items():
            buf = memoryview(np.ascontiguousarray(arr)).cast("B") if what != "names" else arr
            checks[what] = fmt.crc32(buf)
            self._put(fmt.shard_key(idx, what), buf)
        self._add_entry({"corpus": corpus, "n_docs": len(docs), "n_tokens": int(lengths.sum()),
                         "length": length, "crc32": checks, "sa_seconds": round(sa_s, 3)})

    def carry_shard(self, reader, shard: dict) -> None:
        """Copy a shard of a checked Reader as it is (no re-sorting); `shard` is its entry in
        `reader.manifest["shards"]` (global id and first_doc)."""
        checks = dict(shard["crc32"])
        for what in fmt.SHARD_KEYS:
            buf = reader.shard_raw(shard["id"], what)
            if what not in checks:  # version 1 kept no crc of names
                checks[what] = fmt.crc32(buf)
            self._put(fmt.shard_key(len(self.manifest["shards"]), what), buf)
        self._carry_deleted(reader.deleted, shard["first_doc"], shard["n_docs"])
        entry = {k: v for k, v in shard.items()
                 if k not in ("offsets", "id", "first_doc", "segment")}
        self._add_entry({**entry, "crc32": checks})

    def rewrite_shards(self, reader, shards: list[dict], gone: Iterable[int] = ()) -> None:
        """One new shard holding the documents of consecutive `shards` (one corpus), the
        tokens of documents `gone` (global ids) removed; every id stays, the removed ones as
        empty documents, so that no other id changes."""
        gone = set(gone)
        docs: list[np.ndarray] = []
        names: list[str] = []
        for sh in shards:
            first = sh["first_doc"]
            for i, d in enumerate(reader.shard_documents(sh["id"])):
                docs.append(d[:0] if first + i in gone else d)
            names.extend(reader.shard_names(sh["id"]))
        lo = shards[0]["first_doc"]
        deleted = BitMap(reader.deleted) | BitMap(gone)
        self._carry_deleted(deleted, lo, sum(sh["n_docs"] for sh in shards))
        self.add_shard(docs, names, shards[0]["corpus"])

    def finish(self) -> dict:
        """Write bitmaps and the manifest, sync, publish the file under its final name (still
        named by no commit). Returns the datastore manifest's entry for it."""
        m = self.manifest
        m["version"] = fmt.FORMAT_VERSION
        m["n_shards"] = len(m["shards"])
        _recount(m, self.deleted)
        checks = {}
        with self.env.begin(write=True) as txn:
            for name, bm in self.corpora.items():
                raw = bm.serialize()
                checks["corpus/" + name] = fmt.crc32(raw)
                txn.put(fmt.corpus_key(name), raw)
            raw = self.deleted.serialize()
            checks["deleted"] = fmt.crc32(raw)
            txn.put(fmt.KEY_DELETED, raw)
            m["checksums"] = checks
            inner_crc = fmt.write_header(txn, m)
        self.env.close()
        self.env = None
        final = self.directory / self.name
        os.replace(self.tmp, final)
        self.finished = True
        return mf.segment_entry(self.name, os.path.getsize(final), m, inner_crc, self.kind)

    def sync(self) -> None:
        """Flush the finished file to disk (a commit about to name it: a segment merged away
        in the same transaction is never synced)."""
        fsync_path(self.directory / self.name)

    def abort(self) -> None:
        """Close and remove the temporary file (a failed or interrupted write)."""
        if self.env is not None:
            with contextlib.suppress(Exception):
                self.env.close()
            self.env = None
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def _recount(m: dict, deleted: BitMap) -> None:
    """Totals of live (not deleted) documents and tokens, overall and per corpus. A shard's
    n_tokens counts live tokens only: deleted documents have none left."""
    corpora: dict[str, dict] = {}
    for sh in m["shards"]:
        c = corpora.setdefault(sh["corpus"], {"n_docs": 0, "n_tokens": 0, "n_shards": 0})
        c["n_shards"] += 1
        lo = sh["first_doc"]
        c["n_docs"] += sh["n_docs"] - deleted.range_cardinality(lo, lo + sh["n_docs"])
        c["n_tokens"] += sh["n_tokens"]
    m["corpora"] = corpora
    m["n_docs"] = sum(c["n_docs"] for c in corpora.values())
    m["n_tokens"] = sum(c["n_tokens"] for c in corpora.values())
    m["n_deleted"] = len(deleted)


class SegmentSeries:
    """Shards written into new segment files, a new file once one holds `segment_tokens`
    tokens (so that a delete rewrites a bounded file, not the whole build)."""

    def __init__(self, make: Callable[[], SegmentWriter], segment_tokens: int) -> None:
        self._make = make
        self.segment_tokens = max(1, int(segment_tokens))
        self.current: SegmentWriter | None = None
        self.entries: list[dict] = []
        probe = make()  # the vocabulary and dtype, for callers that check ids
        self.vocab, self.dtype = probe.vocab, probe.dtype
        self.current = probe

    def add_shard(self, docs: list[np.ndarray], names: list[str], corpus: str) -> None:
        length = sum(len(d) + 1 for d in docs)
        if self.current is not None and self.current.manifest["shards"] and \
                self.current.length + length > self.segment_tokens:
            self.entries.append(self.current.finish())
            self.current = None
        if self.current is None:
            self.current = self._make()
        self.current.add_shard(docs, names, corpus)

    def finish(self) -> list[dict]:
        """Entries of every segment written (an empty last one is dropped)."""
        if self.current is not None:
            if self.current.manifest["shards"]:
                self.entries.append(self.current.finish())
            else:
                self.current.abort()
            self.current = None
        return self.entries

    def abort(self) -> None:
        if self.current is not None:
            self.current.abort()
            self.current = None
