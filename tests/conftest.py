"""Shared by every test folder: `redraft serve` as real subprocesses (started, followed,
stopped by signal or killed), free ports, waiting for a condition."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """One `redraft serve` process group: its stdout lines as they come, its stderr kept."""

    def __init__(self, store: str, extra: tuple[str, ...], env: dict | None = None) -> None:
        self.workers = int(extra[extra.index("--workers") + 1]) if "--workers" in extra else 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "redraft.decoder.cli", "serve", "--datastore", store,
             *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.pid = self.proc.pid
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self._stderr: list[str] = []
        threading.Thread(target=self._drain_stdout, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr),
                         daemon=True).start()
        self.addresses: list[str] = []
        while len(self.addresses) < self.workers:
            try:
                line = self.lines.get(timeout=30)
            except queue.Empty:
                line = ""
            if not line:
                self.kill()
                raise AssertionError(f"serve did not start: {self.stderr}")
            if "listening on" in line:
                self.addresses.append(line.split("listening on ")[1].strip())
        self.address = self.addresses[0]

    def _drain_stdout(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, and the exit status once it has stopped."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL to the server and any worker it started (they share its group)."""
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def rest_of_stdout(self) -> str:
        out = []
        while (line := self.lines.get(timeout=10)) != "":
            out.append(line)
        return "".join(out)


class Servers:
    """Starts `redraft serve` processes for one test and kills any left at its end."""

    def __init__(self) -> None:
        self.started: list[Serve] = []

    def start(self, store: str, *extra: str, env: dict | None = None) -> Serve:
        serve = Serve(store, extra, env)
        self.started.append(serve)
        return serve

    free_port = staticmethod(free_port)

    def close(self) -> None:
        for s in self.started:
            s.kill()


@pytest.fixture()
def servers():
    s = Servers()
    yield s
    s.close()


def wait_until(condition, timeout: float = 30.0, step: float = 0.02) -> float:
    """Seconds until `condition()` held; fails after `timeout`."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        time.sleep(step)
    return time.monotonic() - t0


@pytest.fixture()
def until():
    return wait_until
