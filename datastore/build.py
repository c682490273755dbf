"""Building, appending to and deleting from a datastore.

Pipeline: documents -> batched tokenization with the target model's fast tokenizer (its
Rust backend encodes a batch on every core) -> shards of bounded size (token array with a
separator after each document, suffix array from pydivsufsort, document offsets, first-token
buckets) -> one LMDB file.

Every change is atomic. A whole new file is written beside the datastore's
`datastore.lmdb` (`.datastore.lmdb.tmp-PID`) and renamed over it only when complete and
synced, so a writer killed or failing at any point leaves the previous datastore as it was
and nothing half-written that opens. The published file is never modified in place, which
is what lets readers map it without locks and keep their snapshot while it is replaced.

Append and delete start from the current datastore, verified first (a damaged one is
refused rather than copied), and copy its shards value by value through the bounds-checked
reader: LMDB only ever opens files this module creates. Append copies every shard as it is;
delete re-sorts the shards that hold the deleted documents without their tokens, so a
deleted document leaves nothing a lookup could find (or the file could leak).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import lmdb
import numpy as np
from pydivsufsort import divsufsort
from pyroaring import BitMap
from redraft.datastore import format as fmt
from redraft.datastore.corpus import Document, expand_inputs, iter_documents
from redraft.datastore.reader import Reader
from redraft.proto.errors import (
    CorpusError,
    DatastoreCorrupt,
    DatastoreError,
    InvalidQuery,
    TokenizerMismatch,
)
from redraft.proto.files import write_atomically
from redraft.proto.models import DEFAULT_MODEL, load_tokenizer, tokenizer_fingerprint
from redraft.proto.models import vocab_size as tokenizer_vocab_size
from tqdm import tqdm

# One shard's suffix-array build peaks near 20-26 bytes per token: 128 Mi tokens ~ 3.3 GB.
DEFAULT_SHARD_TOKENS = 128 * 1024 * 1024
BATCH_CHARS = 2 << 20  # text per tokenizer batch: big enough to keep every core busy

TokenDocs = Iterable[Sequence[int] | np.ndarray | tuple[str, Sequence[int] | np.ndarray]]


# ---- tokenization ---------------------------------------------------------------------
def _tokenizer_info(tokenizer) -> tuple[object, str, str, int]:
    """(tokenizer object, name, fingerprint, vocab size) from a name or a loaded tokenizer."""
    if tokenizer is None or isinstance(tokenizer, str):
        name = tokenizer or DEFAULT_MODEL
        tok = load_tokenizer(name)
    else:
        tok = tokenizer
        name = str(getattr(tok, "name_or_path", "") or type(tok).__name__)
    return tok, name, tokenizer_fingerprint(tok), tokenizer_vocab_size(tok)


def _batches(docs: Iterable[Document], batch_chars: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for d in docs:
        batch.append(d)
        size += len(d.text)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenize_documents(docs: Iterable[Document], tokenizer, *, batch_chars: int = BATCH_CHARS,
                       progress=None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, token ids) per document, encoding in batches on all cores."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    for batch in _batches(docs, batch_chars):
        texts = [d.text for d in batch]
        if backend is not None:
            ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        else:
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for d, seq in zip(batch, ids):
            if progress is not None:
                progress.update(len(d.text))
            yield d.name, np.asarray(seq, dtype=np.int64)


# ---- shards ---------------------------------------------------------------------------
def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Token-order suffix array of a uint16/uint32 array, as little-endian uint32."""
    if len(tokens) > fmt.MAX_SHARD_LEN:
        raise ValueError("shard too large for uint32 offsets")
    return divsufsort(tokens).astype("<u4", copy=False)


class _StoreWriter:
    """Writes shards, bitmaps and the header into a new (temporary) LMDB file."""

    def __init__(self, file: str, manifest: dict, *, progress: bool = False) -> None:
        self.file = file
        self.manifest = manifest
        self.progress = progress
        self.env = fmt.open_writer(file, map_size=1 << 40 if sys.maxsize > 2**32 else 1 << 31)
        self.vocab = int(manifest["tokenizer"]["vocab_size"])
        self.sep = int(manifest["separator"])
        self.dtype = np.dtype(manifest["token_dtype"])
        self.be = self.dtype.newbyteorder(">")
        self.corpora: dict[str, BitMap] = {}
        self.deleted = BitMap()
        manifest["shards"] = []  # filled in order: carried, rewritten and new shards

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
        """Copy a shard of a verified datastore as it is (no re-sorting)."""
        checks = dict(shard["crc32"])
        for what in fmt.SHARD_KEYS:
            buf = reader.shard_raw(shard["id"], what)
            if what not in checks:  # version 1 kept no crc of names
                checks[what] = fmt.crc32(buf)
            self._put(fmt.shard_key(len(self.manifest["shards"]), what), buf)
        entry = {k: v for k, v in shard.items() if k not in ("offsets", "id", "first_doc")}
        self._add_entry({**entry, "crc32": checks})

    def rewrite_shard(self, reader, shard: dict, gone: Iterable[int]) -> None:
        """Rewrite a shard with the tokens of documents `gone` (global ids) removed; their
        ids stay, as empty documents, so that no other id changes."""
        docs = reader.shard_documents(shard["id"])
        for g in gone:
            docs[g - shard["first_doc"]] = docs[g - shard["first_doc"]][:0]
        self.add_shard(docs, reader.shard_names(shard["id"]), shard["corpus"])

    def finish(self) -> dict:
        """Recount, write bitmaps and the manifest, sync and close. Returns the manifest."""
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
            fmt.write_header(txn, m)
        self.env.sync(True)
        self.env.close()
        return m

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.env.close()


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


def _check_ids(name: str, ids: np.ndarray, vocab: int) -> np.ndarray:
    if ids.ndim != 1:
        raise CorpusError(f"{name}: token ids must be a flat sequence")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise CorpusError(f"{name}: token id {bad} outside the vocabulary [0, {vocab})")
    return ids


def _pretokenized(documents: TokenDocs) -> Iterator[tuple[str, np.ndarray]]:
    for i, d in enumerate(documents):
        if isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], str):
            name, ids = d
        else:
            name, ids = f"doc{i}", d
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except (TypeError, ValueError) as exc:
            raise CorpusError(f"{name}: not a sequence of token ids") from exc
        yield name, arr


def _write_shards(writer: _StoreWriter, docs: Iterable[tuple[str, np.ndarray]], corpus: str,
                  shard_tokens: int) -> tuple[int, int]:
    """Group documents into shards of at most `shard_tokens` tokens and write them."""
    vocab = writer.vocab
    limit = max(1, min(int(shard_tokens), fmt.MAX_SHARD_LEN))
    buf: list[np.ndarray] = []
    names: list[str] = []
    size = n_docs = n_tokens = 0
    for name, ids in docs:
        if not len(ids):
            continue
        _check_ids(name, ids, vocab)
        if len(ids) + 1 > fmt.MAX_SHARD_LEN:
            raise CorpusError(f"{name}: document of {len(ids):,} tokens exceeds a shard")
        if buf and size + len(ids) + 1 > limit:
            writer.add_shard(buf, names, corpus)
            buf, names, size = [], [], 0
        buf.append(ids.astype(writer.dtype))
        names.append(name)
        size += len(ids) + 1
        n_docs += 1
        n_tokens += len(ids)
    if buf:
        writer.add_shard(buf, names, corpus)
    if n_docs == 0:
        raise CorpusError("empty corpus: the inputs hold no text")
    return n_docs, n_tokens


# ---- atomic publication ---------------------------------------------------------------
def _write_error(out: Path, exc: BaseException) -> DatastoreError:
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


def _prepare_dir(out: Path) -> bool:
    """Create `out` if needed; whether it was created here."""
    if out.exists() and not out.is_dir():
        raise DatastoreError(f"{out}: exists and is not a directory")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatastoreError(
            f"{out}: cannot create the directory ({exc.strerror or exc})") from exc
    return created


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """One writer per datastore; stale temporary files of killed writers are removed."""
    try:
        fd = os.open(out / fmt.WRITE_LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise _write_error(out, exc) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise DatastoreError(f"{out}: another process is writing this datastore") from exc
        for f in out.glob(fmt.TMP_PREFIX + "*"):
            with contextlib.suppress(OSError):
                f.unlink()
        yield
    finally:
        os.close(fd)


def _run_writer(out: Path, manifest: dict, fill: Callable[[_StoreWriter], None],
                progress: bool) -> dict:
    """Write a whole new file with `fill`, then publish it; on any failure remove it."""
    writer = None
    result: dict = {}

    def write(tmp: Path) -> None:
        nonlocal writer
        writer = _StoreWriter(str(tmp), manifest, progress=progress)
        fill(writer)
        result.update(writer.finish())

    try:
        write_atomically(out / fmt.DATA_FILE, write, tmp=out / f"{fmt.TMP_PREFIX}{os.getpid()}",
                         durable=True)
        return result
    except BaseException as exc:
        failed = _write_error(out, exc) if isinstance(exc, (OSError, lmdb.Error)) else None
        if writer is not None:
            writer.abort()
        if failed is not None:
            raise failed from exc
        raise


def _progress_bar(enabled: bool, desc: str):
    if not enabled:
        return None
    # disable=None: draw only on a terminal, so logs and piped stderr stay clean.
    return tqdm(desc=desc, unit="char", unit_scale=True, disable=None, file=sys.stderr)


def _token_stream(inputs, documents, tok, *, field, exclude, skip_bad, progress, skipped):
    """(name, ids) of every document; `skipped` collects what --skip-bad left out."""
    if documents is not None:
        return _pretokenized(documents), None
    bar = _progress_bar(progress, "tokenizing")

    def skip(msg: str) -> None:
        skipped.append(msg)
        print(f"skipped: {msg}", file=sys.stderr)

    docs = iter_documents(inputs, field=field, exclude=exclude, skip_bad=skip_bad, on_skip=skip)
    return tokenize_documents(docs, tok, progress=bar), bar


def _check_corpus_name(corpus: str) -> str:
    if not corpus or len(corpus) > 200 or any(c in corpus for c in "\n\r\0"):
        raise CorpusError(f"bad corpus name {corpus!r}")
    try:
        corpus.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CorpusError(f"bad corpus name {corpus!r}: not valid UTF-8") from exc
    return corpus


def build_datastore(
    inputs: Sequence[str | os.PathLike] | None,
    out: str | os.PathLike,
    *,
    tokenizer=None,
    documents: TokenDocs | None = None,
    fingerprint: str | None = None,
    vocab_size: int | None = None,
    corpus: str = "default",
    field: str | None = None,
    exclude: Sequence[str] = (),
    skip_bad: bool = False,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = False,
) -> dict:
    """Build a datastore at `out` (a directory) from corpus inputs; replace any old one.

    `tokenizer` is a model name (default: the embedded default model) or a loaded
    tokenizer. For pre-tokenized input pass `documents` (sequences of ids, or (name, ids)
    pairs) with `fingerprint` and `vocab_size` instead of `inputs`; ids of any width work
    (uint32 arrays when the vocabulary exceeds 65,535). Returns the manifest.
    """
    _check_corpus_name(corpus)
    if documents is None:
        expand_inputs(inputs or [], exclude)  # fail on bad inputs before touching `out`
        tok, name, fp, vocab = _tokenizer_info(tokenizer)
    else:
        if fingerprint is None or vocab_size is None:
            raise DatastoreError("pre-tokenized documents need fingerprint and vocab_size")
        tok, fp, vocab = None, fingerprint, int(vocab_size)
        name = tokenizer if isinstance(tokenizer, str) else "pretokenized"
    try:
        fmt.token_dtype(vocab)
    except ValueError as exc:
        raise DatastoreError(str(exc)) from exc
    out_p = Path(out)
    created = _prepare_dir(out_p)
    manifest = fmt.new_manifest(
        tokenizer_name=name, fingerprint=fp, vocab_size=vocab,
        build={"shard_tokens": int(shard_tokens), "field": field,
               "history": []},
    )
    bar = None
    skipped: list[str] = []
    try:
        with _locked(out_p):
            stream, bar = _token_stream(inputs, documents, tok, field=field, exclude=exclude,
                                        skip_bad=skip_bad, progress=progress, skipped=skipped)
            t0 = time.perf_counter()

            def fill(w: _StoreWriter) -> None:
                n_docs, n_tok = _write_shards(w, stream, corpus, shard_tokens)
                manifest["build"]["history"].append(
                    _event("build", corpus, n_docs, n_tok, t0, len(skipped)))

            return _run_writer(out_p, manifest, fill, progress)
    except BaseException:
        if created:
            _remove_if_empty(out_p)
        raise
    finally:
        if bar is not None:
            bar.close()


def _event(op: str, corpus: str | None, n_docs: int, n_tokens: int, t0: float,
           skipped: int = 0) -> dict:
    event = {"op": op, "corpus": corpus, "n_docs": n_docs, "n_tokens": n_tokens,
             "seconds": round(time.perf_counter() - t0, 3),
             "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if skipped:
        event["skipped"] = skipped
    return event


def _remove_if_empty(out: Path) -> None:
    with contextlib.suppress(OSError):
        (out / fmt.WRITE_LOCK).unlink()
        out.rmdir()


def _manifest_of(path: str | os.PathLike) -> tuple[Path, dict]:
    """Directory and manifest of an existing datastore (opened, not verified)."""
    with Reader(path) as r:
        return Path(os.path.dirname(r.file)), r.manifest


def _verified(out: Path):
    """The datastore at `out`, every checksum verified: a writer carries nothing damaged
    into the file it publishes."""
    try:
        return Reader(out, verify=True)
    except DatastoreCorrupt as exc:
        raise DatastoreCorrupt(f"refusing to modify a damaged datastore: {exc}") from exc


def _carry_all(w: _StoreWriter, r, deleted: BitMap, gone: BitMap | None = None) -> None:
    """Copy every shard of `r` into `w`; shards holding documents of `gone` are rewritten
    without their tokens."""
    w.deleted = BitMap(deleted)
    for sm in r.manifest["shards"]:
        lo, hi = sm["first_doc"], sm["first_doc"] + sm["n_docs"]
        here = [g for g in gone if lo <= g < hi] if gone else []
        if here:
            w.rewrite_shard(r, sm, here)
        else:
            w.carry_shard(r, sm)


def append_corpus(
    inputs: Sequence[str | os.PathLike] | None,
    path: str | os.PathLike,
    *,
    tokenizer=None,
    documents: TokenDocs | None = None,
    fingerprint: str | None = None,
    corpus: str = "default",
    field: str | None = None,
    exclude: Sequence[str] = (),
    skip_bad: bool = False,
    shard_tokens: int | None = None,
    progress: bool = False,
) -> dict:
    """Add documents to an existing datastore as new shards; existing shards are copied
    as they are (verified first: a damaged datastore is refused).

    The tokenizer defaults to the one the datastore was built with and must match its
    fingerprint (TokenizerMismatch otherwise). Returns the new manifest.
    """
    _check_corpus_name(corpus)
    out, manifest = _manifest_of(path)
    want = manifest["tokenizer"]["fingerprint"]
    if documents is None:
        expand_inputs(inputs or [], exclude)
        tok, _, fp, _ = _tokenizer_info(tokenizer or manifest["tokenizer"]["name"])
    else:
        tok, fp = None, fingerprint
    if fp != want:
        raise TokenizerMismatch(
            f"tokenizer fingerprint {fp} does not match the datastore's {want} "
            f"(built with {manifest['tokenizer']['name']})")
    bar = None
    skipped: list[str] = []
    try:
        with _locked(out), _verified(out) as r:  # re-read under the lock
            manifest = copy.deepcopy(r.manifest)
            shard_tokens = shard_tokens or manifest["build"].get("shard_tokens",
                                                                 DEFAULT_SHARD_TOKENS)
            stream, bar = _token_stream(inputs, documents, tok, field=field, exclude=exclude,
                                        skip_bad=skip_bad, progress=progress, skipped=skipped)
            t0 = time.perf_counter()

            def fill(w: _StoreWriter) -> None:
                _carry_all(w, r, r.deleted)
                n_docs, n_tok = _write_shards(w, stream, corpus, shard_tokens)
                manifest["build"]["history"].append(
                    _event("append", corpus, n_docs, n_tok, t0, len(skipped)))

            return _run_writer(out, manifest, fill, progress)
    finally:
        if bar is not None:
            bar.close()


def delete_documents(path: str | os.PathLike, doc_ids: Iterable[int]) -> dict:
    """Delete documents by global id: their tokens are removed from the datastore (the
    shards holding them are re-sorted), so no lookup can see them again; the other
    documents keep their ids. Returns the manifest.

    Already deleted ids are accepted (deleting is idempotent: nothing is rewritten when
    every id was deleted before); ids that never existed are an InvalidQuery.
    """
    ids = sorted({int(i) for i in doc_ids})
    if not ids:
        raise InvalidQuery("no document ids to delete")
    out = Path(os.path.dirname(fmt.find_file(path)))
    with _locked(out), _verified(out) as r:
        manifest = copy.deepcopy(r.manifest)
        total = r.n_docs_total
        bad = [i for i in ids if not 0 <= i < total]
        if bad:
            raise InvalidQuery(f"document id {bad[0]} out of range [0, {total})")
        gone = BitMap(ids) - r.deleted
        if not gone:
            return manifest
        t0 = time.perf_counter()
        manifest["build"]["history"].append(_event("delete", None, len(gone), 0, t0))

        def fill(w: _StoreWriter) -> None:
            _carry_all(w, r, r.deleted | gone, gone)

        return _run_writer(out, manifest, fill, False)
