"""Reading a datastore: exact suffix-array lookups, zero-copy, over one commit's segments.

Opening reads the commit (manifest.json, or a legacy single file) and maps every segment it
names, reading each one's manifest and the arrays' locations through lmdbfile, whose parser
checks every page number and length against the file (LMDB itself would follow a damaged
pointer out of the map). Every array is a numpy view into a map: nothing is copied into RAM,
and open time grows with the number of segments and shards, not with their size. A Reader
keeps the snapshot it opened (its maps stay valid when a later commit replaces or unlinks
the files; a file truncated or rewritten in place under them is refused, never a crash:
`check_maps`, `files_changed`); a new Reader sees the new commit. After opening no call
mutates shared state, so one Reader serves many threads. Global document ids are a
segment's first_doc plus its local ids; every shard carries its global first_doc, so lookups
never look at segments.

Lookups binary-search the suffix array with `bisect` over the raw big-endian token bytes:
each comparison is one memcmp of a slice of the map, and a per-shard table of first-token
buckets narrows the search before it starts. The longest matching suffix of a context is
found by an exponential then binary search over the suffix length (if a suffix occurs,
every shorter one does): a 16-token context costs at most 7 probes instead of 15, and about 3
when matches are short (2-4 tokens, the common case on code). Deleted documents need no
filtering here: deleting one removes its tokens from its shard (see build.py).
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from pyroaring import BitMap
from redraft.datastore import format as fmt
from redraft.datastore import manifest as mf
from redraft.datastore.lmdbfile import LmdbFile, faults
from redraft.proto.errors import (
    DatastoreCorrupt,
    DatastoreError,
    DatastoreNotFound,
    InvalidQuery,
    TokenizerMismatch,
)
from redraft.proto.models import tokenizer_fingerprint

_LITTLE = sys.byteorder == "little"


class _Shard:
    """Views of one shard's arrays and the search primitives over them."""

    __slots__ = ("id", "corpus", "first_doc", "n_docs", "length", "width", "tokens",
                 "src", "base", "sa", "sa_mv", "docs", "bucket", "bucket_mv", "segment",
                 "local")

    def __init__(self, meta: dict, arrays: dict, dtype: np.dtype, src, base: int,
                 segment: _Segment, local: int) -> None:
        self.id = meta["id"]  # global: its index among every shard of the snapshot
        self.corpus = meta["corpus"]
        self.first_doc = meta["first_doc"]  # global
        self.n_docs = meta["n_docs"]
        self.length = meta["length"]
        self.segment = segment
        self.local = local  # its index in its segment file
        self.width = dtype.itemsize
        self.tokens = np.frombuffer(arrays["tokens"], dtype=dtype.newbyteorder(">"))
        self.sa = np.frombuffer(arrays["sa"], dtype="<u4")
        self.docs = np.frombuffer(arrays["docs"], dtype="<u4")
        self.bucket = np.frombuffer(arrays["bucket"], dtype="<u4")
        # memoryview indexing returns plain ints fast; numpy scalars are slower for bisect.
        self.sa_mv = arrays["sa"].cast("I") if _LITTLE else self.sa.tolist()
        self.bucket_mv = arrays["bucket"].cast("I") if _LITTLE else self.bucket.tolist()
        # Slicing the mmap yields bytes in one step (a memoryview needs a second, .tobytes()).
        self.src, self.base = src, base

    def _key(self, nb: int):
        """p -> the nb bytes of the suffix at token position p (what bisect compares)."""
        w, base, src = self.width, self.base, self.src

        def k(p: int) -> bytes:
            s = base + p * w
            return src[s:s + nb]
        return k

    def lower(self, key: bytes, t0: int) -> tuple[int, int, bool]:
        """(first SA index >= key, end of key's first-token bucket, whether key occurs)."""
        lo = self.bucket_mv[t0]
        hi = self.bucket_mv[t0 + 1]
        if lo == hi:
            return lo, hi, False
        k = self._key(len(key))
        i = bisect_left(self.sa_mv, key, lo, hi, key=k)
        return i, hi, i < hi and k(self.sa_mv[i]) == key

    def upper(self, key: bytes, lo: int, hi: int) -> int:
        """First SA index in [lo, hi) whose suffix is past every suffix starting with key."""
        return bisect_right(self.sa_mv, key, lo, hi, key=self._key(len(key)))


class ReaderClosed(DatastoreError):
    """A verb called on a Reader after close() (its map is gone)."""


def _while_open(verb):
    """A verb of an open Reader: on a closed one it raises ReaderClosed, one clear error,
    instead of whatever its first touch of the released map would raise."""

    @functools.wraps(verb)
    def run(self, *args, **kwargs):
        if self._closed:
            raise ReaderClosed(f"{self.path}: the Reader is closed")
        return verb(self, *args, **kwargs)
    return run


def _guarded(verb):
    """An open Reader's lookup (see `_while_open`) whose damaged arrays, in a Reader opened
    without verify(), surface as DatastoreCorrupt: an index past an array's end is the one
    way they can show (every slice is bounded). A SuffixQuery checks its Reader."""

    @functools.wraps(verb)
    def run(self, *args, **kwargs):
        reader = getattr(self, "reader", self)
        if reader._closed:
            raise ReaderClosed(f"{reader.path}: the Reader is closed")
        try:
            out = verb(self, *args, **kwargs)
        except IndexError as exc:
            reader.check_maps()
            raise DatastoreCorrupt(f"{self.file}: damaged arrays ({exc}); verify it with "
                                   f"`redraft stats`") from exc
        reader.check_maps()
        return out
    return run


class _Changed(Exception):
    """A file the commit being opened names is gone because a newer commit replaced it."""


class _Segment:
    """One open segment file: its checked map, its own manifest, its global first id."""

    def __init__(self, file: str, name: str, first_doc: int, entry: dict | None) -> None:
        self.file = file
        self.name = name
        self.first_doc = first_doc
        self.lm = LmdbFile(file)
        try:
            self.manifest, self.crc = fmt.read_manifest(self.lm)
            if entry is not None:
                self._check_entry(entry)
            self.version = int(self.manifest["version"])
            self.n_docs = sum(int(sh["n_docs"]) for sh in self.manifest["shards"])
        except BaseException:
            self.lm.close()
            raise

    def _check_entry(self, entry: dict) -> None:
        """The file is the one the datastore manifest names: size and manifest crc32."""
        if self.lm.size != entry["bytes"]:
            raise DatastoreCorrupt(f"{self.file}: {self.lm.size} bytes, the datastore's "
                                   f"manifest says {entry['bytes']}")
        if self.crc != entry["crc32"]:
            raise DatastoreCorrupt(f"{self.file}: not the segment the datastore's manifest "
                                   f"names (its own manifest's crc32 differs)")

    def where(self, key: bytes, size: int | None = None) -> tuple[int, int]:
        """(offset, length) of a value in the map; DatastoreCorrupt if missing or mis-sized."""
        where = self.lm.locate(key)
        if where is None:
            raise DatastoreCorrupt(f"{self.file}: missing {key.decode()}")
        if size is not None and where[1] != size:
            raise DatastoreCorrupt(
                f"{self.file}: {key.decode()} has {where[1]} bytes, the manifest says {size}")
        return where

    def value(self, key: bytes, size: int | None = None) -> memoryview:
        off, n = self.where(key, size)
        return self.lm.view[off:off + n]

    def checked(self, key: bytes, want: int | None, what: str) -> memoryview:
        """A value whose crc32 must be `want` (None: no checksum recorded)."""
        buf = self.value(key)
        if want is not None and fmt.crc32(buf) != want:
            raise DatastoreCorrupt(f"{self.file}: checksum mismatch in {what}")
        return buf

    def close(self) -> None:
        self.lm.close()


_OPEN_ATTEMPTS = 8  # commits replacing segments while this open reads the one before


class Reader:
    """An open datastore snapshot. Cheap to open; use as a context manager or call close().

    Thread-safe once open: no verb mutates shared state, so many threads may query one
    Reader at once (the draft service does). close() must wait until they are done; after
    it every verb, and `with` on it, raises ReaderClosed.
    """

    _faults_seen = 0  # the process's count of truncated-map reads when last checked

    def __init__(self, path: str | os.PathLike, *, verify: bool = False) -> None:
        self.path = self.file = os.fspath(path)
        self._closed = True
        self._segments: list[_Segment] = []
        self._on_close: list[Callable[[], object]] = []
        try:
            for _attempt in range(_OPEN_ATTEMPTS):
                self.directory, self.layout = mf.locate(path)
                try:
                    self._open()
                    break
                except _Changed:
                    self._release()
            else:
                raise DatastoreError(f"{self.path}: the datastore changed {_OPEN_ATTEMPTS} "
                                     "times while it was being opened; try again")
            self._closed = False
            self._load()
            if verify:
                self.verify()
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            self._closed = False
            self.close()  # a manifest whose checksum holds but whose fields do not fit
            raise DatastoreCorrupt(f"{self.file}: inconsistent manifest ({exc!r})") from exc
        except BaseException:
            self._closed = False
            self.close()
            raise

    # ---- opening ------------------------------------------------------------------------
    def _open_segment(self, file: str, name: str, first_doc: int, entry: dict | None,
                      stamp: tuple) -> _Segment:
        try:
            return _Segment(file, name, first_doc, entry)
        except FileNotFoundError as exc:
            if mf.commit_stamp(self.directory) != stamp:
                raise _Changed() from exc
            if entry is None:
                raise DatastoreNotFound(f"{file}: no such datastore") from exc
            raise DatastoreCorrupt(f"{file}: missing (manifest.json names it)") from exc
        except OSError as exc:
            raise DatastoreError(f"{file}: cannot read ({exc.strerror or exc})") from exc

    def _open(self) -> None:
        """Read the commit (manifest.json, or the legacy file) and open every segment."""
        if self.layout == "legacy":
            file = str(self.directory / fmt.DATA_FILE) if self.directory.is_dir() \
                else str(self.directory)
            self.file = file
            self.stamp = mf.commit_stamp(self.directory)
            seg = self._open_segment(file, os.path.basename(file), 0, None, self.stamp)
            self._segments = [seg]
            self.manifest = _legacy_manifest(seg)
            return
        self.file = str(self.directory / mf.MANIFEST_FILE)
        try:
            manifest, self.stamp = mf.read(self.directory)
        except FileNotFoundError as exc:
            raise _Changed() from exc  # replaced by a legacy file? locate() decides again
        except OSError as exc:
            raise DatastoreError(f"{self.file}: cannot read ({exc.strerror or exc})") from exc
        self._open_segments(manifest)

    def _open_segments(self, manifest: dict) -> None:
        for entry in manifest["segments"]:
            seg = self._open_segment(str(self.directory / entry["file"]), entry["file"],
                                     entry["first_doc"], entry, self.stamp)
            self._segments.append(seg)
            tok = seg.manifest["tokenizer"]
            if (tok["fingerprint"], tok["vocab_size"]) != (
                    manifest["tokenizer"]["fingerprint"], manifest["tokenizer"]["vocab_size"]):
                raise DatastoreCorrupt(f"{seg.file}: built with another tokenizer than the "
                                       f"datastore's manifest names")
            if seg.n_docs != entry["n_docs"]:
                raise DatastoreCorrupt(f"{seg.file}: holds {seg.n_docs} documents, the "
                                       f"datastore's manifest says {entry['n_docs']}")
        self.manifest = manifest

    @classmethod
    def staged(cls, directory: Path, manifest: dict) -> Reader:
        """A Reader of a manifest not published yet (a writer reading the segments it has
        just written, under the write lock)."""
        self = cls.__new__(cls)
        self.path = self.file = str(directory / mf.MANIFEST_FILE)
        self.directory, self.layout, self.stamp = directory, "segments", ("staged",)
        self._closed = True
        self._segments = []
        self._on_close = []
        try:
            self._open_segments({**manifest, "segments": list(manifest["segments"])})
            self._closed = False
            self._load()
        except BaseException:
            self._closed = False
            self.close()
            raise
        return self

    def _sizes(self, sm: dict) -> dict[str, int]:
        n = sm["length"]
        return {"tokens": n * self._dtype.itemsize, "sa": n * 4,
                "docs": (sm["n_docs"] + 1) * 4, "bucket": (self.vocab_size + 2) * 4}

    def _load(self) -> None:
        m = self.manifest
        tok = m["tokenizer"]
        self.vocab_size = int(tok["vocab_size"])
        self.tokenizer_fingerprint = str(tok["fingerprint"])
        self.tokenizer_name = str(tok["name"])
        self.separator = int(m["separator"])
        self.version = int(m["version"])
        if m["token_dtype"] != fmt.token_dtype(self.vocab_size) or \
                self.separator != self.vocab_size:
            raise ValueError("token_dtype or separator does not fit the vocabulary")
        self._dtype = np.dtype(m["token_dtype"])
        self._be = self._dtype.newbyteorder(">")
        self.deleted = BitMap()
        self._shards: list[_Shard] = []
        self._by_corpus: dict[str, list[_Shard]] = {}
        shards: list[dict] = []
        for seg in self._segments:
            sm_all = seg.manifest
            if (sm_all["token_dtype"], int(sm_all["separator"])) != (m["token_dtype"],
                                                                     self.separator):
                raise ValueError(f"segment {seg.name}: token_dtype or separator differs")
            # Bitmaps are deserialized by C code: only ever hand it bytes whose checksum holds.
            local = BitMap.deserialize(bytes(seg.checked(
                fmt.KEY_DELETED, sm_all["checksums"]["deleted"], "deleted")))
            if seg.version < 2 and len(local):
                raise DatastoreCorrupt(
                    f"{seg.file}: format version 1 with deleted documents still inside (their "
                    f"tokens were only hidden); rebuild it with this redraft")
            if len(local) and (local.max() >= seg.n_docs):
                raise DatastoreCorrupt(f"{seg.file}: deleted ids past its documents")
            self.deleted |= local.shift(seg.first_doc)
            next_doc = 0
            for n, sm in enumerate(sm_all["shards"]):
                for field in ("id", "length", "n_docs", "first_doc", "n_tokens"):
                    sm[field] = int(sm[field])
                if sm["id"] != n or sm["first_doc"] != next_doc or sm["length"] < 0 \
                        or sm["n_docs"] < 0:
                    raise ValueError(f"{seg.name} shard {n}: ids or document ranges out of "
                                     "sequence")
                next_doc += sm["n_docs"]
                sizes = self._sizes(sm)
                where = {w: seg.where(fmt.shard_key(n, w), sizes[w]) for w in fmt.SHARD_ARRAYS}
                arrays = {w: seg.lm.view[o:o + k] for w, (o, k) in where.items()}
                meta = {**sm, "id": len(shards), "first_doc": seg.first_doc + sm["first_doc"],
                        "segment": seg.name}
                shards.append(meta)
                sh = _Shard(meta, arrays, self._dtype, seg.lm.mm, where["tokens"][0], seg, n)
                self._shards.append(sh)
                self._by_corpus.setdefault(sh.corpus, []).append(sh)
        self.manifest = {**m, "shards": shards, "n_shards": len(shards)}

    # ---- properties ---------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return int(self.manifest["n_tokens"])

    @property
    def n_docs(self) -> int:
        return int(self.manifest["n_docs"])

    @property
    def corpora(self) -> dict[str, dict]:
        return {k: {"n_docs": v["n_docs"], "n_tokens": v["n_tokens"]}
                for k, v in self.manifest["corpora"].items()}

    @property
    def n_docs_total(self) -> int:
        """Document ids run from 0 to this (deleted ones included)."""
        return sum(s.n_docs for s in self._segments)

    @property
    def segments(self) -> list[str]:
        """File names of the snapshot's segments, in document order."""
        return [s.name for s in self._segments]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def token_width(self) -> int:
        """Bytes per stored token id (2 or 4)."""
        return self._dtype.itemsize

    def shard_arrays(self) -> list[ShardArrays]:
        """Every shard's arrays, in shard id order. A shard of an immutable segment file has a
        key that names it in any snapshot (so a reader of the next commit can reuse what was
        derived from it); the arrays keep the map alive after close() while referenced."""
        if self._closed:
            raise DatastoreError(f"{self.path}: reader is closed; open a new Reader")
        return [ShardArrays(sh.tokens, sh.sa, sh.bucket, sh.length,
                            f"{sh.segment.name}:{sh.segment.crc:08x}:{sh.local}"
                            if mf.is_segment_name(sh.segment.name) else "")
                for sh in self._shards]

    def shard_ids(self, corpora=None) -> list[int]:
        """Ids of the shards a lookup restricted to `corpora` reads (None or empty: all);
        raises what such a lookup raises (unknown corpora, a closed reader)."""
        return [sh.id for sh in self._select(corpora)]

    @property
    def files_bytes(self) -> int:
        """Bytes on disk of the snapshot: its segments and its manifest."""
        total = sum(s.lm.size for s in self._segments)
        if self.layout == "segments":
            total += int(self.stamp[3])
        return total

    def check_maps(self) -> None:
        """DatastoreCorrupt if a read of this snapshot met a segment truncated after it was
        mapped (that read, and every later one there, saw zeros: lmdbfile); a counter
        compare while no map in the process ever was, so it runs after every lookup."""
        seen = faults()
        if seen == self._faults_seen:
            return
        for seg in self._segments:
            if seg.lm.truncated:
                raise DatastoreCorrupt(f"{seg.file}: truncated while mapped (a file of the "
                                       f"datastore was rewritten in place); reopen it")
        self._faults_seen = seen

    def files_changed(self) -> str | None:
        """Why a segment file of this snapshot is no longer what it mapped (truncated, or
        rewritten in place: lmdbfile's `changed`), or None. One stat per segment."""
        for seg in self._segments:
            why = seg.lm.changed()
            if why is not None:
                return why
        return None

    # ---- lifecycle ----------------------------------------------------------------------
    def _release(self) -> None:
        segments, self._segments = self._segments, []
        for seg in segments:
            seg.close()

    def on_close(self, callback: Callable[[], object]) -> None:
        """Run `callback` when this reader closes (now if it is closed already): whoever keeps
        something derived from its arrays drops it then, so that the maps can go."""
        if self._closed:
            callback()
        else:
            self._on_close.append(callback)

    def close(self) -> None:
        """Release the maps. Do not call while other threads still query this Reader."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._shards = []
        self._by_corpus = {}
        self._release()
        callbacks, self._on_close = getattr(self, "_on_close", []), []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - a holder's failure must not fail close()
                pass

    def __enter__(self) -> Reader:
        if self._closed:
            raise ReaderClosed(f"{self.path}: the Reader is closed; open a new one")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Reader({self.path!r}, n_tokens={self.manifest.get('n_tokens')})"

    @_while_open
    def verify(self, only: Collection[str] | None = None, skip: Collection[str] = ()) -> None:
        """Check the LMDB structure of every segment and every array, name list and bitmap
        against their crc32 (reads the whole files). `only` / `skip`: segment file names to
        check, or to leave out (segments are immutable: one checked once stays checked)."""
        try:
            for seg in self._segments:
                if (only is not None and seg.name not in only) or (
                        seg.name in skip and mf.is_segment_name(seg.name)):
                    continue
                self._verify_segment(seg)
        except DatastoreCorrupt:
            self.check_maps()  # zeros read from a truncated file: say that instead
            raise
        self.check_maps()

    def _verify_segment(self, seg: _Segment) -> None:
        seg.lm.check()
        for sh in self._shards:
            if sh.segment is not seg:
                continue
            sm = seg.manifest["shards"][sh.local]
            sizes = self._sizes(sm)
            for what in fmt.SHARD_ARRAYS:
                buf = seg.value(fmt.shard_key(sh.local, what), sizes[what])
                if fmt.crc32(buf) != sm["crc32"][what]:
                    raise DatastoreCorrupt(
                        f"{seg.file}: checksum mismatch in shard {sh.local} {what}")
            self.shard_names(sh.id)
        for key, want in seg.manifest["checksums"].items():
            seg.checked(key.encode(), want, key)

    @_while_open
    def shard_raw(self, shard: int, what: str) -> memoryview:
        """One stored value of a shard as it is on disk (for writers that carry it over)."""
        sh = self._shards[shard]
        return sh.segment.value(fmt.shard_key(sh.local, what))

    @_while_open
    def shard_documents(self, shard: int) -> list[np.ndarray]:
        """The token ids of every document of one shard (views of the map)."""
        sh = self._shards[shard]
        starts = sh.docs.astype(np.int64)
        return [sh.tokens[a:b - 1] for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]

    @_while_open
    def shard_names(self, shard: int) -> list[str]:
        """Document names of one shard, checked: crc32 (version 2), zlib's adler32, count."""
        sh = self._shards[shard]
        seg, n = sh.segment, sh.local
        sm = seg.manifest["shards"][n]
        want = sm["crc32"]["names"] if seg.version >= 2 else None
        raw = seg.checked(fmt.shard_key(n, "names"), want, f"shard {n} names")
        try:
            names = zlib.decompress(raw).decode("utf-8", "surrogateescape").split("\n")
        except zlib.error as exc:
            raise DatastoreCorrupt(f"{seg.file}: shard {n} names are damaged") from exc
        if len(names) != sm["n_docs"]:
            raise DatastoreCorrupt(f"{seg.file}: shard {n} has {len(names)} names for "
                                   f"{sm['n_docs']} documents")
        return names

    @_while_open
    def check_tokenizer(self, fingerprint) -> None:
        """Raise TokenizerMismatch unless `fingerprint` (or a tokenizer's) is the datastore's."""
        if not isinstance(fingerprint, str):
            fingerprint = tokenizer_fingerprint(fingerprint)
        if fingerprint != self.tokenizer_fingerprint:
            raise TokenizerMismatch(
                f"tokenizer fingerprint {fingerprint} does not match the datastore's "
                f"{self.tokenizer_fingerprint} (built with {self.tokenizer_name})")

    # ---- helpers ------------------------------------------------------------------------
    def _select(self, corpora) -> list[_Shard]:
        if corpora is None:
            return self._shards
        names = [corpora] if isinstance(corpora, str) else list(corpora)
        if not names:
            return self._shards
        unknown = [n for n in names if n not in self.manifest["corpora"]]
        if unknown:
            known = ", ".join(sorted(self.manifest["corpora"])) or "none"
            raise InvalidQuery(f"unknown corpora {unknown} (this datastore has: {known})")
        out: list[_Shard] = []
        for n in dict.fromkeys(names):
            out.extend(self._by_corpus.get(n, ()))
        return out

    def _ids(self, tokens, what: str = "tokens") -> np.ndarray:
        """Validate token ids: integers in [0, vocab_size)."""
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidQuery(f"{what}: not a sequence of token ids") from exc
        if arr.ndim != 1:
            raise InvalidQuery(f"{what}: expected a flat sequence of token ids")
        if arr.size == 0:
            return arr.astype(np.int64)
        if arr.dtype == object:  # ints too wide for int64 or uint64, or not ints at all
            vals = arr.tolist()
            if all(isinstance(t, int) and not isinstance(t, bool) for t in vals):
                bad = next(t for t in vals if not 0 <= t < self.vocab_size)
                raise InvalidQuery(self._out_of_range(what, bad))
        if arr.dtype.kind not in "iu":
            raise InvalidQuery(f"{what}: token ids must be integers")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            raise InvalidQuery(self._out_of_range(what, lo if lo < 0 else hi))
        return arr.astype(np.int64, copy=False)

    def _out_of_range(self, what: str, bad: int) -> str:
        return f"{what}: token id {bad} is out of range (the vocabulary is [0, {self.vocab_size}))"

    @_while_open
    def check_ids(self, tokens: Sequence[int], what: str = "tokens") -> None:
        """InvalidQuery unless every id is an integer in [0, vocab_size)."""
        self._ids(tokens, what)

    def _pattern(self, tokens) -> tuple[np.ndarray, bytes]:
        arr = self._ids(tokens)
        if arr.size == 0:
            raise InvalidQuery("empty pattern")
        return arr, arr.astype(self._be).tobytes()

    def _ranges(self, key: bytes, t0: int, shards: list[_Shard]) -> list[tuple[_Shard, int, int]]:
        out = []
        for sh in shards:
            i, hi, found = sh.lower(key, t0)
            if found:
                out.append((sh, i, sh.upper(key, i, hi)))
        return out

    # ---- verbs --------------------------------------------------------------------------
    @_guarded
    def count(self, tokens: Sequence[int], corpora=None) -> int:
        """Occurrences of `tokens` in the documents of the selected corpora."""
        arr, key = self._pattern(tokens)
        return sum(j - i for _, i, j in self._ranges(key, int(arr[0]), self._select(corpora)))

    @_guarded
    def find(self, tokens: Sequence[int], limit: int = 100,
             corpora=None) -> list[tuple[int, int]]:
        """Up to `limit` occurrences as (doc_id, offset_in_doc), in document order."""
        arr, key = self._pattern(tokens)
        docs, offs = [], []
        for sh, i, j in self._ranges(key, int(arr[0]), self._select(corpora)):
            pos = sh.sa[i:j].astype(np.int64)
            local = np.searchsorted(sh.docs, pos, side="right") - 1
            docs.append(local + sh.first_doc)
            offs.append(pos - sh.docs[local].astype(np.int64))
        if not docs:
            return []
        d, o = np.concatenate(docs), np.concatenate(offs)
        order = np.lexsort((o, d))[:max(0, int(limit))]
        return list(zip(d[order].tolist(), o[order].tolist()))

    @_guarded
    def next_token_counts(self, tokens: Sequence[int], corpora=None) -> dict[int, int]:
        """How often each token follows `tokens` (document ends are not counted)."""
        arr, key = self._pattern(tokens)
        n = len(arr)
        acc: dict[int, int] = {}
        for sh, i, j in self._ranges(key, int(arr[0]), self._select(corpora)):
            after = np.minimum(sh.sa[i:j].astype(np.int64) + n, sh.length - 1)
            nxt = sh.tokens[after].astype(np.int64)
            _check_ids(sh, nxt, self.vocab_size)
            vals, cnt = np.unique(nxt[nxt != self.separator], return_counts=True)
            for v, c in zip(vals.tolist(), cnt.tolist()):
                acc[v] = acc.get(v, 0) + c
        return acc

    @_while_open
    def doc_name(self, doc_id: int) -> str:
        """The source (file or file:line) a document came from (deleted ones included)."""
        for sh in self._shards:
            if sh.first_doc <= doc_id < sh.first_doc + sh.n_docs:
                return self.shard_names(sh.id)[doc_id - sh.first_doc]
        raise InvalidQuery(f"document id {doc_id} out of range [0, {self.n_docs_total})")

    @_while_open
    def documents(self, corpus: str, newest_first: bool = False
                  ) -> Iterator[tuple[int, str, list[int]]]:
        """(doc_id, name, token ids) of every live document of `corpus`, in id order or
        newest first (e.g. to reload only the most recent ones)."""
        shards = self._select([corpus])
        for sh in reversed(shards) if newest_first else shards:
            names = self.shard_names(sh.id)
            local = range(sh.n_docs - 1, -1, -1) if newest_first else range(sh.n_docs)
            for i in local:
                if sh.first_doc + i in self.deleted:
                    continue
                start, end = int(sh.docs[i]), int(sh.docs[i + 1]) - 1  # minus the separator
                tokens = sh.tokens[start:end]
                _check_ids(sh, tokens, self.vocab_size, False)  # e.g. learned outputs reloaded
                yield sh.first_doc + i, names[i], tokens.tolist()

    def _longest(self, arr: np.ndarray, key: bytes, shards: list[_Shard], min_len: int
                 ) -> tuple[int, list[tuple[_Shard, int, int]]]:
        """Longest suffix of `arr` (>= min_len) occurring in the shards, with its ranges."""
        n, w = len(arr), self._dtype.itemsize
        lo, hi = min_len - 1, n
        best: list = []
        step = 1  # probe lo+1, lo+2, lo+4, ... while found, then bisect what is left
        while lo < hi:
            mid = min(lo + step, hi) if step else (lo + hi + 1) // 2
            k = key[(n - mid) * w:]
            t0 = int(arr[n - mid])
            hits = []
            for sh in shards:
                i, bhi, found = sh.lower(k, t0)
                if found:
                    hits.append((sh, i, bhi))
            if hits:
                lo, best = mid, hits
                step *= 2
            else:
                hi = mid - 1
                step = 0
        if lo < max(min_len, 1):
            return 0, []
        k = key[(n - lo) * w:]
        return lo, [(sh, i, sh.upper(k, i, bhi)) for sh, i, bhi in best]

    @_guarded
    def longest_match(self, context: Sequence[int], max_len: int = 16, min_len: int = 1,
                      corpora=None) -> int:
        """Length of the longest suffix of `context` (at most max_len) found; 0 if < min_len."""
        if max_len < 1 or min_len < 1:
            raise InvalidQuery("max_len and min_len must be at least 1")
        arr = self._ids(context[-max_len:] if len(context) > max_len else context, "context")
        if len(arr) < min_len:
            return 0
        return self._longest(arr, arr.astype(self._be).tobytes(), self._select(corpora),
                             min_len)[0]

    @_guarded
    def suffixes(self, context: Sequence[int], max_len: int = 16, corpora=None) -> SuffixQuery:
        """The last `max_len` tokens of `context` (ids checked) against the selected corpora,
        for several lookups of its suffixes (the retrieval tree's)."""
        tail = context[-max_len:] if len(context) > max_len else context
        arr = self._ids(tail, "context")
        return SuffixQuery(self, arr, self._select(corpora))

    def _sample(self, L: int, ranges, k_max: int, depth: int) -> np.ndarray | None:
        """Next `depth` tokens after up to k_max occurrences spread evenly over the ranges."""
        segs = [(sh, j - i, i) for sh, i, j in ranges if j > i]  # (shard, count, SA start)
        total = sum(s[1] for s in segs)
        if total == 0:
            return None
        k = min(total, k_max)
        g = (np.arange(k, dtype=np.int64) * total) // k
        offs = (L + np.arange(depth, dtype=np.int64))[:, None]
        cols = []
        off = 0
        for sh, cnt, start in segs:
            if len(segs) == 1:
                local = g
            else:
                local = g[(g >= off) & (g < off + cnt)] - off
                off += cnt
                if not len(local):
                    continue
            p = sh.sa[start + local]
            idx = offs + p  # int64 (uint32 positions widen here)
            np.minimum(idx, sh.length - 1, out=idx)
            col = sh.tokens[idx]
            _check_ids(sh, col, self.vocab_size)
            cols.append(col)
        return (cols[0] if len(cols) == 1 else np.concatenate(cols, axis=1)).astype(np.int64)


def _check_ids(sh: _Shard, tokens: np.ndarray, vocab: int, separators: bool = True) -> None:
    """DatastoreCorrupt if tokens read from a shard hold an id past the vocabulary (and the
    separator, where `separators` may be read: damaged token arrays of a Reader opened
    without verifying): no such id is ever drafted, counted or returned. The compiled core
    refuses the same columns."""
    if tokens.size and int(tokens.max()) >= vocab + separators:
        raise DatastoreCorrupt(
            f"{sh.segment.file}: damaged token arrays (id {int(tokens.max())} in shard "
            f"{sh.local}, past the vocabulary [0, {vocab})); verify it with "
            f"`redraft stats`")


class ShardArrays(NamedTuple):
    """One shard's arrays as stored, for code that searches them itself (the compiled
    drafting core): views of the map, valid while they are referenced."""

    tokens: np.ndarray  # token ids, big-endian, Reader.token_width bytes each
    sa: np.ndarray  # the suffix array: little-endian uint32 positions into tokens
    bucket: np.ndarray  # suffixes starting with token t are sa[bucket[t]:bucket[t + 1]]
    length: int  # tokens, separators included
    key: str  # the same shard in every snapshot that has it ("": only this snapshot's)


class Match(NamedTuple):
    """Where one suffix of a context occurs: its length and its suffix-array ranges (one
    per shard that holds it; length 0: nowhere)."""

    length: int
    ranges: list

    @property
    def count(self) -> int:
        """Occurrences of the suffix."""
        return sum(j - i for _, i, j in self.ranges)


class SuffixQuery:
    """A context validated once against a Reader's shards; `Reader.suffixes` makes one."""

    def __init__(self, reader: Reader, arr: np.ndarray, shards: list[_Shard]) -> None:
        self.reader = reader
        self.file = reader.file
        self.separator = reader.separator
        self._arr = arr
        self._key = arr.astype(reader._be).tobytes()
        self._shards = shards

    def __len__(self) -> int:
        return len(self._arr)

    @_guarded
    def longest(self, min_len: int) -> Match:
        """The longest suffix of at least `min_len` tokens that occurs (length 0: none)."""
        return Match(*self.reader._longest(self._arr, self._key, self._shards, min_len))

    @_guarded
    def occurrences(self, length: int) -> Match:
        """Where the suffix of `length` tokens occurs."""
        n, w = len(self._arr), self.reader._dtype.itemsize
        return Match(length, self.reader._ranges(self._key[(n - length) * w:],
                                                 int(self._arr[n - length]), self._shards))

    @_guarded
    def continuations(self, match: Match, limit: int, depth: int) -> np.ndarray | None:
        """The `depth` tokens after up to `limit` of the match's occurrences, spread evenly
        over them, as the columns of a [depth, k] array (None: no occurrence)."""
        return self.reader._sample(match.length, match.ranges, limit, depth)


def _legacy_manifest(seg: _Segment) -> dict:
    """A single-file datastore (format 2 and before) as the manifest of one segment."""
    inner = seg.manifest
    m = mf.new(tokenizer=inner["tokenizer"], build=copy.deepcopy(inner.get("build") or {}))
    m.update(version=int(inner["version"]), generation=0, legacy=True)
    m["segments"] = [mf.segment_entry(seg.name, seg.lm.size, inner, seg.crc, "corpus")]
    mf.retotal(m)
    m["n_deleted"] = int(inner.get("n_deleted", 0))
    return m
