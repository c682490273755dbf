"""Building on a Ray cluster (`redraft index --ray`): tokenizing and suffix sorting run as
Ray tasks on every node, each writing its files straight into the datastore directory; this
process (the driver) cuts the shards, follows the tasks and commits.

    input files, in batches  --tokenize tasks-->  token files in a work directory
    driver: the shards the single-process build cuts (sharding.ShardCutter), in document order
    --shard tasks-->  one segment file per shard  --driver-->  manifest.json (commit.py)

Why it is built this way:
- The datastore directory must be on storage every node sees, at the same path (and so must
  the inputs): tasks read and write there, nothing big travels through Ray's object store.
  A task that cannot see it fails with one line naming its node.
- Tasks receive the tokenizer object (its fast backend), not a model name: worker nodes need
  redraft and Ray installed, no model files and no tokenizer cache.
- The driver cuts shards from the documents' lengths, in document order, by the same rule as
  the single-process build, so shard arrays are byte-identical to its; a shard's task starts
  as soon as its last document is tokenized, so sorting overlaps tokenizing. Each shard is a
  segment of its own (the single-process build packs up to `segment_tokens` per file).
- Every file is written under a temporary name and renamed, so a retried task (its worker
  died) never mixes with its killed attempt; files no commit names are leftovers the write
  lock's owner removes (commit.py), the work directory among them.
- Tasks are spread over the nodes (SPREAD) and never pinned to one: a task waiting for a
  dead node's resources would wait forever.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lmdb
import numpy as np
import ray
from redraft.datastore import format as fmt
from redraft.datastore.commit import Transaction, write_error
from redraft.datastore.corpus import file_documents
from redraft.datastore.segment import SegmentWriter
from redraft.datastore.sharding import (
    BATCH_CHARS,
    EMPTY_CORPUS,
    ShardCutter,
    check_ids,
    tokenize_documents,
)
from redraft.proto.errors import CorpusError, DatastoreError, RedraftError
from redraft.proto.files import fsync_path
from tqdm import tqdm

WORK_PREFIX = f"{fmt.TMP_PREFIX}ray-"  # the build's work directory: a leftover if killed
MIN_BATCH_BYTES = 64 << 10
BATCHES_PER_CPU = 4  # enough batches that every CPU of the cluster gets several
CANCEL_WAIT_S = 10.0  # after a failure, how long to wait for cancelled tasks to end
CONNECT_TIMEOUT_S = 10.0
# A Ray head answers an HTTP/2 client preface at once; a port that accepts and stays silent
# would hold ray.init for minutes (it retries without a deadline).
ANSWER_TIMEOUT_S = 3.0
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_HOST_PORT = re.compile(r"(?:ray://)?([\w.-]+|\[[0-9a-fA-F:.]+\]):([0-9]{1,5})")


# ---- connecting -------------------------------------------------------------------------
class _DropRayReports:
    """sys.stdout, less what Ray's driver threads print there: a dead worker's report is
    several lines on stdout ("A worker died or was killed ..."), and the build reports
    failures itself, in one line."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if threading.current_thread().name.startswith("ray_"):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _ray_reports_dropped() -> Iterator[None]:
    saved = sys.stdout
    sys.stdout = _DropRayReports(saved)
    try:
        yield
    finally:
        sys.stdout = saved


def _check_reachable(address: str | None) -> None:
    """One line at once when a HOST:PORT address answers nothing: `ray.init` would retry
    for ever, printing a warning every few seconds."""
    address = address or os.environ.get("RAY_ADDRESS")
    match = _HOST_PORT.fullmatch(address or "")
    if match is None:
        return  # "auto", "local", none: Ray finds the cluster (or fails) by itself
    host, port = match.group(1).strip("[]"), int(match.group(2))
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as exc:
        raise DatastoreError(f"cannot connect to the Ray cluster at {address}: "
                             f"{exc.strerror or exc}") from None
    with sock:  # Ray's GCS and client server speak HTTP/2 (gRPC): they answer a preface
        sock.settimeout(ANSWER_TIMEOUT_S)
        try:
            sock.sendall(_HTTP2_HELLO)
            sock.recv(1)  # their SETTINGS, a TLS alert or a close: anything is an answer
        except TimeoutError:
            raise DatastoreError(
                f"cannot connect to the Ray cluster at {address}: it accepts connections but "
                f"answered nothing within {ANSWER_TIMEOUT_S:g} s (is it a Ray head's GCS "
                f"port?)") from None
        except OSError:
            pass  # reset: something answered; ray.init says what


@contextlib.contextmanager
def connect(address: str | None) -> Iterator[Cluster]:
    """Connected to the Ray cluster at `address` (None: the one `ray.init()` finds, named by
    RAY_ADDRESS or started on this machine, else a new local one) while inside; the
    connection is closed after unless this process was connected already."""
    owned = not ray.is_initialized()
    with _ray_reports_dropped():
        if owned:
            _check_reachable(address)
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            except Exception as exc:  # Ray raises ConnectionError, ValueError, RuntimeError ...
                where = f"at {address}" if address else "(local)"
                raise DatastoreError(f"cannot connect to the Ray cluster {where}: "
                                     f"{_first_line(exc)}") from None
        try:
            yield Cluster()
        finally:
            if owned:
                ray.shutdown()  # joins the threads that print Ray's reports


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# ---- tasks --------------------------------------------------------------------------------
def _node() -> str:
    return ray.get_runtime_context().get_node_id()


def _started(work: Path, kind: str, index: int) -> None:
    """Check that this node sees the work directory, and leave a mark of this attempt (how
    many attempts a task took is counted from these; its pid tells which process runs it)."""
    if not work.is_dir():
        raise DatastoreError(f"node {socket.gethostname()} cannot see {work.parent}: the "
                             "datastore directory must be on storage every node sees, at the "
                             "same path")
    (work / "attempts" / f"{kind}-{index:06d}-{_node()[:12]}-{os.getpid()}").touch()


def _save(dest: Path, write: Callable[[Path], None]) -> None:
    """Write `dest` under a temporary name, then rename: a retried attempt replaces it whole."""
    tmp = dest.with_name(f"{fmt.TMP_PREFIX}{os.getpid()}-{dest.name}")
    write(tmp)
    os.replace(tmp, dest)


def _batch_file(work: Path, batch: int, what: str) -> Path:
    return work / f"batch-{batch:06d}.{what}"


def tokenize_batch(index: int, paths: list[str], cwd: str, tokenizer, spec: dict) -> dict:
    """Ray task: tokenize the documents of these files; save their tokens (no separators),
    lengths and names to the work directory. Returns the lengths and what was skipped."""
    t0, c0 = time.perf_counter(), time.process_time()
    work = Path(spec["work"])
    _started(work, "tokenize", index)
    # one tokenizer thread per CPU Ray gave this task (the Rust backend takes every core)
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, int(cpus))))
    for p in paths:
        where = Path(p) if os.path.isabs(p) else Path(cwd) / p
        if not os.path.lexists(where):
            raise CorpusError(f"{p}: not found on node {socket.gethostname()}: the inputs must "
                              "be on storage every node sees, at the same path")
    skipped: list[str] = []
    docs = (d for p in paths for d in file_documents(
        Path(p), field=spec["field"], skip_bad=spec["skip_bad"], on_skip=skipped.append,
        cwd=cwd))
    names: list[str] = []
    arrays: list[np.ndarray] = []
    for name, ids in tokenize_documents(docs, tokenizer):
        if not len(ids):
            continue  # as in the single-process build: empty documents get no id
        check_ids(name, ids, spec["vocab"])
        if len(ids) + 1 > fmt.MAX_SHARD_LEN:
            raise CorpusError(f"{name}: document of {len(ids):,} tokens exceeds a shard")
        names.append(name)
        arrays.append(ids.astype(spec["dtype"]))
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    tokens = np.concatenate(arrays) if arrays else np.empty(0, dtype=spec["dtype"])
    _save(_batch_file(work, index, "tokens.npy"), lambda f: np.save(f, tokens))
    _save(_batch_file(work, index, "lengths.npy"), lambda f: np.save(f, lengths))
    _save(_batch_file(work, index, "names.json"), lambda f: f.write_text(json.dumps(names)))
    return {"kind": "tokenize", "index": index, "lengths": lengths, "skipped": skipped,
            "node": _node(), "cpu_s": time.process_time() - c0,
            "task_s": time.perf_counter() - t0}


def build_shard(index: int, slices: list[tuple[int, int, int]], spec: dict) -> dict:
    """Ray task: sort one shard (documents [lo, hi) of each batch in `slices`) and write it
    as a segment of its own into the datastore directory, synced. Returns its manifest
    entry (named by no commit yet)."""
    t0, c0 = time.perf_counter(), time.process_time()
    work = Path(spec["work"])
    _started(work, "shard", index)
    docs: list[np.ndarray] = []
    names: list[str] = []
    for batch, lo, hi in slices:
        tokens = np.load(_batch_file(work, batch, "tokens.npy"), mmap_mode="r")
        lengths = np.load(_batch_file(work, batch, "lengths.npy"))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        docs.extend(np.asarray(tokens[starts[i]:starts[i + 1]]) for i in range(lo, hi))
        names.extend(json.loads(_batch_file(work, batch, "names.json").read_text())[lo:hi])
    writer = SegmentWriter(work, spec["generation"], spec["tokenizer"], {"op": spec["op"]},
                           kind="corpus")
    try:
        writer.add_shard(docs, names, spec["corpus"])
        entry = writer.finish()
    except BaseException:
        writer.abort()
        raise
    final = Path(spec["out"]) / entry["file"]
    os.replace(work / entry["file"], final)
    fsync_path(final)
    return {"kind": "shard", "index": index, "entry": entry, "node": _node(),
            "cpu_s": time.process_time() - c0, "task_s": time.perf_counter() - t0}


# ---- the driver ---------------------------------------------------------------------------
def batch_files(paths: Sequence[Path], sizes: Sequence[int], batch_bytes: int
                ) -> list[tuple[list[Path], int]]:
    """Consecutive files of about `batch_bytes` together (a big file alone), with their
    bytes."""
    out: list[tuple[list[Path], int]] = []
    cur: list[Path] = []
    size = 0
    for p, n in zip(paths, sizes):
        cur.append(p)
        size += n
        if size >= batch_bytes:
            out.append((cur, size))
            cur, size = [], 0
    if cur:
        out.append((cur, size))
    return out


def batch_bytes(total: int, cpus: float) -> int:
    """Batches of at most BATCH_CHARS, small enough that every CPU gets several."""
    return int(min(BATCH_CHARS, max(MIN_BATCH_BYTES, total // max(1, BATCHES_PER_CPU * cpus))))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0  # read by its task, which reports it (or skips it with --skip-bad)


class _Bars:
    """Two progress bars in the driver, moved as tasks finish anywhere in the cluster."""

    def __init__(self, enabled: bool, total_bytes: int) -> None:
        # disable=None: draw only on a terminal, so logs and piped stderr stay clean
        off = None if enabled else True
        self.tokenized = tqdm(desc="tokenizing (ray)", total=total_bytes, unit="B",
                              unit_scale=True, disable=off, file=sys.stderr)
        self.sorted = tqdm(desc="sorting (ray)", total=None, unit="tok", unit_scale=True,
                           disable=off, file=sys.stderr)

    def close(self) -> None:
        self.tokenized.close()
        self.sorted.close()


class Cluster:
    """The connected cluster: runs a build's tasks (see the module doc)."""

    def write_segments(self, tx: Transaction, paths: Sequence[Path], tokenizer, *, op: str,
                       corpus: str, field: str | None, skip_bad: bool, shard_limit: int,
                       retries: int, progress: bool, on_skip: Callable[[str], None]
                       ) -> tuple[list[dict], int, int, dict]:
        """Tokenize `paths` and write their shards as new segments of `tx` on the cluster:
        (segment entries in document order, documents, tokens, a report of the run)."""
        out = Path(os.path.abspath(tx.out))
        work = out / f"{WORK_PREFIX}{uuid.uuid4().hex[:12]}"
        (work / "attempts").mkdir(parents=True)
        run = _Run(out, work, tx, tokenizer, op=op, corpus=corpus, field=field,
                   skip_bad=skip_bad, limit=shard_limit, retries=retries, on_skip=on_skip)
        try:
            return run.execute(paths, progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)


class _Run:
    """One build on the cluster: its tasks, the shard cutting, the bookkeeping."""

    def __init__(self, out: Path, work: Path, tx: Transaction, tokenizer, *, op: str,
                 corpus: str, field: str | None, skip_bad: bool, limit: int, retries: int,
                 on_skip: Callable[[str], None]) -> None:
        m = tx.manifest
        self.out, self.work, self.on_skip = out, work, on_skip
        self.spec = {"work": str(work), "out": str(out), "op": op, "corpus": corpus,
                     "field": field, "skip_bad": skip_bad, "dtype": m["token_dtype"],
                     "vocab": int(m["tokenizer"]["vocab_size"]),
                     "tokenizer": dict(m["tokenizer"]), "generation": tx.generation}
        # the fast backend travels (a few MB, once per node); a slow tokenizer as it is
        t0 = time.perf_counter()
        self.tokenizer = ray.put(getattr(tokenizer, "backend_tokenizer", None) or tokenizer)
        self.driver_s = {"put": time.perf_counter() - t0, "plan": 0.0}
        options = {"num_cpus": 1, "scheduling_strategy": "SPREAD", "max_retries": retries}
        self.tokenize = ray.remote(tokenize_batch).options(name="redraft-tokenize", **options)
        self.shard = ray.remote(build_shard).options(name="redraft-shard", **options)
        self.cutter = ShardCutter(limit)
        self.pending: list = []
        self.open: list[tuple[int, int, int]] = []  # slices of the shard being cut
        self.entries: dict[int, dict] = {}
        self.n_shards = self.n_docs = self.n_tokens = 0
        self.stats: list[dict] = []

    def execute(self, paths: Sequence[Path], progress: bool) -> tuple[list[dict], int, int, dict]:
        t0 = time.perf_counter()
        sizes = [_size(p) for p in paths]
        cpus = ray.cluster_resources().get("CPU", 1)
        batches = batch_files(paths, sizes, batch_bytes(sum(sizes), cpus))
        self.driver_s["batch"] = time.perf_counter() - t0
        cwd = os.getcwd()
        bars = _Bars(progress, sum(sizes))
        try:
            self.pending = [self.tokenize.remote(i, [str(p) for p in b], cwd, self.tokenizer,
                                                 self.spec) for i, (b, _) in enumerate(batches)]
            tokenized: dict[int, dict] = {}
            next_batch = 0
            while self.pending:
                ready, self.pending = ray.wait(self.pending, num_returns=1)
                result = _result(ready[0], self.out)
                self.stats.append(result)
                if result["kind"] == "shard":
                    self.entries[result["index"]] = result["entry"]
                    bars.sorted.update(result["entry"]["n_tokens"])
                    continue
                bars.tokenized.update(batches[result["index"]][1])
                tokenized[result["index"]] = result
                while next_batch in tokenized:  # documents are numbered in input order
                    self._cut(next_batch, tokenized.pop(next_batch))
                    next_batch += 1
                if next_batch == len(batches):
                    next_batch += 1
                    if self.open:
                        self._launch()
                    if self.n_docs == 0:
                        raise CorpusError(EMPTY_CORPUS)
                    bars.sorted.total = self.n_tokens
                    bars.sorted.refresh()
        except BaseException:
            self._cancel()
            raise
        finally:
            bars.close()
        entries = [self.entries[i] for i in range(self.n_shards)]
        return entries, self.n_docs, self.n_tokens, self._report(time.perf_counter() - t0)

    def _cut(self, batch: int, result: dict) -> None:
        """Take a tokenized batch's documents, in order; start each shard that closes."""
        t0 = time.perf_counter()
        for msg in result["skipped"]:
            self.on_skip(msg)
        lengths = result["lengths"]
        lo = 0
        for i, n in enumerate(lengths.tolist()):
            if self.cutter.closes_before(f"document {self.n_docs + i}", n):
                if i > lo:
                    self.open.append((batch, lo, i))
                self._launch()
                lo = i
        if len(lengths) > lo:
            self.open.append((batch, lo, len(lengths)))
        self.n_docs += len(lengths)
        self.n_tokens += int(lengths.sum())
        self.driver_s["plan"] += time.perf_counter() - t0

    def _launch(self) -> None:
        self.pending.append(self.shard.remote(self.n_shards, self.open, self.spec))
        self.n_shards += 1
        self.open = []

    def _cancel(self) -> None:
        """Stop every task still running (a failed or interrupted build), and wait a while
        for them to end, so that none writes into the directory after the cleanup."""
        for ref in self.pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        with contextlib.suppress(Exception):
            ray.wait(self.pending, num_returns=len(self.pending), timeout=CANCEL_WAIT_S)
        for ref in self.pending:  # their errors are expected: not "unhandled"
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=0)
        self.pending = []

    def _report(self, seconds: float) -> dict:
        """What the history event records about the run (`redraft stats` shows it): where
        tasks ran, how many were run again, and where the time went."""
        nodes: dict[str, int] = {}
        for s in self.stats:
            nodes[s["node"][:12]] = nodes.get(s["node"][:12], 0) + 1
        attempts = len(os.listdir(self.work / "attempts"))

        def total(kind: str, what: str) -> float:
            return round(sum(s[what] for s in self.stats if s["kind"] == kind), 3)

        return {"nodes": nodes, "tasks": len(self.stats),
                "retried": max(0, attempts - len(self.stats)),
                "cpu_s": {k: total(k, "cpu_s") for k in ("tokenize", "shard")},
                "task_s": {k: total(k, "task_s") for k in ("tokenize", "shard")},
                "longest_task": {k: round(max(s[k] for s in self.stats), 3)
                                 for k in ("task_s", "cpu_s")},
                "seconds": round(seconds, 3),
                "driver_s": {k: round(v, 3) for k, v in self.driver_s.items()}}


def _result(ref, out: Path) -> dict:
    """A finished task's result; its failure as one line (the error it raised when that is
    redraft's own; Ray's traceback never reaches the user)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, RedraftError):
            raise cause from None
        if isinstance(cause, (OSError, lmdb.Error)):
            raise write_error(out, cause) from None
        raise DatastoreError(f"{out}: a task of the Ray build failed ({type(cause).__name__}: "
                             f"{_first_line(cause)}); nothing was changed") from None
    except ray.exceptions.RayError as exc:
        raise DatastoreError(f"{out}: the build failed on the Ray cluster "
                             f"({type(exc).__name__}: {_first_line(exc)}); nothing was "
                             "changed") from None
