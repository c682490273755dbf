"""Building on a real Ray cluster of two nodes (Ray's own `cluster_utils.Cluster`: a head and
one more node, one CPU each, every process a child of this one): the result equals the
single-process build's, byte for byte in every shard; a worker killed mid-task is retried and
changes nothing; with retries off the build fails with one line and leaves the datastore as
it was. The cluster starts once for the module (about 15 s)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from redraft.datastore import (
    CorpusError,
    DatastoreError,
    Reader,
    append_corpus,
    build_datastore,
)
from redraft.datastore import format as fmt
from redraft.datastore.drafting import retrieval_tree
from redraft.datastore.manifest import commit_stamp

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SHARD_TOKENS = 20_000  # several shards from the small corpus
BIG_BYTES = 1 << 20  # the first input: one file, one batch, a tokenize task that takes a while


# ---- the cluster and the corpus ------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    """A head and one more node, one CPU each. Ray's settings are explicit: no token
    authentication (it would write ~/.ray/auth_token), no usage reports, and a short private
    temporary directory (its socket paths must stay under 108 bytes)."""
    ray_cluster = pytest.importorskip("ray.cluster_utils")
    tmp = tempfile.mkdtemp(prefix="ray")
    token = Path.home() / ".ray" / "auth_token"
    had_token = token.exists()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled",
                           "RAY_USAGE_STATS_ENABLED": "0"}.items():
            mp.setenv(key, value)
        mp.delenv("RAY_ADDRESS", raising=False)
        c = ray_cluster.Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "object_store_memory": 100 << 20})
        try:
            second = c.add_node(num_cpus=1, object_store_memory=100 << 20)
            c.wait_for_nodes()
            c.node_ids = {c.head_node.node_id[:12], second.node_id[:12]}
            yield c
        finally:
            c.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
    assert had_token or not token.exists(), "a Ray auth token was left in the home directory"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real code: `big.py` (about 1 MB of standard-library modules, so the first tokenize
    task runs long enough to be killed) first, then three standard-library packages; and
    one more package to append. Inputs are relative to this directory, as a user types them."""
    root = tmp_path_factory.mktemp("corpus")
    with open(root / "big.py", "w", encoding="utf-8") as f:
        for src in sorted(STDLIB.glob("*.py")):
            if f.tell() >= BIG_BYTES:
                break
            f.write(src.read_text(encoding="utf-8"))
    for package, dest in (("json", "lib"), ("logging", "lib"), ("http", "lib"),
                          ("concurrent", "extra")):
        shutil.copytree(STDLIB / package, root / dest / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture(scope="module")
def inputs(corpus):
    """The inputs of the main build; while the module's tests run, the corpus directory is
    the working directory (relative names are what a task must resolve as the driver does)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(corpus)
        yield ["big.py", "lib"]


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """The single-process build of the same inputs."""
    out = tmp_path_factory.mktemp("reference") / "ds"
    build_datastore(inputs, out, shard_tokens=SHARD_TOKENS)
    return out


# ---- comparing two datastores -------------------------------------------------------------
def contexts(store, n=40, seed=0) -> list[list[int]]:
    """Token sequences of 1-8 tokens taken from the documents, and a few continued by a
    token that follows nowhere."""
    rng = np.random.default_rng(seed)
    out = []
    with Reader(store) as r:
        shards = r.manifest["shards"]
        for _ in range(n):
            sh = shards[int(rng.integers(len(shards)))]
            docs = [d for d in r.shard_documents(sh["id"]) if len(d) > 8]
            doc = docs[int(rng.integers(len(docs)))]
            at = int(rng.integers(len(doc) - 8))
            out.append([int(t) for t in doc[at:at + int(rng.integers(1, 9))]])
    return out + [c + [0] for c in out[:5]]


def assert_same_answers(a, b, ctxs) -> None:
    with Reader(a, verify=True) as ra, Reader(b, verify=True) as rb:
        assert (ra.n_docs_total, ra.manifest["n_tokens"]) == (rb.n_docs_total,
                                                              rb.manifest["n_tokens"])
        assert [ra.doc_name(i) for i in range(ra.n_docs_total)] == \
            [rb.doc_name(i) for i in range(rb.n_docs_total)]
        for ctx in ctxs:
            assert ra.count(ctx) == rb.count(ctx), ctx
            assert ra.find(ctx, limit=1 << 20) == rb.find(ctx, limit=1 << 20), ctx
            assert ra.next_token_counts(ctx) == rb.next_token_counts(ctx), ctx
            assert ra.longest_match(ctx) == rb.longest_match(ctx), ctx


def assert_same_shards(a, b) -> None:
    """Every shard's stored arrays (tokens, suffix array, offsets, buckets, names) are the
    same bytes, shard by shard in document order, and so are the trees drafted from them."""
    with Reader(a) as ra, Reader(b) as rb:
        sa, sb = ra.manifest["shards"], rb.manifest["shards"]
        assert len(sa) == len(sb) > 3
        for x, y in zip(sa, sb):
            assert (x["first_doc"], x["n_docs"]) == (y["first_doc"], y["n_docs"])
            for what in fmt.SHARD_KEYS:
                assert bytes(ra.shard_raw(x["id"], what)) == bytes(rb.shard_raw(y["id"], what))
        for ctx in contexts(a, n=10, seed=1):
            ta, tb = retrieval_tree(ra, ctx), retrieval_tree(rb, ctx)
            assert (ta.tokens, ta.parents, ta.probs) == (tb.tokens, tb.parents, tb.probs)


def ray_event(store) -> dict:
    with Reader(store) as r:
        return r.manifest["build"]["history"][-1]["ray"]


def leftovers(store) -> list[str]:
    return [n for n in os.listdir(store) if n.startswith(fmt.TMP_PREFIX)]


@contextlib.contextmanager
def killing_first_tokenize_task(store: Path):
    """Kill (SIGKILL) the worker process running the first tokenize task as soon as it starts
    (each attempt leaves a mark naming its pid); yields what was killed."""
    killed: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for mark in store.glob(f"{fmt.TMP_PREFIX}ray-*/attempts/tokenize-000000-*"):
                pid = int(mark.name.rsplit("-", 1)[1])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield killed
    finally:
        done.set()
        watcher.join()


def run_cli(*argv: str, prelude: str = "", cwd=None) -> subprocess.CompletedProcess:
    """`redraft ARGV` in a process of its own (after `prelude`)."""
    code = f"{prelude}\nimport sys\nfrom redraft.decoder.cli import main\n" \
        "sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=240, cwd=cwd)


# ---- on the cluster -----------------------------------------------------------------------
def test_the_ray_build_equals_the_single_process_build(cluster, inputs, reference,
                                                       tmp_path):
    out = tmp_path / "ds"
    m = build_datastore(inputs, out, shard_tokens=SHARD_TOKENS, ray=cluster.address)
    assert_same_shards(out, reference)
    assert_same_answers(out, reference, contexts(reference))
    # one segment per shard, tasks on both nodes, nothing left behind
    assert m["n_segments"] == m["n_shards"]
    report = ray_event(out)
    assert set(report["nodes"]) == cluster.node_ids
    assert report["retried"] == 0 and report["tasks"] == sum(report["nodes"].values())
    assert leftovers(out) == []


def test_a_worker_killed_mid_task_is_retried_and_changes_nothing(cluster, inputs, reference,
                                                                 tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    with killing_first_tokenize_task(out) as killed:
        build_datastore(inputs, out, shard_tokens=SHARD_TOKENS, ray=cluster.address)
    assert killed and ray_event(out)["retried"] >= 1
    assert_same_shards(out, reference)
    assert leftovers(out) == []


def test_with_retries_off_a_killed_worker_fails_the_build_in_one_line(cluster, reference,
                                                                      corpus, tmp_path, files):
    """The CLI, as a user runs it: exit 2, one line on stderr, nothing on stdout (where Ray
    prints a dead worker's report), and the datastore it would have replaced as it was."""
    out = tmp_path / "ds"
    shutil.copytree(reference, out)
    before, stamp = files.directory_bytes(out), commit_stamp(out)
    with killing_first_tokenize_task(out) as killed:
        p = run_cli("index", "--out", str(out), "--shard-tokens", str(SHARD_TOKENS),
                    "--ray", cluster.address, "--ray-retries", "0", "big.py", "lib", cwd=corpus)
    assert killed
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("redraft index: error: ") and "WorkerCrashedError" in lines[0]
    assert files.directory_bytes(out) == before and commit_stamp(out) == stamp


def test_an_append_on_the_cluster_answers_as_one_in_this_process(cluster, reference,
                                                                 tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    shutil.copytree(reference, here)
    shutil.copytree(reference, there)
    append_corpus(["extra"], here, corpus="extra")
    m = append_corpus(["extra"], there, corpus="extra", ray=cluster.address)
    assert m["corpora"]["extra"]["n_docs"] > 3 and ray_event(there)["tasks"] >= 2
    assert_same_answers(there, here, contexts(here, seed=2))


def test_a_bad_file_is_the_same_line_or_the_same_skip_as_here(cluster, corpus, inputs,
                                                             tmp_path, capsys):
    bad = corpus / "bad"
    bad.mkdir(exist_ok=True)
    (bad / "latin1.py").write_bytes(b"caf\xe9 = 1\n")
    inputs = ["extra", "bad/latin1.py"]
    errors = []
    for ray in (None, cluster.address):
        with pytest.raises(CorpusError) as exc:
            build_datastore(inputs, tmp_path / "strict", ray=ray)
        errors.append(str(exc.value))
    assert errors[0] == errors[1] == "bad/latin1.py: not UTF-8 text (byte 3)"
    here = build_datastore(inputs, tmp_path / "here", skip_bad=True)
    there = build_datastore(inputs, tmp_path / "there", skip_bad=True, ray=cluster.address)
    assert here["build"]["history"][-1]["skipped"] == there["build"]["history"][-1]["skipped"] == 1
    assert capsys.readouterr().err.count("skipped: bad/latin1.py: not UTF-8") == 2
    assert_same_answers(tmp_path / "there", tmp_path / "here", contexts(tmp_path / "here"))


# ---- without a cluster --------------------------------------------------------------------
def test_without_the_extra_the_build_names_it_in_one_line(corpus, tmp_path):
    p = run_cli("index", "--out", str(tmp_path / "ds"), "lib", "--ray",
                prelude="import sys; sys.modules['ray'] = None  # as if not installed", cwd=corpus)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert p.stderr.strip().splitlines() == [
        "redraft index: error: building on a Ray cluster needs Ray: pip install 'redraft[ray]'"]
    assert not (tmp_path / "ds").exists()


def test_the_single_process_build_imports_no_ray(corpus, tmp_path):
    code = ("import sys\nfrom redraft.datastore import build_datastore\n"
            f"build_datastore([{str(corpus / 'extra')!r}], {str(tmp_path / 'ds')!r})\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr


def test_an_input_is_not_taken_for_an_address(tmp_path, capsys):
    from redraft.decoder.cli import main

    rc = main(["index", "--out", str(tmp_path / "ds"), "--ray", "src/", "more/"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "'src/' is not a cluster address" in err


def test_a_cluster_that_answers_nothing_is_one_line_at_once(corpus, inputs, tmp_path,
                                                            capsys):
    pytest.importorskip("ray")
    from redraft.decoder.cli import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    rc = main(["index", "--out", str(tmp_path / "ds"), "--ray", f"127.0.0.1:{port}", "extra"])
    err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - t0 < 60
    assert err.strip().splitlines() == [
        f"redraft index: error: cannot connect to the Ray cluster at 127.0.0.1:{port}: "
        "Connection refused"]
    assert not (tmp_path / "ds").exists()


def test_a_port_that_accepts_and_never_answers_is_one_line_in_seconds(corpus, inputs,
                                                                     tmp_path, capsys):
    """Before: `ray.init` waited on it for more than 155 s."""
    pytest.importorskip("ray")
    from redraft.decoder.cli import main

    with socket.socket() as s:  # the kernel accepts connections; nobody reads or answers
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        rc = main(["index", "--out", str(tmp_path / "ds"), "--ray", f"127.0.0.1:{port}",
                   "extra"])
        took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and took < 10, took
    assert err.strip().splitlines() == [
        f"redraft index: error: cannot connect to the Ray cluster at 127.0.0.1:{port}: it "
        "accepts connections but answered nothing within 3 s (is it a Ray head's GCS port?)"]
    assert not (tmp_path / "ds").exists()


def test_pretokenized_documents_are_not_built_on_ray(tmp_path):
    with pytest.raises(DatastoreError, match="not pre-tokenized documents"):
        build_datastore(None, tmp_path / "ds", documents=[[1, 2, 3]], fingerprint="x",
                        vocab_size=10, ray=True)
    assert not (tmp_path / "ds").exists()
