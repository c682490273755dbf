"""Shared by every test folder: `redraft serve` as real subprocesses (started, followed,
stopped by signal or killed), free ports, waiting for a condition, a self-signed TLS
certificate for a loopback server, the fork server the corruption fuzzers run commands in,
and a private cache folder for every test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redraft.datastore.service.spawn import ServeProcess, free_port

# One `redraft serve` process group, started as the tools start theirs (`spawn`).
Serve = ServeProcess


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


# What the cache holds converted from the default model's GGUF file: the same for every
# test, and costly to make again (the dense weights ~20 s and 0.5 GB, the tokenizer ~7 s).
CONVERTED = ("models", "tokenizers")


def private_cache(folder: Path, converted: Path) -> Path:
    """A cache folder (for $REDRAFT_CACHE) whose converted models and tokenizers are those
    under `converted`: a test may start from an empty cache without converting again."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in CONVERTED:
        (converted / name).mkdir(parents=True, exist_ok=True)
        if not (folder / name).exists():
            (folder / name).symlink_to(converted / name, target_is_directory=True)
    return folder


@pytest.fixture(scope="session")
def shared_converted(tmp_path_factory) -> Path:
    """Converted models and tokenizers for the whole run, every xdist worker alike (two
    workers converting at once cost time, not correctness: an entry is published by one
    rename)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "converted"


@pytest.fixture()
def fresh_cache(tmp_path, shared_converted) -> Path:
    """An empty cache folder but for what is converted from the default model."""
    return private_cache(tmp_path / "cache", shared_converted)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, shared_converted, monkeypatch):
    """Cost curves and other caches go to a per-session folder, never the user's."""
    folder = private_cache(tmp_path_factory.getbasetemp() / "redraft-cache", shared_converted)
    monkeypatch.setenv("REDRAFT_CACHE", str(folder))


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


@pytest.fixture(scope="session")
def tls_cert(tmp_path_factory) -> tuple[str, str]:
    """(certificate, key) PEM files for localhost and 127.0.0.1, made by the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


_FORK_SERVER = r"""
import io, json, os, resource, signal, sys, time, traceback
from redraft.decoder.cli import main

exec(sys.argv[1])  # the warm-up: what every fork inherits (imports, a loaded tokenizer or model)
channel = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, req["out"]), (2, req["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False))
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False))
        if req["memory"]:  # address space beyond what the fork starts with
            with open("/proc/self/status") as status:
                vm = next(int(x.split()[1]) for x in status if x.startswith("VmSize:")) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (vm + req["memory"], vm + req["memory"]))
        try:
            rc = main(req["argv"])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    deadline = time.monotonic() + req["timeout"]
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            done = None
            break
        time.sleep(0.002)
    rc = None if done is None else os.waitstatus_to_exitcode(done[1])
    channel.write(json.dumps({"rc": rc}) + "\n")
    channel.flush()
"""


class ForkServer:
    """Runs `redraft` command lines, each in a fresh fork of one warmed-up process (a fresh
    interpreter per command would cost seconds): the corruption fuzzers' harness.

    `warm_up` is Python run once before the first fork; `memory` (bytes), if given, caps
    each fork's address space beyond what it starts with, so unbounded allocation fails
    there (as a traceback, which the fuzzers refuse) instead of exhausting the machine.
    """

    def __init__(self, workdir: Path, warm_up: str, timeout_s: float,
                 memory: int | None = None, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.timeout_s = timeout_s
        self.memory = memory
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, warm_up],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)

    def run(self, *argv) -> tuple[int | None, str, str]:
        """(exit status, or -signal, or None after a hang; stdout; stderr)."""
        out, err = self.workdir / "out", self.workdir / "err"
        req = {"argv": [str(a) for a in argv], "out": str(out), "err": str(err),
               "timeout": self.timeout_s, "memory": self.memory}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)["rc"], out.read_text(errors="replace"), \
            err.read_text(errors="replace")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def flip_byte(path, offset: int, mask: int = 0x10) -> None:
    """XOR one byte of a file in place (damage a test then expects to be found)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def structural_flip(data: bytearray, offsets: dict[str, list[int]], i: int, rng) -> str:
    """Flip one byte at an offset of the `i`-th kind in turn (a whole byte, one bit, or a
    random mask); what was done, for the fuzzers' messages."""
    kinds = sorted(offsets)
    kind = kinds[i % len(kinds)]
    off = int(rng.choice(offsets[kind]))
    mask = int(rng.choice([0xFF, 1 << int(rng.integers(8)), int(rng.integers(1, 256))]))
    data[off] ^= mask
    return f"{kind} flip at {off} (^{mask:#x})"
