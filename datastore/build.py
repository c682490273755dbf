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
from redraft.datastore.corpus import expand_inputs, file_documents
from redraft.datastore.manifest import LEARNED_CORPUS
from redraft.datastore.reader import Reader
from redraft.datastore.segment import SegmentSeries
from redraft.datastore.sharding import (
    EMPTY_CORPUS,
    ShardCutter,
    check_ids,
    shard_limit,
    tokenize_documents,
)
from redraft.proto.errors import (
    CorpusError,
    DatastoreError,
    InvalidQuery,
    RedraftError,
    TokenizerMismatch,
)
from redraft.proto.models import DEFAULT_MODEL, load_tokenizer, tokenizer_fingerprint
from redraft.proto.models import vocab_size as tokenizer_vocab_size
from tqdm import tqdm

# One shard's suffix-array build peaks near 20-26 bytes per token: 128 Mi tokens ~ 3.3 GB.
DEFAULT_SHARD_TOKENS = 128 * 1024 * 1024
# A build starts a new segment file past this many tokens: a delete rewrites one of them.
DEFAULT_SEGMENT_TOKENS = 2 * DEFAULT_SHARD_TOKENS
DEFAULT_RAY_RETRIES = 3  # attempts after the first of a Ray task whose worker died

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


# ---- shards ----------------------------------------------------------------------------
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
    cutter = ShardCutter(shard_limit(shard_tokens, writer.segment_tokens))
    buf: list[np.ndarray] = []
    names: list[str] = []
    n_docs = n_tokens = 0
    for name, ids in docs:
        if not len(ids):
            continue
        check_ids(name, ids, vocab)
        if cutter.closes_before(name, len(ids)):
            writer.add_shard(buf, names, corpus)
            buf, names = [], []
        buf.append(ids.astype(writer.dtype))
        names.append(name)
        n_docs += 1
        n_tokens += len(ids)
    if buf:
        writer.add_shard(buf, names, corpus)
    if n_docs == 0:
        raise CorpusError(EMPTY_CORPUS)
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


def _ray_build():
    """The Ray build's module; one line naming the extra when Ray is not installed."""
    try:
        # lazy: Ray is an optional extra; the single-process build never imports it
        from redraft.datastore import ray_build
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise RedraftError("building on a Ray cluster needs Ray: "
                           "pip install 'redraft[ray]'") from None
    return ray_build


def _checked_ray(ray: bool | str | None, documents, retries: int):
    """The Ray build's module when `ray` asks for one (None otherwise), its arguments
    checked: called before anything slow, so a missing extra fails at once."""
    if ray is None or ray is False:
        return None
    if documents is not None:
        raise DatastoreError("a Ray build reads corpus inputs, not pre-tokenized documents")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise InvalidQuery(f"ray_retries: expected an integer >= 0, got {retries!r}")
    return _ray_build()


class _NewDocuments:
    """What a build or an append adds, written as new segments of a transaction: corpus
    inputs tokenized in this process, pre-tokenized documents, or corpus inputs tokenized
    and sorted by tasks on a Ray cluster (`ray`: True or the cluster's address)."""

    def __init__(self, paths: list[Path], documents: TokenDocs | None, tok, *, corpus: str,
                 field: str | None, skip_bad: bool, segment_tokens: int, progress: bool,
                 ray: bool | str | None, ray_retries: int) -> None:
        self.paths, self.documents, self.tok = paths, documents, tok
        self.corpus, self.field, self.skip_bad = corpus, field, skip_bad
        self.segment_tokens, self.progress = segment_tokens, progress
        self.ray = None if ray is False else ray
        self.ray_retries = ray_retries
        self.skipped: list[str] = []
        self._ray_build = _checked_ray(ray, documents, ray_retries)
        self._cluster = None

    @contextlib.contextmanager
    def connected(self) -> Iterator[None]:
        """Inside: connected to the Ray cluster, if any (taken before the write lock:
        starting a local cluster takes seconds)."""
        if self.ray is None:
            yield
            return
        with self._ray_build.connect(None if self.ray is True else self.ray) as cluster:
            self._cluster = cluster
            try:
                yield
            finally:
                self._cluster = None

    def _skip(self, msg: str) -> None:
        self.skipped.append(msg)
        print(f"skipped: {msg}", file=sys.stderr)

    def write(self, tx: Transaction, op: str, shard_tokens: int) -> tuple[list[dict], dict]:
        """Write the documents as new segments of `tx`: (their manifest entries, the
        history event)."""
        t0 = time.perf_counter()
        limit = shard_limit(shard_tokens, self.segment_tokens)
        if self._cluster is not None:
            entries, n_docs, n_tok, report = self._cluster.write_segments(
                tx, self.paths, self.tok, op=op, corpus=self.corpus, field=self.field,
                skip_bad=self.skip_bad, shard_limit=limit, retries=self.ray_retries,
                progress=self.progress, on_skip=self._skip)
        else:
            entries, n_docs, n_tok = self._write_here(tx, op, shard_tokens)
            report = None
        event = _event(op, self.corpus, n_docs, n_tok, t0, len(self.skipped))
        if report is not None:
            event["ray"] = report
        return entries, event

    def _write_here(self, tx: Transaction, op: str, shard_tokens: int
                    ) -> tuple[list[dict], int, int]:
        bar = None
        if self.documents is not None:
            stream = _pretokenized(self.documents)
        else:
            bar = _progress_bar(self.progress, "tokenizing")
            docs = (d for p in self.paths for d in file_documents(
                p, field=self.field, skip_bad=self.skip_bad, on_skip=self._skip))
            stream = tokenize_documents(docs, self.tok, progress=bar)
        series = SegmentSeries(lambda: tx.writer("corpus", {"op": op}), self.segment_tokens)
        try:
            n_docs, n_tok = _write_shards(series, stream, self.corpus, shard_tokens)
            return series.finish(), n_docs, n_tok
        except BaseException:
            series.abort()
            raise
        finally:
            if bar is not None:
                bar.close()


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
    ray: bool | str | None = None,
    ray_retries: int = DEFAULT_RAY_RETRIES,
) -> dict:
    """Build a datastore at `out` (a directory) from corpus inputs; replace any old one.

    `tokenizer` is a model name (default: the embedded default model) or a loaded
    tokenizer. For pre-tokenized input pass `documents` (sequences of ids, or (name, ids)
    pairs) with `fingerprint` and `vocab_size` instead of `inputs`; ids of any width work
    (uint32 arrays when the vocabulary exceeds 65,535). A new segment file starts once one
    holds `segment_tokens` tokens. `wait_s`: how long to wait for another writer.
    `ray`: tokenize and sort on a Ray cluster (True: the one `ray.init()` finds or starts;
    a string: its address), each shard a segment of its own, the same shards as this
    process would cut; `ray_retries`: how often a task whose worker died is run again.
    Returns the manifest.
    """
    _check_corpus_name(corpus)
    _checked_ray(ray, documents, ray_retries)
    paths: list[Path] = []
    if documents is None:
        paths = expand_inputs(inputs or [], exclude)  # bad inputs fail before `out` is touched
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
    new = _NewDocuments(paths, documents, tok, corpus=corpus, field=field, skip_bad=skip_bad,
                        segment_tokens=segment_tokens, progress=progress, ray=ray,
                        ray_retries=ray_retries)
    out_p = Path(out)
    created = _prepare_dir(out_p)
    try:
        with new.connected(), write_lock(out_p, wait_s):
            generation, keep = _previous_commit(out_p)
            remove_leftovers(out_p, keep)
            manifest = mf.new(tokenizer={"name": name, "fingerprint": fp, "vocab_size": vocab},
                              build={"shard_tokens": int(shard_tokens), "field": field,
                                     "history": []}, generation=generation)
            tx = Transaction(out_p, None, manifest, progress=progress)
            try:
                manifest["segments"], event = new.write(tx, "build", shard_tokens)
                manifest["build"]["history"].append(event)
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
        (out / fmt.WRITE_LOCK).unlink()  # none yet when the build failed before locking
    with contextlib.suppress(OSError):
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
    ray: bool | str | None = None,
    ray_retries: int = DEFAULT_RAY_RETRIES,
) -> dict:
    """Add documents to an existing datastore as new segments; no existing segment is
    read or rewritten (small segments may be merged afterwards, see tiers.py).

    The tokenizer defaults to the one the datastore was built with and must match its
    fingerprint (TokenizerMismatch otherwise). `ray`, `ray_retries`: as for
    `build_datastore`. Returns the new manifest.
    """
    _check_corpus_name(corpus)
    _checked_ray(ray, documents, ray_retries)
    out = _directory(path)
    with Reader(out) as r:
        manifest = r.manifest
    paths: list[Path] = []
    if documents is None:
        paths = expand_inputs(inputs or [], exclude)
        tok, _, fp, _ = _tokenizer_info(tokenizer or manifest["tokenizer"]["name"])
    else:
        tok, fp = None, fingerprint
    _check_fingerprint(manifest, fp)
    new = _NewDocuments(paths, documents, tok, corpus=corpus, field=field, skip_bad=skip_bad,
                        segment_tokens=segment_tokens, progress=progress, ray=ray,
                        ray_retries=ray_retries)

    def change(tx: Transaction) -> bool:
        m = tx.manifest
        _check_fingerprint(m, fp)  # again, under the lock
        tokens = shard_tokens or m["build"].get("shard_tokens", DEFAULT_SHARD_TOKENS)
        entries, event = new.write(tx, "append", tokens)
        m["segments"].extend(entries)
        m["build"].setdefault("history", []).append(event)
        return True

    with new.connected():
        return commit.run(out, change, wait_s=wait_s, progress=progress)


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
