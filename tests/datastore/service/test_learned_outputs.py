"""The service learns from what it serves: drafts for the same tenant only, bounded memory,
persisted as the datastore corpus `learned` and reloaded after a restart, on a read-only
datastore too (drafted from memory, persisted once it is writable). Real servers on real
ports."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import time

import grpc
import pytest
from redraft.datastore import Reader, build_datastore, persist_learned
from redraft.datastore.service.client import DraftClient, DraftParams, InvalidRequest
from redraft.datastore.service.config import ServiceConfig
from redraft.datastore.service.server import ServerThread
from redraft.decoder.cli import main as redraft_main
from redraft.proto import draft_pb2, draft_pb2_grpc

FP = "sha256:learning-test"
VOCAB = 3000
RNG = random.Random(21)
DOCS = [[RNG.randrange(1, 1000) for _ in range(80)] for _ in range(20)]
PROMPT = [RNG.randrange(1, 1000) for _ in range(30)]
SECRET = [RNG.randrange(1000, VOCAB) for _ in range(120)]  # in no corpus: only learnable
LEARNED_ONLY = DraftParams(budget=32, max_depth=16, sources=("learned",))


@pytest.fixture()
def store(tmp_path) -> str:
    path = str(tmp_path / "ds")
    build_datastore(None, path, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    return path


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def generate(client, tenant: str, text=SECRET, close=True):
    """A session that accepts `text` after PROMPT, a few tokens per step."""
    s = client.session(PROMPT, DraftParams(budget=16), FP, tenant=tenant).__enter__()
    for i in range(0, len(text), 3):
        s.step(text[i:i + 3])
    if close:
        s.close()
    return s


def secret_drafted(client, tenant: str, params=LEARNED_ONLY) -> int:
    """Nodes carrying SECRET tokens drafted while a session of `tenant` replays SECRET (which
    `tenant` learns from then on)."""
    n = 0
    with client.session(PROMPT, params, FP, tenant=tenant) as s:
        n += len(set(s.draft.tokens) & set(SECRET))
        for i in range(0, 60, 2):
            n += len(set(s.step(SECRET[i:i + 2]).tokens) & set(SECRET))
    return n


def test_a_tenant_gets_its_own_outputs_while_they_are_generated_and_no_one_else_does(store):
    with Reader(store) as r, ServerThread(r) as srv, DraftClient(srv.address) as c:
        writing = generate(c, "alice", close=False)  # still open: counts already
        with c.session(PROMPT, LEARNED_ONLY, FP, tenant="alice") as s:
            assert s.draft.tokens[:4] == SECRET[:4] and set(s.draft.sources) == {"learned"}
            assert s.learned_match_len > 0
            assert s.step(SECRET[:5]).tokens[:4] == SECRET[5:9]
        writing.close()
        assert secret_drafted(c, "bob") == 0
        assert secret_drafted(c, "") == 0  # the default tenant is a tenant too
        assert secret_drafted(c, "alice") > 30
        # a one-off Propose drafts for its tenant, and learns nothing
        assert len(c.propose(PROMPT, LEARNED_ONLY, tenant="alice")) > 0
        assert len(c.propose(PROMPT, LEARNED_ONLY, tenant="carol")) == 0
        assert len(c.propose(PROMPT, LEARNED_ONLY, tenant="carol")) == 0
        st = c.stats()
        assert st["learn"] == "tenant" and st["learned_hits"] > 0
        assert c.info().learn == "tenant"


def test_with_auth_each_token_is_a_tenant(store):
    config = ServiceConfig(token=("one", "two"))
    with Reader(store) as r, ServerThread(r, config=config) as srv, \
            DraftClient(srv.address, token="one") as one, \
            DraftClient(srv.address, token="two") as two:
        generate(one, "x")
        assert secret_drafted(two, "x") == 0  # the same declared name under another token
        assert secret_drafted(one, "") == 0  # a declared tenant subdivides its token
        assert secret_drafted(one, "x") > 30


def test_global_learning_shares_and_off_learns_nothing(store):
    with Reader(store) as r:
        with ServerThread(r, config=ServiceConfig(learn="global")) as srv, \
                DraftClient(srv.address) as c:
            generate(c, "alice")
            assert secret_drafted(c, "bob") > 30
        with ServerThread(r, config=ServiceConfig(learn="off")) as srv, \
                DraftClient(srv.address) as c:
            generate(c, "alice")
            assert secret_drafted(c, "alice") == 0
            assert "learned_tokens" not in c.stats() and c.info().learn == "off"


def test_memory_stays_within_the_bound(store):
    config = ServiceConfig(learn_max_tokens=300)
    with Reader(store) as r, ServerThread(r, config=config) as srv, \
            DraftClient(srv.address) as c:
        for k in range(8):
            generate(c, f"t{k % 3}", text=[RNG.randrange(1, VOCAB) for _ in range(150)])
            assert c.stats()["learned_tokens"] <= 300
        assert c.stats()["learned_tokens"] > 150


def test_learned_outputs_persist_and_a_restart_keeps_them(store, capsys):
    config = ServiceConfig(learn_persist_s=0.2)
    with Reader(store) as r, ServerThread(r, config=config) as srv, \
            DraftClient(srv.address) as c:
        generate(c, "alice")

        def persisted() -> int:
            with Reader(store) as now:
                return now.corpora.get("learned", {}).get("n_docs", 0)

        wait_until(lambda: persisted() == 1)  # periodically, while serving
        generate(c, "alice", text=SECRET[::-1], close=False)  # open at shutdown
    assert persisted() == 2
    assert redraft_main(["stats", store]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["corpora"]["learned"]["n_docs"] == 2
    with Reader(store) as r:
        assert {name for _, name, _ in r.documents("learned")} == {"t:alice"}  # a declared key
        with ServerThread(r) as srv, DraftClient(srv.address) as c:
            wait_until(lambda: c.stats()["learned_docs"] == 2)  # reloaded in the background
            assert secret_drafted(c, "alice") > 30
            assert secret_drafted(c, "bob") == 0
            # retrieval never reads the learned corpus, whoever asks
            rest_only = DraftParams(budget=32, sources=("rest",))
            assert not set(c.propose(PROMPT + SECRET[:20], rest_only).tokens) & set(SECRET)
            with pytest.raises(InvalidRequest, match="SOURCE_LEARNED"):
                c.propose(PROMPT, DraftParams(corpora=("learned",)))


def test_bad_tenant_is_invalid_argument(store):
    with Reader(store) as r, ServerThread(r) as srv, grpc.insecure_channel(srv.address) as ch:
        stub = draft_pb2_grpc.DrafterStub(ch)
        opening = draft_pb2.SessionRequest(open=draft_pb2.SessionOpen(
            prompt=[1, 2], tokenizer_fingerprint=FP, tenant="a\nb"))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Session(iter([opening]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tenant" in err.value.details()


@contextlib.contextmanager
def small_file_system(path):
    """A tmpfs at `path` that a test can remount read-only and back (root only)."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        pytest.skip("needs to mount a file system (root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def remount(path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def learned_names(store) -> list[str]:
    with Reader(store) as r:
        if "learned" not in r.corpora:
            return []
        return sorted(name for _, name, _ in r.documents("learned"))


def test_a_read_only_datastore_drafts_what_it_holds_and_persists_what_it_learns_later(
        tmp_path, servers, until):
    with small_file_system(tmp_path / "fs") as fs:
        store = str(fs / "ds")
        build_datastore(None, store, documents=DOCS, fingerprint=FP, vocab_size=VOCAB,
                        corpus="c")
        persist_learned(store, [("t:alice", PROMPT[-16:] + SECRET)], {}, fingerprint=FP)
        remount(fs, "ro")
        a = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.3")
        with DraftClient(a.address) as c:
            until(lambda: c.stats()["learned_docs"] == 1)  # what it already holds loads
            assert secret_drafted(c, "alice") > 30
            generate(c, "bob", text=SECRET[::-1])  # learned while nothing can be written
            assert secret_drafted(c, "carol") == 0
        assert "learned outputs stay in this process" in a.stderr
        remount(fs, "rw")  # writable again: what it learned meanwhile is persisted
        until(lambda: "t:bob" in learned_names(store), timeout=15)
        assert a.stop() == 0
        assert learned_names(store).count("t:bob") == 1
        remount(fs, "ro")  # and a shutdown that cannot write says what it loses
        b = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.3")
        with DraftClient(b.address) as c:
            generate(c, "dave")
        assert b.stop() == 0
        (said,) = [line for line in b.stderr.splitlines() if "are lost" in line]
        assert "1 output(s)" in said and "Traceback" not in a.stderr + b.stderr
        remount(fs, "rw")
