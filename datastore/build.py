"""Building, appending to and deleting from a datastore, and persisting learned outputs.

Pipeline: documents -> batched tokenization with the target model's fast tokenizer (its
Rust backend encodes a batch on every core) -> shards of bounded size (token array with a
separator after each document, suffix array from pydivsufsort, document offsets, first-token
buckets) -> segment files (segment.py) -> one commit (commit.py).

A build writes new segments and publishes a manifest naming only them (the old files are
removed after); an append writes segments for the new documents only, so its cost follows
what is added, not the datastore; a delete rewrites only the segments holding the deleted
documents, re-sorting their shards without those tokens, so a deleted document leaves
nothing a lookup could find (or a file could leak) and every other id stays.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import lmdb
import numpy as np
from pyroaring import BitMap
from redraft.datastore import commit
from redraft.datastore import format as fmt
from redraft.datastore import manifest as mf
from redraft.datastore.commit import (
    DEFAULT_WAIT_S,
    CommitConflict,
    Transaction,
    remove_leftovers,
    write_error,
    write_lock,
)
from redraft.datastore.corpus import Document, expand_inputs, iter_documents
from redraft.datastore.manifest import LEARNED_CORPUS
from redraft.datastore.reader import Reader
from redraft.datastore.segment import SegmentSeries
from redraft.proto.errors import (
    CorpusError,
    DatastoreError,
    InvalidQuery,
    TokenizerMismatch,
)
from redraft.proto.models import DEFAULT_MODEL, load_tokenizer, tokenizer_fingerprint
from redraft.proto.models import vocab_size as tokenizer_vocab_size
from tqdm import tqdm

# One shard's suffix-array build peaks near 20-26 bytes per token: 128 Mi tokens ~ 3.3 GB.
DEFAULT_SHARD_TOKENS = 128 * 1024 * 1024
# A build starts a new segment file past this many tokens: a delete rewrites one of them.
DEFAULT_SEGMENT_TOKENS = 2 * DEFAULT_SHARD_TOKENS
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


# ---- shards ----------------------------------------------------------------------------
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


def _write_shards(writer: SegmentSeries, docs: Iterable[tuple[str, np.ndarray]], corpus: str,
                  shard_tokens: int) -> tuple[int, int]:
    """Group documents into shards of at most `shard_tokens` tokens and write them."""
    vocab = writer.vocab
    # a shard never spans two segment files
    limit = max(1, min(int(shard_tokens), writer.segment_tokens, fmt.MAX_SHARD_LEN))
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


# ---- publication ---------------------------------------------------------------------
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
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
    progress: bool = False,
    wait_s: float = DEFAULT_WAIT_S,
) -> dict:
    """Build a datastore at `out` (a directory) from corpus inputs; replace any old one.

    `tokenizer` is a model name (default: the embedded default model) or a loaded
    tokenizer. For pre-tokenized input pass `documents` (sequences of ids, or (name, ids)
    pairs) with `fingerprint` and `vocab_size` instead of `inputs`; ids of any width work
    (uint32 arrays when the vocabulary exceeds 65,535). A new segment file starts once one
    holds `segment_tokens` tokens. `wait_s`: how long to wait for another writer. Returns
    the manifest.
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
    bar = None
    skipped: list[str] = []
    try:
        with write_lock(out_p, wait_s):
            generation, keep = _previous_commit(out_p)
            remove_leftovers(out_p, keep)
            manifest = mf.new(tokenizer={"name": name, "fingerprint": fp, "vocab_size": vocab},
                              build={"shard_tokens": int(shard_tokens), "field": field,
                                     "history": []}, generation=generation)
            tx = Transaction(out_p, None, manifest, progress=progress)
            stream, bar = _token_stream(inputs, documents, tok, field=field, exclude=exclude,
                                        skip_bad=skip_bad, progress=progress, skipped=skipped)
            t0 = time.perf_counter()
            try:
                series = SegmentSeries(lambda: tx.writer("corpus", {"op": "build"}),
                                       segment_tokens)
                n_docs, n_tok = _write_shards(series, stream, corpus, shard_tokens)
                manifest["segments"] = series.finish()
                manifest["build"]["history"].append(
                    _event("build", corpus, n_docs, n_tok, t0, len(skipped)))
                result = tx.publish()  # unmerged: a build sizes its segments on purpose
            except BaseException as exc:
                tx.abort()
                if isinstance(exc, (OSError, lmdb.Error)):
                    raise write_error(out_p, exc) from exc
                raise
            remove_leftovers(out_p, {s["file"] for s in result["segments"]})
            return result
    except BaseException:
        if created:
            _remove_if_empty(out_p)
        raise
    finally:
        if bar is not None:
            bar.close()


def _previous_commit(out: Path) -> tuple[int, set[str] | None]:
    """(generation of the commit a build replaces, segment files it names). A damaged or
    missing manifest is no obstacle to a rebuild: its generation is guessed from the file
    names present (names stay unique either way), and which files it names is unknown."""
    try:
        m, _ = mf.read(out)
        return int(m["generation"]), {s["file"] for s in m["segments"]}
    except FileNotFoundError:
        keep: set[str] | None = set()  # no commit, or a legacy one: no segment is named
    except (DatastoreError, OSError):
        keep = None
    gens = [0]
    with contextlib.suppress(OSError):
        gens += [int(n.split("-")[1]) for n in os.listdir(out) if mf.is_segment_name(n)]
    return max(gens), keep


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


def _directory(path: str | os.PathLike) -> Path:
    """The directory of the existing datastore at `path`."""
    out, _ = mf.locate(path)
    if not out.is_dir():
        raise DatastoreError(f"{out}: writers need the datastore's directory, not a file")
    return out


def _check_fingerprint(manifest: dict, fp: str | None) -> None:
    want = manifest["tokenizer"]["fingerprint"]
    if fp != want:
        raise TokenizerMismatch(
            f"tokenizer fingerprint {fp} does not match the datastore's {want} "
            f"(built with {manifest['tokenizer']['name']})")


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
    segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
    progress: bool = False,
    wait_s: float = DEFAULT_WAIT_S,
) -> dict:
    """Add documents to an existing datastore as new segments; no existing segment is
    read or rewritten (small segments may be merged afterwards, see tiers.py).

    The tokenizer defaults to the one the datastore was built with and must match its
    fingerprint (TokenizerMismatch otherwise). Returns the new manifest.
    """
    _check_corpus_name(corpus)
    out = _directory(path)
    with Reader(out) as r:
        manifest = r.manifest
    if documents is None:
        expand_inputs(inputs or [], exclude)
        tok, _, fp, _ = _tokenizer_info(tokenizer or manifest["tokenizer"]["name"])
    else:
        tok, fp = None, fingerprint
    _check_fingerprint(manifest, fp)
    bar = None
    skipped: list[str] = []

    def change(tx: Transaction) -> bool:
        nonlocal bar
        m = tx.manifest
        _check_fingerprint(m, fp)  # again, under the lock
        tokens = shard_tokens or m["build"].get("shard_tokens", DEFAULT_SHARD_TOKENS)
        stream, bar = _token_stream(inputs, documents, tok, field=field, exclude=exclude,
                                    skip_bad=skip_bad, progress=progress, skipped=skipped)
        t0 = time.perf_counter()
        series = SegmentSeries(lambda: tx.writer("corpus", {"op": "append"}), segment_tokens)
        try:
            n_docs, n_tok = _write_shards(series, stream, corpus, tokens)
            m["segments"].extend(series.finish())
        except BaseException:
            series.abort()
            raise
        m["build"].setdefault("history", []).append(
            _event("append", corpus, n_docs, n_tok, t0, len(skipped)))
        return True

    try:
        return commit.run(out, change, wait_s=wait_s, progress=progress)
    finally:
        if bar is not None:
            bar.close()


def delete_documents(path: str | os.PathLike, doc_ids: Iterable[int], *,
                     wait_s: float = DEFAULT_WAIT_S) -> dict:
    """Delete documents by global id: their tokens are removed from the datastore (the
    segments holding them are rewritten, their shards re-sorted), so no lookup can see them
    again; the other documents keep their ids. Returns the manifest.

    Already deleted ids are accepted (deleting is idempotent: nothing is rewritten when
    every id was deleted before); ids that never existed are an InvalidQuery.
    """
    ids = sorted({int(i) for i in doc_ids})
    if not ids:
        raise InvalidQuery("no document ids to delete")
    out = _directory(path)

    def change(tx: Transaction) -> bool:
        r = tx.reader
        total = r.n_docs_total
        bad = [i for i in ids if not 0 <= i < total]
        if bad:
            raise InvalidQuery(f"document id {bad[0]} out of range [0, {total})")
        gone = BitMap(ids) - r.deleted
        if not gone:
            return False
        t0 = time.perf_counter()
        segments = tx.manifest["segments"]
        for index in reversed(range(len(segments))):
            seg = segments[index]
            lo, hi = seg["first_doc"], seg["first_doc"] + seg["n_docs"]
            here = [g for g in gone if lo <= g < hi]
            if not here:
                continue
            tx.verify([seg["file"]])
            w = tx.writer(seg["kind"], {"op": "delete"})
            for sh in tx.segment_shards(seg["file"]):
                mine = [g for g in here if sh["first_doc"] <= g < sh["first_doc"] + sh["n_docs"]]
                if mine:
                    w.rewrite_shards(r, [sh], mine)
                else:
                    w.carry_shard(r, sh)
            tx.replace(index, [w.finish()])
        tx.manifest["build"].setdefault("history", []).append(
            _event("delete", None, len(gone), 0, t0))
        return True

    return commit.run(out, change, wait_s=wait_s)


def persist_learned(path: str | os.PathLike, documents: Sequence[tuple[str, Sequence[int]]],
                    marks: dict, *, fingerprint: str, wait_s: float = DEFAULT_WAIT_S,
                    expect: dict | None = None) -> dict:
    """Append learned outputs as one segment of corpus `learned` AND record `marks` as the
    manifest's "learned" entry, in one commit: both or neither become visible, whatever
    happens to the process. Returns the new manifest.

    `documents`: (name, token ids) pairs (empty ones are left out; none at all commits only
    the marks). `marks`: any JSON-able dict, opaque here (the draft service keeps its
    exactly-once watermarks in it); it replaces the previous marks. `expect`: when given,
    the commit happens only if the current marks equal it, else CommitConflict and nothing
    written (a compare-and-swap: read `learned_marks`, decide, persist with expect=them).
    `wait_s`: how long to wait for another writer (DatastoreError after that).
    """
    out = _directory(path)
    try:
        marks_copy = json.loads(json.dumps(marks, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidQuery(f"learned marks are not JSON-able: {exc}") from exc
    if not isinstance(marks_copy, dict):
        raise InvalidQuery("learned marks must be a dict")
    docs = []
    for name, ids in documents:
        if not isinstance(name, str):
            raise InvalidQuery(f"learned output name {name!r} is not a string")
        arr = next(_pretokenized([(name, ids)]))[1]
        if len(arr):
            docs.append((name, arr))

    def change(tx: Transaction) -> bool:
        m = tx.manifest
        _check_fingerprint(m, fingerprint)
        if expect is not None and m.get("learned", {}) != expect:
            raise CommitConflict(f"{out}: the learned marks changed since they were read "
                                 f"(generation {m['generation']}); read them again")
        t0 = time.perf_counter()
        if docs:
            tokens = m["build"].get("shard_tokens") or DEFAULT_SHARD_TOKENS
            series = SegmentSeries(lambda: tx.writer("learned", {"op": "learned"}),
                                   DEFAULT_SEGMENT_TOKENS)
            try:
                _write_shards(series, iter(docs), LEARNED_CORPUS, tokens)
                m["segments"].extend(series.finish())
            except BaseException:
                series.abort()
                raise
        m["learned"] = marks_copy
        m["build"].setdefault("history", []).append(
            _event("learned", LEARNED_CORPUS, len(docs), sum(len(a) for _, a in docs), t0))
        return True

    return commit.run(out, change, wait_s=wait_s)


def learned_marks(path: str | os.PathLike) -> dict:
    """The "learned" marks of the commit published now ({} for none, or a legacy
    datastore). Checked like any read of the manifest (DatastoreCorrupt if damaged)."""
    out, layout = mf.locate(path)
    if layout != "segments":
        return {}
    try:
        m, _ = mf.read(out)
    except FileNotFoundError:
        return {}  # converted back? (never by redraft): no marks either way
    return dict(m.get("learned") or {})
