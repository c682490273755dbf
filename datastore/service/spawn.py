"""`redraft serve` as a child process: started, waited on until every worker listens,
followed (its output lines as they come), and stopped by signal or killed with every worker
it started.

Why one of these: the tests, the benchmarks and the GPU check each need a real server
process, and each copy of the start-up once got a detail wrong (reading stdout without
draining stderr, which fills its pipe and stalls the server; killing the parent but not its
workers; waiting for one "listening" line from a server of several workers). In-process
servers are `server.ServerThread`.

    with ServeProcess("data/stdlib", ("--port", "0", "--workers", "2")) as serve:
        DraftClient(serve.address)          # serve.addresses: one per worker
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO


def free_port() -> int:
    """A loopback port free now, for a server told its port up front (`--workers` > 1
    needs one: the workers share it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeFailed(RuntimeError):
    """The server exited, or said nothing, before every worker listened."""


class ServeProcess:
    """One `redraft serve` process group (the server and any worker it starts): its stdout
    lines as they come (`lines`; "" once it closed), its stderr kept (`stderr`), the
    address each worker announced. `log`: a file that gets both streams as well."""

    def __init__(self, store: str, extra: Sequence[str] = (), env: dict | None = None,
                 timeout: float = 60.0, log: str | Path | None = None) -> None:
        extra = tuple(extra)
        self.workers = int(extra[extra.index("--workers") + 1]) if "--workers" in extra else 1
        self.command = [sys.executable, "-m", "redraft.decoder.cli", "serve", "--datastore",
                        str(store), *extra]
        self._log: IO[str] | None = open(log, "w") if log is not None else None
        self._log_lock = threading.Lock()
        self.proc = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env={**os.environ, **(env or {})},
        )
        self.pid = self.proc.pid
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self._stderr: list[str] = []
        self._drains = [threading.Thread(target=self._drain_stdout, daemon=True),
                        threading.Thread(target=self._drain_stderr, daemon=True)]
        for t in self._drains:
            t.start()
        self.addresses: list[str] = []
        self.metrics_url: str | None = None  # with --metrics-port: http://HOST:PORT
        try:
            self._wait_listening(timeout)
        except BaseException:
            self.kill()
            raise
        self.address = self.addresses[0]

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.addresses) < self.workers:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if not line:
                why = "exited" if line == "" else f"said nothing for {timeout:g} s"
                self.kill()
                for t in self._drains:  # the rest of its stderr, for the message
                    t.join(5)
                raise ServeFailed(f"serve did not start ({why}): {self.stderr}")
            if "listening on" in line:
                self.addresses.append(line.split("listening on ")[1].strip())
            elif "probes and metrics at " in line:
                self.metrics_url = line.split(" at ")[1].split()[0]

    def _copy(self, line: str) -> None:
        if self._log is not None:
            with self._log_lock:
                self._log.write(line)
                self._log.flush()

    def _drain_stdout(self) -> None:
        for line in self.proc.stdout:
            self._copy(line)
            self.lines.put(line)
        self.lines.put("")

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self._copy(line)
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, and the exit status once it has stopped (its output read to the end)."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        for t in self._drains:
            t.join(5)
        return code

    def kill(self) -> None:
        """SIGKILL to the server and any worker it started (they share its group)."""
        try:  # the group, even when the server is gone: a worker may outlive it
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def close(self, grace: float = 10) -> None:
        """Stop it whatever state it is in: SIGTERM to the group (workers persist what they
        learned), SIGKILL after `grace` seconds; its log closed."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()
        if self._log is not None:
            for t in self._drains:
                t.join(5)
            self._log.close()
            self._log = None

    def rest_of_stdout(self) -> str:
        out = []
        while (line := self.lines.get(timeout=10)) != "":
            out.append(line)
        return "".join(out)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
