"""The client as the decoder uses it: typed errors, deadlines, reconnect, and `redraft serve`
as a real subprocess (SIGTERM, several workers, `redraft stats --server`)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redraft.datastore import Reader, build_datastore
from redraft.datastore.drafting import REST_CALIBRATION, calibrate, retrieval_tree
from redraft.datastore.drafting.prompt_lookup import prompt_lookup
from redraft.datastore.service.client import (
    DraftClient,
    DraftParams,
    DraftTimeout,
    InvalidRequest,
    LimitExceeded,
    ServiceError,
    ServiceUnavailable,
)
from redraft.datastore.service.server import ServerThread
from redraft.decoder.cli import main as redraft_main
from redraft.proto.tree import merge

FP = "sha256:client-test"
VOCAB = 300
RNG = random.Random(5)
PHRASES = [[RNG.randrange(1, VOCAB) for _ in range(8)] for _ in range(6)]
DOCS = [sum((RNG.choice(PHRASES) for _ in range(15)), []) for _ in range(20)]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("client") / "ds")
    build_datastore(None, path, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    return path


@pytest.fixture(scope="module")
def reader(store):
    with Reader(store) as r:
        yield r


def test_serve_token_from_file_or_environment(tmp_path, monkeypatch):
    from redraft.datastore.service.serve_cli import TOKEN_ENV, read_tokens

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert read_tokens(None) == ()
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert read_tokens(None) == ("from-env",)
    f = tmp_path / "tok"
    f.write_text("from-file\n\nsecond \n")
    assert read_tokens(str(f)) == ("from-file", "second")


def test_bad_parameters_fail_before_the_network(servers):
    c = DraftClient(f"127.0.0.1:{servers.free_port()}", timeout=1)
    with pytest.raises(InvalidRequest, match="budget"):
        c.propose([1], DraftParams(budget=-1))
    with pytest.raises(InvalidRequest, match="sources"):
        c.propose([1], DraftParams(sources=["medusa"]))
    with pytest.raises(InvalidRequest, match="token ids"):
        c.session([1, -2], None, FP)
    c.close()


def test_unreachable_server_is_a_typed_error_quickly(servers):
    with DraftClient(f"127.0.0.1:{servers.free_port()}", timeout=60) as c:
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable):
            c.info()
        with pytest.raises(ServiceUnavailable):
            c.session([1, 2], None, FP).__enter__()
        assert time.monotonic() - t0 < 30  # refused at once, not after the deadline


def test_missing_tls_file_is_a_service_error(tmp_path):
    with pytest.raises(ServiceError, match="missing.pem"):
        DraftClient("127.0.0.1:1", tls=str(tmp_path / "missing.pem"))


def test_one_client_serves_many_threads_at_once(reader):
    """DraftClient is thread-safe: threads sharing one client, each with its own sessions and
    unary calls, get exactly the drafts they get one at a time."""
    params = DraftParams(budget=16, sources=("rest", "pld"))  # nothing learned between runs

    def run(k: int) -> list:
        doc = DOCS[k % len(DOCS)]
        out = [c.propose(doc[:25], params).tokens, c.info().vocab_size]
        with c.session(doc[:20], params, FP) as s:
            out.append(s.draft.tokens)
            for i in range(20, 60, 4):
                out.append(s.step(doc[i:i + 4]).tokens)
        return out

    with ServerThread(reader) as srv, DraftClient(srv.address, timeout=30) as c:
        serial = [run(k) for k in range(16)]
        with ThreadPoolExecutor(8) as ex:
            parallel = list(ex.map(run, range(16)))
        assert parallel == serial
        assert c.stats()["sessions_opened"] == 32


def test_session_reopens_after_a_server_restart(reader, servers):
    port = servers.free_port()
    prompt, more = DOCS[0][:30], DOCS[0][30:34]
    with DraftClient(f"127.0.0.1:{port}", timeout=3) as c:
        with ServerThread(reader, port=port):
            s = c.session(prompt, DraftParams(budget=16), FP).__enter__()
            s.step(DOCS[0][30:32])
        # server A is gone; B takes the same port with the same datastore
        with ServerThread(reader, port=port) as b:
            d = s.step(DOCS[0][32:34])
            assert s.reconnects == 1
            ctx = prompt + more
            rest = calibrate(retrieval_tree(reader, ctx, budget=16, max_occurrences=64),
                             *REST_CALIBRATION)
            want = merge([rest, prompt_lookup(ctx, 16)], 16)
            assert d.tokens == want.tokens and d.parents == want.parents
            assert s.context_len == len(ctx)
            assert len(s.step(DOCS[0][34:35])) > 0
            assert b.stats.get("sessions_opened") == 1
            s.close()
        with pytest.raises(ServiceUnavailable):  # nobody there any more
            s2 = c.session(prompt, None, FP)
            s2.__enter__()


def test_session_without_reconnect_reports_shutdown(reader):
    with ServerThread(reader) as srv:
        c = DraftClient(srv.address, reconnect=False)
        s = c.session(DOCS[1][:10], None, FP).__enter__()
        srv.stop(grace=1)
        with pytest.raises(ServiceUnavailable, match="shutting down"):
            s.step([1])
        c.close()


def test_serve_subprocess_deadline_stats_and_graceful_sigterm(store, reader, capsys, servers):
    serve = servers.start(store, "--port", "0", "--grace", "3")
    proc, address = serve.proc, serve.address
    with DraftClient(address, timeout=10) as c:
        s = c.session(DOCS[2][:20], DraftParams(budget=8), FP, timeout=0.5).__enter__()
        s.step(DOCS[2][20:22])
        # a frozen server: the step's deadline fires, no hang
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            with pytest.raises(DraftTimeout):
                s.step(DOCS[2][22:23])
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert time.monotonic() - t0 < 30  # the 0.5 s deadline fired: no hang
        # the next step reopens the session with every token so far, the lost one too
        d = s.step(DOCS[2][23:24])
        ctx = DOCS[2][:24]
        assert s.reconnects == 1 and s.context_len == 24 and s.context == ctx
        rest = calibrate(retrieval_tree(reader, ctx, budget=8, max_occurrences=64),
                         *REST_CALIBRATION)
        want = merge([rest, prompt_lookup(ctx, 8)], 8)
        assert (d.tokens, d.parents) == (want.tokens, want.parents) and len(d) > 0
        assert redraft_main(["stats", "--server", address]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["sessions_opened"] == 2 and printed["requests"] >= 3

        # steps keep flowing while SIGTERM arrives: each one is answered or refused as
        # UNAVAILABLE, never anything else, and the server exits 0
        outcomes: list[str] = []
        done = threading.Event()

        def stepper() -> None:
            with c.session(DOCS[3][:20], DraftParams(budget=8), FP) as s2:
                i = 20
                while not done.is_set() and i < 10_000:
                    try:
                        s2.step([DOCS[3][i % len(DOCS[3])]])
                        outcomes.append("ok")
                    except ServiceUnavailable:
                        outcomes.append("unavailable")
                        return
                    i += 1

        t = threading.Thread(target=stepper)
        t.start()
        while len(outcomes) < 20 and t.is_alive():
            time.sleep(0.01)
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=2)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        done.set()
        t.join(10)
        assert outcomes.count("ok") >= 20 and set(outcomes) <= {"ok", "unavailable"}
        assert "stopped" in serve.rest_of_stdout()


def test_serve_workers_share_a_port_and_counters(store, servers):
    port = servers.free_port()
    serve = servers.start(store, "--port", str(port), "--workers", "2")
    proc, addresses = serve.proc, serve.addresses
    assert addresses == [f"127.0.0.1:{port}"] * 2
    # each client is one connection; the kernel spreads connections over the workers
    clients: list[DraftClient] = []
    sessions = []
    pids: set[int] = set()
    while len(pids) < 2 and len(clients) < 40:
        c = DraftClient(addresses[0], own_connection=True)
        clients.append(c)
        sessions.append(c.session(DOCS[len(clients) % 20][:20], None, FP).__enter__())
        sessions[-1].step([1])
        pids.add(c.stats()["pid"])
    assert len(pids) == 2  # both workers serve, and count into the same totals:
    assert all(c.stats()["sessions_active"] == len(clients) for c in clients)
    for c in clients:
        c.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0


def test_a_tokens_share_of_max_sessions_holds_across_workers(store, servers, tmp_path):
    """Two tokens, 40 slots: token a's 20 sessions land on both workers, and its 21st is
    refused whichever worker takes it; token b still opens sessions."""
    tokens = tmp_path / "tokens"
    tokens.write_text("token-a\ntoken-b\n")
    port = servers.free_port()
    serve = servers.start(store, "--port", str(port), "--workers", "2", "--token-file",
                          str(tokens), "--max-sessions", "40")
    address = serve.addresses[0]
    clients: list[DraftClient] = []
    sessions = []  # held: a session dropped is closed
    pids: set[int] = set()
    try:
        for i in range(20):
            c = DraftClient(address, token="token-a", own_connection=True)
            clients.append(c)
            sessions.append(c.session(DOCS[i][:20], None, FP).__enter__())
            pids.add(c.stats()["pid"])
        assert len(pids) == 2
        for _ in range(4):  # fresh connections: either worker refuses
            with DraftClient(address, token="token-a", own_connection=True) as c:
                with pytest.raises(LimitExceeded, match="its share of 20"):
                    c.session(DOCS[0][:20], None, FP).open()
        with DraftClient(address, token="token-b", own_connection=True) as b:
            with b.session(DOCS[1][:20], None, FP) as s:
                s.step([1])
                assert b.stats()["sessions_active"] == 21
    finally:
        for c in clients:
            c.close()
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(15) == 0


def test_without_auth_a_tenants_fair_share_holds_across_workers(store, servers):
    """No auth, 16 slots: the default tenant's 14 sessions land on both workers, its 15th
    is refused whichever worker takes it (two slots kept), and a declared tenant opens the
    kept ones. Before: the 15th and 16th opened and the declared tenant was refused."""
    port = servers.free_port()
    serve = servers.start(store, "--port", str(port), "--workers", "2", "--max-sessions",
                          "16")
    address = serve.addresses[0]
    clients: list[DraftClient] = []
    sessions = []  # held: a session dropped is closed
    pids: set[int] = set()

    def hold(tenant: str = "") -> DraftClient:
        c = DraftClient(address, own_connection=True)
        clients.append(c)
        sessions.append(c.session(DOCS[len(clients) % 20][:20], None, FP,
                                  tenant=tenant).__enter__())
        pids.add(c.stats()["pid"])
        return c

    try:
        for _ in range(14):
            hold()
        assert len(pids) == 2
        for _ in range(4):  # fresh connections: either worker refuses
            with DraftClient(address, own_connection=True) as c:
                with pytest.raises(LimitExceeded, match="this tenant holds its share of 14"):
                    c.session(DOCS[0][:20], None, FP).open()
        hold("bob")
        assert hold("bob").stats()["sessions_active"] == 16
    finally:
        for c in clients:
            c.close()
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(15) == 0


def test_workers_exit_when_their_parent_is_killed(store, servers):
    port = servers.free_port()
    proc = servers.start(store, "--port", str(port), "--workers", "2").proc
    import psutil

    workers = psutil.Process(proc.pid).children()
    assert len(workers) >= 2
    os.kill(proc.pid, signal.SIGKILL)  # cannot be forwarded
    proc.wait(10)
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_a_sigterm_while_workers_start_stops_them_all_cleanly(store, servers):
    """SIGTERM to `serve --workers 2` as soon as its first worker process exists: the
    parent stops every worker it started and exits 0 (it used to die of the signal, its
    handler not yet set, and leave its workers behind)."""
    import psutil

    port = servers.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "redraft.decoder.cli", "serve",
                             "--datastore", store, "--port", str(port), "--workers", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    parent = psutil.Process(proc.pid)

    def workers() -> list:
        return [c for c in parent.children() if "spawn_main" in " ".join(c.cmdline())]

    started: list = []
    try:
        deadline = time.monotonic() + 60
        while not workers():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.005)
        started = workers()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
        gone, alive = psutil.wait_procs(started, timeout=10)
        assert not alive
    finally:  # a failure leaves nothing running
        for p in [*started, parent]:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_serve_bad_arguments_are_one_line_errors(store, tmp_path, capsys):
    assert redraft_main(["serve", "--datastore", str(tmp_path / "none")]) == 2
    assert "error" in capsys.readouterr().err
    assert redraft_main(["serve", "--datastore", store, "--max-budget", "0"]) == 2
    assert "--max-budget must be positive" in capsys.readouterr().err
    assert redraft_main(["serve", "--datastore", store, "--tls-cert", "x.pem"]) == 2
    assert redraft_main(["serve", "--datastore", store, "--rest-calibration", "2,1"]) == 2
    assert redraft_main(["serve", "--datastore", store, "--rest-calibration", "x"]) == 2
    assert "SCALE,POWER" in capsys.readouterr().err
    assert redraft_main(["serve", "--datastore", store, "--workers", "2", "--port", "0"]) == 2
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert redraft_main(["serve", "--datastore", store, "--token-file", str(empty)]) == 2
    assert "empty" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [
    ("--idle-timeout", "inf"), ("--idle-timeout", "nan"), ("--idle-timeout", "1e10"),
    ("--max-sessions", str(1 << 32)), ("--max-budget", str(1 << 32)),
    ("--max-message-bytes", "99999999999"), ("--grace", "nan"),
    # accepted before, and then unworkable: a server answering nothing (health included), a
    # batched call stalling every other caller for seconds, probabilities of infinity
    ("--max-message-bytes", "1"), ("--max-message-bytes", "100"),
    ("--max-batch-entries", "4294967295"), ("--rest-calibration", "1,inf"),
    ("--rest-calibration", "1,nan"),
])
def test_serve_refuses_limits_it_cannot_honour(store, taken_port, capsys, flag, value):
    # on a port in use: were the limit accepted, the command would fail there, not serve
    argv = ["serve", "--datastore", store, "--port", str(taken_port), flag, value]
    assert redraft_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (f"{flag} must be" in err or f"{flag} needs" in err), err


@pytest.mark.parametrize("garbage", ["cert", "key", "both"])
def test_serve_refuses_tls_files_that_are_no_certificate_or_key_in_one_line(
        store, taken_port, tls_cert, tmp_path, capsys, garbage):
    # before: gRPC said "Failed to bind" (or the server started and every handshake failed)
    cert, key = tls_cert
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    if garbage in ("cert", "both"):
        cert = str(junk)
    if garbage in ("key", "both"):
        key = str(junk)
    argv = ["serve", "--datastore", store, "--port", str(taken_port), "--tls-cert", cert,
            "--tls-key", key]
    assert redraft_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a PEM certificate chain" in err, err


@pytest.fixture()
def taken_port():
    """A loopback port something else listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_on_a_port_in_use_is_one_line(store, taken_port, workers):
    port = taken_port
    proc = subprocess.run(
        [sys.executable, "-m", "redraft.decoder.cli", "serve", "--datastore", store,
         "--port", str(port), "--workers", workers],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"redraft serve: error: cannot listen on 127.0.0.1:{port}: " \
                          "Address already in use\n"


def test_a_client_of_replicas_spreads_sessions_and_moves_on_when_one_dies(store, servers):
    a, b = (servers.start(store, "--port", "0") for _ in range(2))
    with DraftClient(f"{a.address}, {b.address}", timeout=5) as c, \
            DraftClient(a.address) as on_a, DraftClient(b.address) as on_b:
        pids = {on_a.stats()["pid"]: "a", on_b.stats()["pid"]: "b"}
        # gRPC's round_robin takes the replicas in turn once both connections are up (on
        # a loaded machine one may come up late): four calls in turn, within 200
        seen = [pids[c.stats()["pid"]]]
        while seen[-4:] not in (list("abab"), list("baba")) and len(seen) < 200:
            seen.append(pids[c.stats()["pid"]])
        assert seen[-4:] in (list("abab"), list("baba"))
        sessions = []
        for i in range(8):  # each session one stream, on one replica
            s = c.session(DOCS[i][:20], DraftParams(budget=8), FP).__enter__()
            s.step(DOCS[i][20:22])
            sessions.append(s)
        on_replica_a = on_a.stats()["sessions_active"]
        on_replica_b = on_b.stats()["sessions_active"]
        assert on_replica_a + on_replica_b == 8 and min(on_replica_a, on_replica_b) >= 2
        a.kill()  # a replica dies: its sessions reopen on the other, in step
        for i, s in enumerate(sessions):
            d = s.step(DOCS[i][22:24])
            assert s.context == DOCS[i][:24] and s.context_len == 24 and len(d) > 0
        assert sum(s.reconnects for s in sessions) == on_replica_a
        for i in range(4):  # new sessions go to the replica that is left
            with c.session(DOCS[i][:20], DraftParams(budget=8), FP) as s:
                assert len(s.step(DOCS[i][20:22])) > 0
        assert on_b.stats()["sessions_opened"] == on_replica_b + on_replica_a + 4
        for s in sessions:
            s.close()
    with DraftClient(f"dns:///localhost:{b.address.rsplit(':', 1)[1]}") as by_name:
        assert by_name.info().tokenizer_fingerprint == FP
    with pytest.raises(ServiceError, match="host:port"):
        DraftClient(f"{b.address},nothing")
    assert b.stop() == 0


@pytest.mark.parametrize("source", ["file", "environment"])
def test_serve_refuses_a_token_no_client_can_send(store, tmp_path, capsys, monkeypatch, source):
    from redraft.datastore.service.client import TOKEN_ENV

    argv = ["serve", "--datastore", store, "--port", "0"]
    if source == "file":
        (tmp_path / "tok").write_text("fine\nsécret\n")
        argv += ["--token-file", str(tmp_path / "tok")]
        where = f"--token-file {tmp_path / 'tok'}"
    else:
        monkeypatch.setenv(TOKEN_ENV, "sécret")
        where = f"${TOKEN_ENV}"
    assert redraft_main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"redraft serve: error: {where}: a token must be printable ASCII (gRPC " \
                  "metadata cannot carry anything else)\n"


def test_stats_server_takes_tls_and_a_token_from_a_file_or_the_environment(
        reader, tls_cert, tmp_path, capsys, monkeypatch):
    from redraft.datastore.service.client import TOKEN_ENV
    from redraft.datastore.service.config import ServiceConfig
    from redraft.datastore.service.server import TLSFiles

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cert, key = tls_cert
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    config = ServiceConfig(token="s3cret")
    with ServerThread(reader, config=config, tls=TLSFiles(cert, key)) as srv:
        def stats(*argv: str) -> tuple[int, str, str]:
            rc = redraft_main(["stats", "--server", srv.address, *argv])
            out, err = capsys.readouterr()
            return rc, out, err

        rc, out, _ = stats("--tls-ca", cert, "--token-file", str(secret))
        assert rc == 0 and json.loads(out)["limits"]["max_sessions"] > 0
        rc, out, _ = stats("--tls-ca", cert, "--token", "s3cret")  # --token stays
        assert rc == 0 and json.loads(out)["requests"] >= 0
        rc, _, err = stats("--tls-ca", cert)  # no token anywhere
        assert rc == 2 and err.count("\n") == 1 and "UNAUTHENTICATED" in err
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        rc, out, _ = stats("--tls-ca", cert)
        assert rc == 0 and "uptime_s" in json.loads(out)
        rc, _, err = stats("--tls-ca", str(tmp_path / "missing.pem"))
        assert rc == 2 and err == "redraft stats: error: TLS file not found: " \
                                  f"{tmp_path / 'missing.pem'}\n"
        rc, _, err = stats("--tls-ca", cert, "--token", "a", "--token-file", str(secret))
        assert rc == 2 and "give --token or --token-file, not both" in err
        rc, _, err = stats("--tls-ca", cert, "--token", "sécret")
        assert rc == 2 and "--token: a token must be printable ASCII" in err
        two = tmp_path / "two"
        two.write_text("a\nb\n")
        rc, _, err = stats("--tls-ca", cert, "--token-file", str(two))
        assert rc == 2 and "holds 2 tokens; a client sends one" in err


def test_stats_label_each_workers_learned_outputs(tmp_path, servers, until):
    """Each worker has its own learned index (the outputs of all, once synced): `Stats`
    reports the answering worker's sizes (with its pid) and every worker's under
    `learned_per_worker`, whichever worker answers; never one worker's as another's."""
    store = str(tmp_path / "ds")  # nothing learned before
    build_datastore(None, store, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    port = servers.free_port()
    serve = servers.start(store, "--port", str(port), "--workers", "2",
                          "--learn-persist-seconds", "0")
    by_pid: dict[int, DraftClient] = {}
    clients = []
    while len(by_pid) < 2 and len(clients) < 40:
        c = DraftClient(serve.address, own_connection=True)
        clients.append(c)
        by_pid.setdefault(c.stats()["pid"], c)
    assert len(by_pid) == 2
    for n, pid in enumerate(sorted(by_pid)):  # one output learned on each worker
        with by_pid[pid].session(DOCS[n][:20], DraftParams(budget=8), FP,
                                 tenant=f"t{n}") as s:
            for i in range(20, 20 + 30 * (n + 1), 3):
                s.step(DOCS[n][i:i + 3])

    def synced() -> bool:  # each worker holds both outputs
        return all(w["learned_docs"] == 2 for c in by_pid.values()
                   for w in c.stats()["learned_per_worker"])

    until(synced)
    for pid, c in by_pid.items():
        st = c.stats()
        per_worker = {w["pid"]: w for w in st["learned_per_worker"]}
        assert st["pid"] == pid and sorted(per_worker) == sorted(by_pid)
        for name in ("learned_tokens", "learned_docs", "learned_pools"):
            assert st[name] == per_worker[pid][name]  # the top level is the answering one's
    for c in clients:
        c.close()
    assert serve.stop() == 0


@pytest.mark.parametrize("signum, workers", [
    (signal.SIGHUP, "1"), (signal.SIGINT, "1"), (signal.SIGHUP, "2"),
], ids=["sighup", "sigint", "sighup-2-workers"])
def test_sighup_and_sigint_stop_serve_as_sigterm_does(tmp_path, servers, signum, workers):
    """A closed terminal (SIGHUP) or a Ctrl-C (SIGINT): the server stops gracefully, says
    so, and persists what it learned, whether one process or several."""
    store = str(tmp_path / "ds")
    build_datastore(None, store, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    serve = servers.start(store, "--port", str(servers.free_port()), "--workers", workers,
                          "--learn-persist-seconds", "300")
    learned = [RNG.randrange(1, VOCAB) for _ in range(40)]
    with DraftClient(serve.address, timeout=10) as c:
        with c.session(DOCS[4][:20], DraftParams(budget=8), FP, tenant="alice") as s:
            for i in range(0, len(learned), 4):
                s.step(learned[i:i + 4])
    serve.proc.send_signal(signum)
    assert serve.proc.wait(30) == 0
    assert serve.rest_of_stdout().count("redraft serve: stopped") == int(workers)
    with Reader(store) as r:
        docs = list(r.documents("learned"))
    assert len(docs) == 1 and docs[0][1] == "t:alice"
    assert docs[0][2][-len(learned):] == learned


_HUGE_CLIENT = r"""
import random, sys
from redraft.datastore.service.client import DraftClient, DraftParams

address, fp, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(9)
huge = [rng.randrange(1, vocab) for _ in range(131_000)]
with DraftClient(address, timeout=60) as c:
    with c.session(huge[:20], DraftParams(budget=8), fp) as s:
        s.step(huge)  # one step of 131,000 tokens
        assert s.context_len == 20 + len(huge)
    with c.session(huge, DraftParams(budget=8), fp) as s:  # and a prompt of as many
        assert s.context_len == len(huge)
print("done")
"""


def test_a_huge_step_does_not_stall_other_sessions(store, servers):
    """A real server: while another process sends a 131,000-token step (and opens a session
    with a 131,000-token prompt), this one's health checks and session steps stay fast."""
    serve = servers.start(store, "--port", "0", "--learn-persist-seconds", "0")
    latencies: list[float] = []
    with DraftClient(serve.address, timeout=30) as c, \
            grpc.insecure_channel(serve.address) as ch, \
            c.session(DOCS[5][:20], DraftParams(budget=8), FP) as s:
        health = health_pb2_grpc.HealthStub(ch)
        before = c.stats()["requests"]
        huge = subprocess.Popen([sys.executable, "-c", _HUGE_CLIENT, serve.address, FP,
                                 str(VOCAB)], stdout=subprocess.PIPE, text=True)
        i = 20
        while huge.poll() is None:
            t0 = time.monotonic()
            health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            s.step([DOCS[5][i % len(DOCS[5])]])
            latencies.append(time.monotonic() - t0)
            i += 1
        assert huge.wait(60) == 0 and huge.stdout.read() == "done\n"
        assert c.stats()["requests"] - before >= len(latencies) + 3  # theirs too
    # the huge requests took a while; every check and step meanwhile was quick
    assert len(latencies) >= 10 and max(latencies) < 0.5, latencies
    assert serve.stop() == 0
