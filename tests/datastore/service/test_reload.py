"""A running server follows its datastore's commits (issue 21.6): a delete stops drafting the
deleted documents within 2 s, for open sessions and new ones, without dropping a session; the
old files are released; a commit that cannot be served keeps the old snapshot."""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from redraft.datastore import Reader, append_corpus, build_datastore, persist_learned
from redraft.datastore import manifest as mf
from redraft.datastore.service.client import DraftClient, DraftParams
from redraft.datastore.service.server import ServerThread

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


def serve(store: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`redraft serve` in a process of its own, once it announced its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "redraft.decoder.cli", "serve", "--datastore", store,
         "--port", "0", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put("")],
                     daemon=True).start()
    try:
        while "listening on" not in (line := lines.get(timeout=60)):
            assert line, proc.stderr.read()
    except BaseException:
        proc.kill()
        raise
    return proc, line.split("listening on ")[1].strip()


def mapped(pid: int, name: str) -> bool:
    """Whether process `pid` still maps a file called `name` (deleted or not)."""
    with open(f"/proc/{pid}/maps") as f:
        return any(name in line for line in f)


def test_a_delete_stops_drafting_within_2_s_for_open_and_new_sessions(store):
    proc, address = serve(store, "--learn", "off")
    try:
        with DraftClient(address, timeout=10) as c:
            s = c.session(SECRET[:30], REST_ONLY, FP).__enter__()
            assert secret_in(s.draft) and s.draft.tokens[0] == SECRET[30]
            with Reader(store) as r:
                (old,) = r.segments
            assert mapped(proc.pid, old)
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
            while mapped(proc.pid, old):  # the old file released: its blocks freed
                assert time.monotonic() - t_deleted < 2.0, "the old segment is still mapped"
                time.sleep(0.05)
            print(f"deleted secret last drafted {took:.2f} s after the delete")
            s.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
