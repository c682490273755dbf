"""`redraft serve`'s arguments into its config: the defaults that depend on the machine;
and its workers: one killed is restarted (a real server on a real port)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal

from redraft.datastore.service.config import MAX_AUTO_BATCH_THREADS
from redraft.datastore.service.serve_cli import config_from_args, register


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", "--datastore", "ds", *argv])


def test_batch_threads_default_shares_this_processs_cores_among_its_workers():
    cores = len(os.sched_getaffinity(0))
    for workers in (1, 2, 3, 1024):
        config = config_from_args(parse("--port", "5000", "--workers", str(workers)))
        assert config.batch_threads == max(1, min(MAX_AUTO_BATCH_THREADS, cores // workers))
    assert config_from_args(parse("--batch-threads", "3")).batch_threads == 3


def test_a_worker_killed_is_restarted_and_the_server_keeps_serving(tmp_path, servers, until):
    """`--workers 2`, one worker SIGKILLed as the OOM killer would: before, the whole
    service stopped with status 1. Now a worker takes its place, the slots its sessions held
    are given back, what it learned is persisted, and the server stops cleanly later."""
    import psutil
    from redraft.datastore import Reader, build_datastore
    from redraft.datastore.learned_log import list_logs, read_log
    from redraft.datastore.service.client import DraftClient, DraftParams

    fp, docs = "sha256:workers", [[(7 * i + j) % 400 + 1 for j in range(60)] for i in range(8)]
    store = str(tmp_path / "ds")
    build_datastore(None, store, documents=docs, fingerprint=fp, vocab_size=500)
    serve = servers.start(store, "--port", str(servers.free_port()), "--workers", "2",
                          "--learn-persist-seconds", "600", "--max-sessions", "4")
    by_pid: dict[int, DraftClient] = {}
    clients = []
    try:
        while len(by_pid) < 2 and len(clients) < 40:  # the kernel spreads connections
            c = DraftClient(serve.address, own_connection=True, reconnect=False)
            clients.append(c)
            by_pid.setdefault(c.stats()["pid"], c)
        (doomed, on_doomed), (_, on_other) = by_pid.items()
        held = [on_doomed.session(docs[0][:10], DraftParams(budget=4), fp, tenant="t")
                .__enter__() for _ in range(2)]
        held[0].step(docs[0][10:30])
        held[0].close()  # an output of the doomed worker, final in its log
        until(lambda: any(o.final for log in list_logs(store)
                          for o in read_log(log)[0].values()))
        kept = on_other.session(docs[1][:10], DraftParams(budget=4), fp).__enter__()
        assert on_other.stats()["sessions_active"] == 2
        os.kill(doomed, signal.SIGKILL)
        until(lambda: "in its place" in serve.stderr, timeout=30)
        assert psutil.Process(serve.pid).is_running()
        st = on_other.stats()
        assert st["worker_restarts"] == 1 and st["sessions_active"] == 1  # `kept` alone
        kept.step(docs[1][10:12])
        with DraftClient(serve.address) as fresh:  # every slot but kept's is free again
            sessions = [fresh.session(docs[2][:10], None, fp).__enter__() for _ in range(3)]
            for s in sessions:
                s.close()
        kept.close()
    finally:
        for c in clients:
            c.close()
    assert serve.stop() == 0, serve.stderr
    said = [line for line in serve.stderr.splitlines() if "in its place" in line]
    assert len(said) == 1 and "SIGKILL" in said[0] and "1 session(s)" in said[0], said
    with Reader(store) as r:  # the dead worker's output, persisted by the others
        assert "t:t" in {name for _, name, _ in r.documents("learned")}


def test_workers_that_keep_dying_stop_the_server_with_one_line(tmp_path, servers):
    import time

    import psutil
    from redraft.datastore import build_datastore
    from redraft.datastore.service.serve_cli import RESTART_LIMIT

    store = str(tmp_path / "ds")
    build_datastore(None, store, documents=[[1, 2, 3]], fingerprint="sha256:x", vocab_size=9)
    serve = servers.start(store, "--port", str(servers.free_port()), "--workers", "2")
    parent = psutil.Process(serve.pid)
    killed: set[int] = set()
    deadline = time.monotonic() + 60
    while serve.proc.poll() is None:  # every worker killed as soon as it exists
        assert time.monotonic() < deadline, serve.stderr
        for child in parent.children():
            with contextlib.suppress(psutil.Error):  # gone meanwhile
                if child.pid not in killed and "spawn_main" in " ".join(child.cmdline()):
                    killed.add(child.pid)  # a worker (not the resource tracker)
                    child.send_signal(signal.SIGKILL)
        time.sleep(0.01)
    assert serve.proc.wait() == 1
    assert len(killed) >= RESTART_LIMIT + 1
    (said,) = [line for line in serve.stderr.splitlines() if "giving up" in line]
    assert f"{RESTART_LIMIT + 1} workers died within 60 s" in said
