"""Reading a datastore: exact suffix-array lookups and candidate trees, zero-copy.

Opening maps the LMDB file and keeps one read transaction for the Reader's lifetime; every
array is a numpy view into the map (nothing is copied into RAM, open time does not depend
on size). After opening no call mutates shared state, so one Reader serves many threads.

Lookups binary-search the suffix array with `bisect` over the raw big-endian token bytes:
each comparison is one memcmp of a slice of the map, and a per-shard table of first-token
buckets narrows the search before it starts. The longest matching suffix of a context is
found by an exponential then binary search over the suffix length (if a suffix occurs,
every shorter one does): a 16-token context costs at most 7 probes instead of 15, and about 3
when matches are short (2-4 tokens, the common case on code).
"""

from __future__ import annotations

import mmap
import os
import sys
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence

import lmdb
import numpy as np
from pyroaring import BitMap
from redraft.datastore import format as fmt
from redraft.datastore.draft import REST, Draft
from redraft.datastore.errors import (
    DatastoreCorrupt,
    DatastoreError,
    InvalidQuery,
    TokenizerMismatch,
)

_LITTLE = sys.byteorder == "little"
_MASS = 1 << 40  # total integer weight of a tree's samples: exact sums, no float ties
_CHECK_SAMPLE = 4096  # occurrences inspected first when tombstones must be filtered
_FILTER_CAP = 65536  # most occurrences materialised per shard when filtering tombstones


class _Shard:
    """Views of one shard's arrays and the search primitives over them."""

    __slots__ = ("id", "corpus", "first_doc", "n_docs", "length", "width", "tokens",
                 "tok_bytes", "src", "base", "sa", "sa_mv", "docs", "bucket", "bucket_mv",
                 "deleted")

    def __init__(self, meta: dict, arrays: dict, dtype: np.dtype,
                 deleted: np.ndarray | None, mapped: tuple | None = None) -> None:
        self.id = meta["id"]
        self.corpus = meta["corpus"]
        self.first_doc = meta["first_doc"]
        self.n_docs = meta["n_docs"]
        self.length = meta["length"]
        self.width = dtype.itemsize
        self.tok_bytes = arrays["tokens"]
        self.tokens = np.frombuffer(arrays["tokens"], dtype=dtype.newbyteorder(">"))
        self.sa = np.frombuffer(arrays["sa"], dtype="<u4")
        self.docs = np.frombuffer(arrays["docs"], dtype="<u4")
        self.bucket = np.frombuffer(arrays["bucket"], dtype="<u4")
        # memoryview indexing returns plain ints fast; numpy scalars are slower for bisect.
        self.sa_mv = arrays["sa"].cast("I") if _LITTLE else self.sa.tolist()
        self.bucket_mv = arrays["bucket"].cast("I") if _LITTLE else self.bucket.tolist()
        self.deleted = deleted  # bool per local doc, None when nothing here is deleted
        # Slicing an mmap yields bytes in one step (a memoryview needs a second, .tobytes()).
        self.src, self.base = mapped if mapped is not None else (None, 0)

    def _key(self, nb: int):
        """p -> the nb bytes of the suffix at token position p (what bisect compares)."""
        w, base = self.width, self.base
        if self.src is not None:
            src = self.src

            def k(p: int) -> bytes:
                s = base + p * w
                return src[s:s + nb]
        else:
            tb = self.tok_bytes

            def k(p: int) -> bytes:
                s = p * w
                return tb[s:s + nb].tobytes()
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

    def allowed(self, positions: np.ndarray) -> np.ndarray:
        """Mask of positions that lie in documents not deleted."""
        local = np.searchsorted(self.docs, positions, side="right") - 1
        return ~self.deleted[local]

    def any_allowed(self, i: int, j: int) -> bool:
        if self.deleted is None:
            return j > i
        n = j - i
        if n > _CHECK_SAMPLE:
            idx = i + (np.arange(_CHECK_SAMPLE, dtype=np.int64) * n) // _CHECK_SAMPLE
            if self.allowed(self.sa[idx]).any():
                return True
        return bool(self.allowed(self.sa[i:j]).any())

    def positions(self, i: int, j: int) -> np.ndarray:
        """All allowed match positions of SA range [i, j)."""
        pos = self.sa[i:j].astype(np.int64)
        if self.deleted is not None and len(pos):
            pos = pos[self.allowed(pos)]
        return pos


class Reader:
    """An open datastore. Cheap to open; use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = False) -> None:
        self.path = os.fspath(path)
        self.file, self._env_key, self._env = fmt.open_checked(path)
        self._closed = False
        try:
            self._txn = self._env.begin(buffers=True)
            self.manifest = fmt.read_manifest(self._txn, self.file)
            self._load()
            if verify:
                self.verify()
        except lmdb.Error as exc:
            self.close()
            raise DatastoreCorrupt(f"{self.file}: damaged index ({exc})") from exc
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            self.close()  # a manifest whose checksum holds but whose fields do not fit
            raise DatastoreCorrupt(f"{self.file}: inconsistent manifest ({exc!r})") from exc
        except BaseException:
            self.close()
            raise

    def _get(self, key: bytes, size: int | None = None):
        buf = self._txn.get(key)
        if buf is None:
            raise DatastoreCorrupt(f"{self.file}: missing {key.decode()}")
        if size is not None and len(buf) != size:
            raise DatastoreCorrupt(
                f"{self.file}: {key.decode()} has {len(buf)} bytes, the manifest says {size}")
        return buf

    def _map_file(self) -> None:
        """Our own read-only map of the same file the environment has open."""
        fd = os.open(self.file, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self._env_key[1:]:
                raise DatastoreError(f"{self.file}: replaced while opening; open it again")
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if st.st_size else None
            self._mv = memoryview(self._mm) if self._mm is not None else memoryview(b"")
        finally:
            os.close(fd)

    def _array(self, shard: dict, what: str, size: int):
        """A zero-copy view of one shard array: mapped at its recorded offset when it lives
        in LMDB overflow pages (checked against the page header), else read through LMDB."""
        key = fmt.shard_key(shard["id"], what)
        off = (shard.get("offsets") or {}).get(what)
        if off is None:
            return self._get(key, size)
        with self._txn.cursor() as cur:  # positioning does not touch the value's pages
            if not cur.set_key(key):
                raise DatastoreCorrupt(f"{self.file}: missing {key.decode()}")
        off = int(off)
        head = self._mv[off - fmt.PAGE_HEADER:off].tobytes() if off >= fmt.PAGE_HEADER else b""
        if off + size > len(self._mv) or not fmt.overflow_header_ok(head, off, size,
                                                                     self._psize):
            raise DatastoreCorrupt(f"{self.file}: {key.decode()} is not where the manifest says")
        return self._mv[off:off + size]

    def _load(self) -> None:
        m = self.manifest
        try:
            tok = m["tokenizer"]
            self.vocab_size = int(tok["vocab_size"])
            self.tokenizer_fingerprint = str(tok["fingerprint"])
            self.tokenizer_name = str(tok["name"])
            self.separator = int(m["separator"])
            dtype = np.dtype(m["token_dtype"])
            shards = m["shards"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DatastoreCorrupt(f"{self.file}: manifest lacks {exc}") from exc
        self._dtype = dtype
        self._be = dtype.newbyteorder(">")
        self._psize = self._env.stat()["psize"]
        self._map_file()
        self.deleted = BitMap.deserialize(bytes(self._get(fmt.KEY_DELETED)))
        gone = np.asarray(self.deleted.to_array(), dtype=np.int64)
        self._shards: list[_Shard] = []
        self._by_corpus: dict[str, list[_Shard]] = {}
        for sm in shards:
            for field in ("id", "length", "n_docs", "first_doc"):
                sm[field] = int(sm[field])
            n = sm["length"]
            sizes = {"tokens": n * dtype.itemsize, "sa": n * 4, "docs": (sm["n_docs"] + 1) * 4,
                     "bucket": (self.vocab_size + 2) * 4}
            arrays = {w: self._array(sm, w, sizes[w]) for w in fmt.SHARD_ARRAYS}
            lo = sm["first_doc"]
            mine = gone[(gone >= lo) & (gone < lo + sm["n_docs"])]
            mask = None
            if len(mine):
                mask = np.zeros(sm["n_docs"], dtype=bool)
                mask[mine - lo] = True
            off = (sm.get("offsets") or {}).get("tokens")
            mapped = (self._mm, int(off)) if off is not None and self._mm is not None else None
            sh = _Shard(sm, arrays, dtype, mask, mapped)
            self._shards.append(sh)
            self._by_corpus.setdefault(sh.corpus, []).append(sh)

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
        return sum(s.n_docs for s in self._shards)

    # ---- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Release the map. Do not call while other threads still query this Reader."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._shards = []
        self._by_corpus = {}
        txn = getattr(self, "_txn", None)
        if txn is not None:
            txn.abort()
        mv, mm = getattr(self, "_mv", None), getattr(self, "_mm", None)
        self._mv = self._mm = None
        try:
            if mv is not None:
                mv.release()
            if mm is not None:
                mm.close()
        except BufferError:
            pass  # a view still exported somewhere: the map goes when that view does
        fmt.release_env(self._env_key)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Reader({self.path!r}, n_tokens={self.manifest.get('n_tokens')})"

    def verify(self) -> None:
        """Check every array and bitmap against the manifest's crc32 (reads the whole file)."""
        w = self._dtype.itemsize
        for sm in self.manifest["shards"]:
            n = sm["length"]
            sizes = {"tokens": n * w, "sa": n * 4, "docs": (sm["n_docs"] + 1) * 4,
                     "bucket": (self.vocab_size + 2) * 4}
            for what, want in sm["crc32"].items():
                if fmt.crc32(self._array(sm, what, sizes[what])) != want:
                    raise DatastoreCorrupt(
                        f"{self.file}: checksum mismatch in shard {sm['id']} {what}")
        for key, want in self.manifest.get("checksums", {}).items():
            if fmt.crc32(self._get(key.encode())) != want:
                raise DatastoreCorrupt(f"{self.file}: checksum mismatch in {key}")

    def check_tokenizer(self, fingerprint) -> None:
        """Raise TokenizerMismatch unless `fingerprint` (or a tokenizer's) is the datastore's."""
        if not isinstance(fingerprint, str):
            from redraft.datastore.tokenizer import tokenizer_fingerprint

            fingerprint = tokenizer_fingerprint(fingerprint)
        if fingerprint != self.tokenizer_fingerprint:
            raise TokenizerMismatch(
                f"tokenizer fingerprint {fingerprint} does not match the datastore's "
                f"{self.tokenizer_fingerprint} (built with {self.tokenizer_name})")

    # ---- helpers ------------------------------------------------------------------------
    def _select(self, corpora) -> list[_Shard]:
        if self._closed:
            raise DatastoreError(f"{self.path}: reader is closed")
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
        except (TypeError, ValueError) as exc:
            raise InvalidQuery(f"{what}: not a sequence of token ids") from exc
        if arr.ndim != 1:
            raise InvalidQuery(f"{what}: expected a flat sequence of token ids")
        if arr.size == 0:
            return arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise InvalidQuery(f"{what}: token ids must be integers")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidQuery(
                f"{what}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return arr.astype(np.int64, copy=False)

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
    def count(self, tokens: Sequence[int], corpora=None) -> int:
        """Occurrences of `tokens` in live documents of the selected corpora."""
        arr, key = self._pattern(tokens)
        total = 0
        for sh, i, j in self._ranges(key, int(arr[0]), self._select(corpora)):
            total += (j - i) if sh.deleted is None else len(sh.positions(i, j))
        return total

    def find(self, tokens: Sequence[int], limit: int = 100,
             corpora=None) -> list[tuple[int, int]]:
        """Up to `limit` occurrences as (doc_id, offset_in_doc), in document order."""
        arr, key = self._pattern(tokens)
        docs, offs = [], []
        for sh, i, j in self._ranges(key, int(arr[0]), self._select(corpora)):
            pos = sh.positions(i, j)
            local = np.searchsorted(sh.docs, pos, side="right") - 1
            docs.append(local + sh.first_doc)
            offs.append(pos - sh.docs[local].astype(np.int64))
        if not docs:
            return []
        d, o = np.concatenate(docs), np.concatenate(offs)
        order = np.lexsort((o, d))[:max(0, int(limit))]
        return list(zip(d[order].tolist(), o[order].tolist()))

    def next_token_counts(self, tokens: Sequence[int], corpora=None) -> dict[int, int]:
        """How often each token follows `tokens` (document ends are not counted)."""
        arr, key = self._pattern(tokens)
        n = len(arr)
        acc: dict[int, int] = {}
        for sh, i, j in self._ranges(key, int(arr[0]), self._select(corpora)):
            nxt = sh.tokens[sh.positions(i, j) + n].astype(np.int64)
            vals, cnt = np.unique(nxt[nxt != self.separator], return_counts=True)
            for v, c in zip(vals.tolist(), cnt.tolist()):
                acc[v] = acc.get(v, 0) + c
        return acc

    def doc_name(self, doc_id: int) -> str:
        """The source (file or file:line) a document came from."""
        for sh in self._shards:
            if sh.first_doc <= doc_id < sh.first_doc + sh.n_docs:
                raw = zlib.decompress(bytes(self._get(fmt.shard_key(sh.id, "names"))))
                return raw.decode().split("\n")[doc_id - sh.first_doc]
        raise InvalidQuery(f"document id {doc_id} out of range [0, {self.n_docs_total})")

    def documents(self, corpus: str, newest_first: bool = False
                  ) -> Iterator[tuple[int, str, list[int]]]:
        """(doc_id, name, token ids) of every live document of `corpus`, in id order or
        newest first (e.g. to reload only the most recent ones)."""
        shards = self._select([corpus])
        for sh in reversed(shards) if newest_first else shards:
            raw = zlib.decompress(bytes(self._get(fmt.shard_key(sh.id, "names"))))
            names = raw.decode().split("\n")
            local = range(sh.n_docs - 1, -1, -1) if newest_first else range(sh.n_docs)
            for i in local:
                if sh.deleted is not None and sh.deleted[i]:
                    continue
                start, end = int(sh.docs[i]), int(sh.docs[i + 1]) - 1  # minus the separator
                yield sh.first_doc + i, names[i], sh.tokens[start:end].tolist()

    def _longest(self, arr: np.ndarray, key: bytes, shards: list[_Shard], min_len: int
                 ) -> tuple[int, list[tuple[_Shard, int, int]]]:
        """Longest suffix of `arr` (>= min_len) occurring in live documents, with its ranges."""
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
                if not found:
                    continue
                if sh.deleted is None:
                    hits.append((sh, i, bhi, -1))
                else:
                    j = sh.upper(k, i, bhi)
                    if sh.any_allowed(i, j):
                        hits.append((sh, i, bhi, j))
            if hits:
                lo, best = mid, hits
                step *= 2
            else:
                hi = mid - 1
                step = 0
        if lo < max(min_len, 1):
            return 0, []
        k = key[(n - lo) * w:]
        return lo, [(sh, i, j if j >= 0 else sh.upper(k, i, bhi)) for sh, i, bhi, j in best]

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

    def propose(
        self,
        context: Sequence[int],
        budget: int = 64,
        max_depth: int = 16,
        max_match_len: int = 16,
        min_match_len: int = 2,
        max_occurrences: int = 256,
        corpora=None,
        min_support: int = 4,
    ) -> Draft:
        """A candidate tree continuing `context`, scored by path probability.

        The longest suffix of the context (max_match_len down to min_match_len) that occurs
        is located; up to `max_occurrences` of its occurrences, evenly spread over its
        suffix-array range, give their next `max_depth` tokens. Those continuations form a
        trie whose node score is count(node) / count(root), i.e. the product of
        count(child) / count(parent) along the path. When the match has fewer than
        `min_support` occurrences, the continuations of the longest shorter suffix that has
        that support are mixed in with weight 1 / (n + 1) (n = the long match's count).
        The `budget` best nodes are returned, best first (so any prefix is a valid tree);
        `probs[i]` is node i's score over its parent's. Empty when nothing matches.
        """
        if budget < 0 or max_depth < 1 or max_occurrences < 1:
            raise InvalidQuery("budget must be >= 0; max_depth and max_occurrences >= 1")
        if min_match_len < 1 or max_match_len < min_match_len:
            raise InvalidQuery(
                f"need 1 <= min_match_len ({min_match_len}) <= max_match_len ({max_match_len})")
        if max_depth > 1024:
            raise InvalidQuery("max_depth must be at most 1024")
        tail = context[-max_match_len:] if len(context) > max_match_len else context
        arr = self._ids(tail, "context")
        shards = self._select(corpora)
        if budget == 0 or len(arr) < min_match_len:
            return Draft()
        key = arr.astype(self._be).tobytes()
        L, ranges = self._longest(arr, key, shards, min_match_len)
        if L == 0:
            return Draft()
        levels = [(L, ranges)]
        support = sum(j - i for _, i, j in ranges)
        if support < min_support and L > min_match_len:
            w = self._dtype.itemsize
            n = len(arr)
            for L2 in range(L - 1, min_match_len - 1, -1):
                r2 = self._ranges(key[(n - L2) * w:], int(arr[n - L2]), shards)
                if sum(j - i for _, i, j in r2) >= min_support or L2 == min_match_len:
                    levels.append((L2, r2))
                    break
        return self._tree(levels, support, budget, max_depth, max_occurrences)

    # ---- tree construction --------------------------------------------------------------
    def _sample(self, L: int, ranges, k_max: int, depth: int) -> np.ndarray | None:
        """Next `depth` tokens after up to k_max occurrences spread evenly over the ranges."""
        segs = []  # (shard, count, sa start or None, materialised positions or None)
        for sh, i, j in ranges:
            if sh.deleted is None:
                segs.append((sh, j - i, i, None))
            else:
                if j - i > _FILTER_CAP:
                    idx = i + (np.arange(_FILTER_CAP, dtype=np.int64) * (j - i)) // _FILTER_CAP
                    pos = sh.sa[idx].astype(np.int64)
                    pos = pos[sh.allowed(pos)]
                else:
                    pos = sh.positions(i, j)
                if len(pos):
                    segs.append((sh, len(pos), None, pos))
        total = sum(s[1] for s in segs)
        if total == 0:
            return None
        k = min(total, k_max)
        g = (np.arange(k, dtype=np.int64) * total) // k
        offs = (L + np.arange(depth, dtype=np.int64))[:, None]
        cols = []
        off = 0
        for sh, cnt, start, pos in segs:
            if len(segs) == 1:
                local = g
            else:
                local = g[(g >= off) & (g < off + cnt)] - off
                off += cnt
                if not len(local):
                    continue
            p = sh.sa[start + local] if pos is None else pos[local]
            idx = offs + p  # int64 (uint32 positions widen here)
            np.minimum(idx, sh.length - 1, out=idx)
            cols.append(sh.tokens[idx])
        return (cols[0] if len(cols) == 1 else np.concatenate(cols, axis=1)).astype(np.int64)

    def _tree(self, levels, support: int, budget: int, depth: int, k_max: int) -> Draft:
        """Continuation samples of each level (one column per occurrence) -> trie -> Draft."""
        parts, shares = [], []
        lam = support / (support + 1.0) if len(levels) > 1 else 1.0
        for n, (L, ranges) in enumerate(levels):
            W = self._sample(L, ranges, k_max, depth)
            if W is None:
                continue
            parts.append(W)
            shares.append(lam if n == 0 else 1.0 - lam)
        if not parts:
            return Draft()
        L = levels[0][0]
        if len(parts) == 1 and len(levels[0][1]) == 1:
            # One SA range sampled in order: columns are already lexicographically sorted.
            return _trie_draft(parts[0], None, self.separator, budget, L)
        W = np.concatenate(parts, axis=1)
        wt = np.concatenate([np.full(P.shape[1], max(1, int(_MASS * share) // P.shape[1]),
                                     np.int64) for P, share in zip(parts, shares)])
        order = np.lexsort(W[::-1])
        return _trie_draft(W[:, order], wt[order], self.separator, budget, L)


def _trie_draft(W: np.ndarray, wt: np.ndarray | None, sep: int, budget: int,
                match_len: int) -> Draft:
    """Top-`budget` trie nodes of continuations given as sorted columns of W (depth x k).

    Column i opens a new node at depth d unless it equals column i-1 on rows 0..d; a node's
    mass is the weight of the columns it spans (unit weights when `wt` is None). Cells after
    a document's end (the separator) belong to no node.
    """
    D, k = W.shape
    valid = np.logical_and.accumulate(W != sep, axis=0)
    new = valid.copy()
    if k > 1:
        new[:, 1:] &= np.logical_or.accumulate(W[:, 1:] != W[:, :-1], axis=0)
    flat = new.ravel()  # depth-major: every parent precedes its children
    starts = flat.nonzero()[0]
    if not len(starts):
        return Draft(match_len=match_len)
    # Cells between two starts belong to the first (cells no node spans are empty).
    if wt is None:
        mass = np.add.reduceat(valid.ravel(), starts, dtype=np.int64)
        root = k
    else:
        mass = np.add.reduceat((valid * wt).ravel(), starts)
        root = int(wt.sum())
    dep = starts // k
    nid = np.cumsum(flat) - 1
    parent = nid[starts - k]
    parent[dep == 0] = -1
    # Ranked by mass, then shallower first (parents precede): ascending order of
    # dep - mass * (D + 1), i.e. of -(mass * (D + 1) + D - dep) shifted by D.
    neg = dep - mass * (D + 1)
    nn = len(starts)
    if nn > budget:
        sel = np.argpartition(neg, budget - 1)[:budget]
        sel = sel[np.argsort(neg[sel], kind="stable")]
    else:
        sel = np.argsort(neg, kind="stable")
    remap = np.empty(nn + 1, dtype=np.int64)
    remap[sel] = np.arange(len(sel))
    remap[-1] = -1  # parent -1 maps to -1
    par = parent[sel]
    pmass = np.concatenate((mass, (root,)))[par]
    return Draft(
        tokens=W.ravel()[starts[sel]].tolist(),
        parents=remap[par].tolist(),
        probs=(mass[sel] / pmass).tolist(),
        sources=[REST] * len(sel),
        match_len=match_len,
    )
