"""A running server follows its datastore's commits (issue 21.6): a delete stops drafting the
deleted documents within 2 s, for open sessions and new ones, without dropping a session; the
old files are released; a commit that cannot be served keeps the old snapshot."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from redraft.datastore import Reader, append_corpus, build_datastore, persist_learned
from redraft.datastore import manifest as mf
from redraft.datastore.service.client import DraftClient, DraftParams
from redraft.datastore.service.server import ServerThread
from redraft.datastore.service.spawn import ServeProcess

FP = "sha256:reload-test"
VOCAB = 3000
RNG = random.Random(216)
DOCS = [[RNG.randrange(1, 1000) for _ in range(80)] for _ in range(20)]
SECRET = [RNG.randrange(1000, VOCAB) for _ in range(300)]  # in no other document
SECRET_ID = len(DOCS)
REST_ONLY = DraftParams(budget=16, sources=("rest",))


@pytest.fixture()
def store(tmp_path) -> str:
    path = str(tmp_path / "ds")
    build_datastore(None, path, documents=[*DOCS, SECRET], fingerprint=FP, vocab_size=VOCAB,
                    corpus="c")
    return path


def secret_in(tree) -> bool:
    return bool(set(tree.tokens) & set(SECRET))


@contextlib.contextmanager
def serving(store: str, *extra: str) -> Iterator[tuple[ServeProcess, str]]:
    """`redraft serve` in a process of its own, once it announced its address; killed at
    the end of the block if it is still running (a test stops it itself to check how)."""
    serve = ServeProcess(store, ("--port", "0", *extra))
    try:
        yield serve, serve.address
    finally:
        serve.kill()


def readyz(url: str) -> int:
    """The HTTP status `/readyz` answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def mapped(pid: int, name: str) -> bool:
    """Whether process `pid` still maps a file called `name` (deleted or not)."""
    with open(f"/proc/{pid}/maps") as f:
        return any(name in line for line in f)


def test_a_delete_stops_drafting_within_2_s_for_open_and_new_sessions(store):
    with serving(store, "--learn", "off") as (serve, address):
        with DraftClient(address, timeout=10) as c:
            s = c.session(SECRET[:30], REST_ONLY, FP).__enter__()
            assert secret_in(s.draft) and s.draft.tokens[0] == SECRET[30]
            with Reader(store) as r:
                (old,) = r.segments
            assert mapped(serve.pid, old)
            done = subprocess.run([sys.executable, "-m", "redraft.decoder.cli", "index",
                                   "--out", store, "--delete", str(SECRET_ID)],
                                  capture_output=True, text=True, timeout=120)
            t_deleted = time.monotonic()
            assert done.returncode == 0, done.stderr
            assert "running servers stop drafting them within 2 s" in done.stdout
            assert not os.path.exists(os.path.join(store, old))  # gone from the directory
            # the SAME session, stepping on through the secret: its drafts lose it
            i = 30
            while secret_in(s.step(SECRET[i:i + 2])):
                i += 2
                assert time.monotonic() - t_deleted < 2.0, "still drafting the deleted secret"
                time.sleep(0.05)
            took = time.monotonic() - t_deleted
            assert not secret_in(s.step(SECRET[i:i + 2])) and s.reconnects == 0
            with c.session(SECRET[:30], REST_ONLY, FP) as fresh:
                assert not secret_in(fresh.draft) and not secret_in(fresh.step(SECRET[30:32]))
            with c.session(DOCS[3][:20], REST_ONLY, FP) as other:  # the rest still drafts
                assert other.draft.tokens[:3] == DOCS[3][20:23]
            while mapped(serve.pid, old):  # the old file released: its blocks freed
                assert time.monotonic() - t_deleted < 2.0, "the old segment is still mapped"
                time.sleep(0.05)
            print(f"deleted secret last drafted {took:.2f} s after the delete")
            s.close()
        assert serve.stop() == 0


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_an_append_is_served_and_a_commit_that_cannot_be_opened_keeps_the_snapshot(
        store, caplog):
    extra = [RNG.randrange(1000, VOCAB) for _ in range(40)]
    caplog.set_level("ERROR", logger="redraft.serve")
    with Reader(store) as r, ServerThread(r) as srv, DraftClient(srv.address) as c:
        with c.session(extra[:10], REST_ONLY, FP) as s:
            assert not secret_in(s.draft) and s.draft.tokens[:1] != extra[10:11]
            append_corpus(None, store, documents=[extra], fingerprint=FP, corpus="new")
            wait_until(lambda: s.step([]).tokens[:3] == extra[10:13])  # the same session
            assert "new" in c.info().corpora
            with c.session(extra[:10], DraftParams(budget=8, sources=("rest",),
                                                   corpora=("new",)), FP) as t:
                assert t.draft.tokens[:3] == extra[10:13]  # the new corpus is requestable
            # a manifest that does not open: the old snapshot stays, one line in the log
            manifest = os.path.join(store, mf.MANIFEST_FILE)
            good = open(manifest, "rb").read()
            with open(manifest, "wb") as f:
                f.write(good[:100])
            time.sleep(1.5)
            assert s.step([]).tokens[:3] == extra[10:13]
            lines = [x.getMessage() for x in caplog.records if x.name == "redraft.serve"]
            assert len(lines) == 1 and "keeping the datastore snapshot" in lines[0], lines
            assert "not valid JSON" in lines[0]
            with open(manifest, "wb") as f:  # repaired: the same commit again
                f.write(good)
            build_datastore(None, store, documents=DOCS, fingerprint="sha256:another",
                            vocab_size=VOCAB, corpus="c")
            time.sleep(1.5)  # another tokenizer: refused, the snapshot stays
            assert s.step([]).tokens[:3] == extra[10:13]
            lines = [x.getMessage() for x in caplog.records if x.name == "redraft.serve"]
            assert len(lines) == 2 and "another tokenizer" in lines[1], lines
            assert c.stats()["checksums"] in ("passed", "running")


def test_learned_outputs_appearing_in_the_datastore_never_reach_retrieval(store):
    """A commit that adds the corpus `learned` (a persist) is swapped in under open
    sessions: their retrieval still leaves that corpus out (it keeps tenants apart)."""
    learned_secret = [RNG.randrange(1000, VOCAB) for _ in range(60)]
    with Reader(store) as r, ServerThread(r) as srv, DraftClient(srv.address) as c:
        with c.session(learned_secret[:10], REST_ONLY, FP) as s:
            persist_learned(store, [("learned:alice", learned_secret)], {"w": 1},
                            fingerprint=FP)
            wait_until(lambda: "learned" in c.info().corpora
                       or srv.service.reader.corpora.get("learned"))
            for i in range(10, 40, 3):
                assert not set(s.step(learned_secret[i:i + 3]).tokens) & set(learned_secret)
        with c.session(learned_secret[:10], REST_ONLY, FP) as fresh:
            assert not set(fresh.draft.tokens) & set(learned_secret)


# ---- files rewritten in place under a running server (issue 31.6) -----------------------
BIG_RNG = random.Random(316)
BIG_DOCS = [[BIG_RNG.randrange(1, VOCAB) for _ in range(2000)] for _ in range(400)]  # ~4 MB


@pytest.fixture(scope="module")
def big_store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("big") / "ds")
    build_datastore(None, path, documents=BIG_DOCS, fingerprint=FP, vocab_size=VOCAB,
                    corpus="c")
    return path


class Steppers:
    """Clients on threads opening sessions over random documents' starts and stepping them,
    until stopped; every draft is checked against the documents (`wrong`), every refusal
    kept (`refused`)."""

    def __init__(self, address: str, docs: list[list[int]], threads: int = 3) -> None:
        self.address, self.docs = address, docs
        self.ok = 0
        self.wrong: list[str] = []
        self.refused: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(threads)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with DraftClient(self.address, timeout=10) as c:
            while not self._stop.is_set():
                doc = self.docs[rng.randrange(len(self.docs))]
                at = rng.randrange(20, len(doc) - 40)
                try:
                    with c.session(doc[at - 20:at], REST_ONLY, FP) as s:
                        for k in range(at, at + 30, 3):
                            tree = s.draft if k == at else s.step(doc[k - 3:k])
                            if tree.tokens[:1] != doc[k:k + 1]:
                                self.wrong.append(f"{tree.tokens[:3]} for {doc[k:k + 3]}")
                            self.ok += 1
                except Exception as exc:  # noqa: BLE001 - refusals are what is counted
                    self.refused.append(str(exc))
                    time.sleep(0.02)

    def __enter__(self) -> Steppers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def test_a_segment_truncated_under_a_server_is_unavailable_then_reopened(big_store, tmp_path):
    store = str(tmp_path / "ds")
    shutil.copytree(big_store, store)
    with Reader(store) as r:
        (seg,) = (os.path.join(store, name) for name in r.segments)
    good = open(seg, "rb").read()
    with serving(store, "--learn", "off", "--metrics-port", "0") as (serve, address):
        ready = serve.metrics_url + "/readyz"
        assert readyz(ready) == 200
        with Steppers(address, BIG_DOCS) as st:
            wait_until(lambda: st.ok >= 20)
            os.truncate(seg, 8192)  # what `cp` does first to a file it overwrites
            wait_until(lambda: any("datastore is damaged" in x for x in st.refused))
            wait_until(lambda: readyz(ready) == 503)  # the probe follows gRPC health
            time.sleep(1.0)
            assert serve.proc.poll() is None, serve.stderr  # not dead of SIGBUS
            with open(seg, "r+b") as f:  # rewritten in place, whole again
                f.write(good)
            ok = st.ok
            wait_until(lambda: st.ok > ok + 50, timeout=20)  # reopened: drafting again
            wait_until(lambda: readyz(ready) == 200, timeout=20)
        assert not st.wrong, st.wrong[:5]
        with DraftClient(address, timeout=10) as c:
            assert c.session(BIG_DOCS[3][:20], REST_ONLY, FP).__enter__().draft.tokens[:3] \
                == BIG_DOCS[3][20:23]
            wait_until(lambda: c.stats()["checksums"] == "passed")
        assert serve.stop() == 0
        said = [x for x in serve.stderr.splitlines() if "NOT_SERVING" in x]
        assert len(said) == 1 and "truncated while mapped" in said[0], said


@pytest.mark.skipif(shutil.which("cp") is None, reason="needs the cp command")
def test_cp_r_over_a_served_datastore_while_clients_step(big_store, tmp_path):
    """The refresh the issue saw kill servers (9/9): a newer copy of the datastore copied
    over the served directory, its unchanged segments truncated and rewritten in place."""
    source, served = str(tmp_path / "source"), str(tmp_path / "served")
    shutil.copytree(big_store, source)
    shutil.copytree(big_store, served)
    extra = [RNG.randrange(1, VOCAB) for _ in range(200)]
    append_corpus(None, source, documents=[extra], fingerprint=FP, corpus="c")
    with Reader(served) as old, Reader(source) as new:
        assert set(old.segments) < set(new.segments)  # the served segment is overwritten
    with serving(served, "--learn", "off") as (serve, address):
        with Steppers(address, BIG_DOCS) as st:
            wait_until(lambda: st.ok >= 20)
            for _ in range(5):
                subprocess.run(["cp", "-r", source + "/.", served], check=True, timeout=60)
                ok = st.ok
                wait_until(lambda ok=ok: st.ok > ok + 20 or serve.proc.poll() is not None,
                           timeout=20)
                assert serve.proc.poll() is None, serve.stderr[-2000:]
        assert not st.wrong, st.wrong[:5]
        with DraftClient(address, timeout=10) as c:  # the copy's new document is served
            wait_until(lambda: c.propose(extra[:20], REST_ONLY, FP).tokens[:3] == extra[20:23])
        assert serve.stop() == 0


def test_the_documented_refresh_serves_the_copy_without_a_refusal(big_store, tmp_path):
    """docs/service.md's refresh (each file copied under a temporary name and renamed, the
    manifest last) while clients step: the copy is served, no call refused, no line logged."""
    source, served = str(tmp_path / "new"), str(tmp_path / "served")
    shutil.copytree(big_store, source)
    shutil.copytree(big_store, served)
    extra = [RNG.randrange(1, VOCAB) for _ in range(200)]
    append_corpus(None, source, documents=[extra], fingerprint=FP, corpus="c")
    with serving(served, "--learn", "off") as (serve, address):
        with Steppers(address, BIG_DOCS) as st, DraftClient(address, timeout=10) as c:
            wait_until(lambda: st.ok >= 20)
            subprocess.run(["sh", "-c", 'for f in new/seg-* new/manifest.json; do cp "$f" '
                            'served/.incoming && mv served/.incoming "served/${f##*/}"; done'],
                           cwd=str(tmp_path), check=True, timeout=60)
            wait_until(lambda: c.propose(extra[:20], REST_ONLY, FP).tokens[:3] == extra[20:23])
            ok = st.ok
            wait_until(lambda: st.ok > ok + 20)
        assert not st.wrong and not st.refused, (st.wrong[:3], st.refused[:3])
        assert serve.stop() == 0
        assert "NOT_SERVING" not in serve.stderr
