"""`spawn.ServeProcess`, the one way the tests and the tools start `redraft serve`: a real
server of two workers is up once both listen, its output comes as lines and into a log, and
closing it leaves no process of its group; a server that cannot start is a `ServeFailed`
that carries its own error line, with nothing left running."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from redraft.datastore import build_datastore
from redraft.datastore.service.client import DraftClient
from redraft.datastore.service.spawn import ServeFailed, ServeProcess

FP = "sha256:spawn-test"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("spawn") / "ds")
    build_datastore(None, path, documents=[[1, 2, 3, 4, 5] * 8, [6, 7, 8] * 9],
                    fingerprint=FP, vocab_size=16, corpus="c")
    return path


def _group(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies are gone already)."""
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def test_two_workers_listen_log_and_all_go_on_close(store, tmp_path, servers, until):
    log = tmp_path / "serve.log"
    port = str(servers.free_port())
    with ServeProcess(store, ("--port", port, "--workers", "2"), log=log) as serve:
        assert len(serve.addresses) == 2 and serve.address == serve.addresses[0]
        with DraftClient(serve.address, timeout=30) as c:
            assert c.info().tokenizer_fingerprint == FP
        assert len(_group(serve.pid)) >= 3  # the server and its two workers
        assert serve.command[1:4] == ["-m", "redraft.decoder.cli", "serve"]
    assert serve.proc.returncode is not None
    until(lambda: _group(serve.pid) == [], timeout=10)  # a SIGKILLed one dies in a moment
    assert log.read_text().count("listening on") == 2


def test_stop_is_sigterm_and_its_output_is_read_to_the_end(store, until):
    serve = ServeProcess(store, ("--port", "0"))
    try:
        assert serve.stop() == 0  # a clean shutdown on SIGTERM
        assert serve.rest_of_stdout() == "redraft serve: stopped\n"  # stopped gracefully
    finally:
        serve.kill()
    until(lambda: _group(serve.pid) == [], timeout=10)


def test_a_server_that_cannot_start_carries_its_own_error(tmp_path):
    missing = str(tmp_path / "none")
    with pytest.raises(ServeFailed) as info:
        ServeProcess(missing, ("--port", "0"))
    assert str(info.value) == (f"serve did not start (exited): redraft serve: error: {missing}: "
                               "no such datastore\n")


def test_a_server_silent_past_its_timeout_is_killed(store):
    """SIGSTOP right after it starts: it never announces its address, and is killed (the
    stop does not shield it from SIGKILL)."""

    class Stopped(ServeProcess):
        def _wait_listening(self, timeout: float) -> None:
            os.kill(self.pid, signal.SIGSTOP)
            super()._wait_listening(timeout)

    with pytest.raises(ServeFailed, match=r"said nothing for 2 s"):
        Stopped(store, ("--port", "0"), timeout=2)
