"""redraft inside a real vLLM engine: vLLM's CPU build, in its own environment
(`make vllm-env`: `.venv-vllm`, with the default model as a Hugging Face folder), runs
`RedraftProposer` as its `custom_class` speculative method, drafting from a real
`redraft serve` on a loopback port or from a datastore opened in the engine's process.

Each engine runs in `vllm_engine_driver.py` under vLLM's Python (vLLM's engine core in a
process of its own, as vLLM runs it). Greedy output must be vLLM's own plain greedy output,
token for token, one request at a time and all at once, and with the service SIGKILLed
mid-generation; the service gets at most one Batch call per engine step, and a request's
sequence ends once the engine has finished it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from redraft.datastore import build_datastore

from ..conftest import have_default_model
from .conftest import QUESTIONS, chat_ids

ROOT = Path(__file__).resolve().parents[3]
VLLM_VENV = Path(os.environ.get("REDRAFT_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
HF_MODEL = VLLM_VENV / "models" / "smollm2-135m"
DRIVER = Path(__file__).with_name("vllm_engine_driver.py")
MAX_TOKENS = 48
ENGINE_TIMEOUT_S = 420  # an engine starts in about a minute on two cores

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (VLLM_PYTHON.exists() and HF_MODEL.exists()),
                       reason="vLLM's environment not built (make vllm-env)"),
    pytest.mark.skipif(not have_default_model(), reason="default model not installed"),
]


def tcmalloc() -> str | None:
    """The tcmalloc library vLLM's CPU backend asks to have preloaded, if installed."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "libtcmalloc_minimal.so.4" in line and "=>" in line:
            return line.split("=>")[1].strip()
    return None


class Engine:
    """One vLLM engine process running the driver."""

    def __init__(self, method: str, prompts: list[list[int]], phases: list[str],
                 env: dict | None = None, **extra) -> None:
        args = {"model": str(HF_MODEL), "method": method, "prompts": prompts,
                "max_tokens": MAX_TOKENS, "phases": phases, **extra}
        environ = {k: v for k, v in os.environ.items() if not k.startswith("REDRAFT_")}
        environ.update(env or {})
        environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the driver's collective_rpc
        if lib := tcmalloc():
            environ["LD_PRELOAD"] = lib
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(DRIVER), json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=environ,
                                     start_new_session=True)
        self.log: list[str] = []

    def until(self, marker: str) -> str:
        """Lines until one starting with `marker`; the engine's output if it ends first."""
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith(marker):
                return line
        self.proc.wait(30)
        raise AssertionError(f"vLLM engine ended (rc {self.proc.returncode}) before "
                             f"{marker!r}:\n{''.join(self.log[-60:])}")

    def go_on(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        line = self.until("RESULT ")
        self.proc.wait(60)
        return json.loads(line[len("RESULT "):])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(30)


def run_engine(method: str, prompts, phases, env=None, **extra) -> dict:
    engine = Engine(method, prompts, phases, env, **extra)
    try:
        return engine.result()
    finally:
        engine.kill()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from redraft.proto.models import load_tokenizer

    tokenizer = load_tokenizer(None)
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(prompts) -> dict:
    """vLLM's own greedy output, no speculation: the reference."""
    return run_engine("plain", prompts, ["one", "all"])


@pytest.fixture(scope="module")
def code_datastore(tmp_path_factory) -> str:
    """A small code datastore (a few standard-library modules) to retrieve from."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = str(tmp_path_factory.mktemp("vllm") / "code")
    files = [str(stdlib / "json" / "encoder.py"), str(stdlib / "collections" / "__init__.py"),
             str(stdlib / "functools.py"), str(stdlib / "string.py")]
    build_datastore(files, out, tokenizer="smollm2-135m", corpus="code")
    return out


def test_plain_vllm_is_deterministic_across_batching(plain):
    """The reference itself: vLLM's greedy output alone and batched agree, so a difference
    below is the proposer's, not batching's."""
    assert plain["outputs"]["one"] == plain["outputs"]["all"]
    assert all(len(ids) == MAX_TOKENS for ids in plain["outputs"]["one"])


def test_service_drafts_inside_vllm_losslessly_and_survive_its_death(plain, prompts,
                                                                     code_datastore, servers):
    serve = servers.start(code_datastore, "--port", str(servers.free_port()),
                          "--learn-persist-seconds", "0")
    engine = Engine("redraft", prompts, ["one", "all", "wait", "killed"],
                    env={"REDRAFT_SERVICE": serve.address}, kill_pid=serve.pid,
                    kill_after_s=0.5)
    try:
        engine.until("WAITING")
        stats = json.loads(subprocess.run(
            [sys.executable, "-m", "redraft.decoder.cli", "stats", "--server", serve.address],
            capture_output=True, text=True, check=True).stdout)
        engine.go_on()
        result = engine.result()
    finally:
        engine.kill()
    assert serve.proc.wait(30) == -9  # the service really died mid-run
    assert result["outputs"]["one"] == plain["outputs"]["one"]
    assert result["outputs"]["all"] == plain["outputs"]["all"]
    assert result["outputs"]["killed"] == plain["outputs"]["all"]
    (proposer,) = result["proposer"]
    assert proposer["drafted_tokens"] > 0 and proposer["errors"] == 0
    # At most one Batch call per engine step, read before the service was killed (the
    # proposer's steps then include those of the killed phase, so the bound is loose
    # only upward).
    assert 0 < stats["batch_calls"] <= proposer["steps"]
    # Every request's sequence was opened once; the finished ones were ended (only the last
    # batch's may still be open: nothing has stepped since it finished).
    assert stats["sessions_opened"] == 2 * len(prompts)
    assert stats["sessions_active"] <= len(prompts)
    assert stats["learned_docs"] >= len(prompts)


def test_in_process_datastore_drafts_inside_vllm_losslessly(plain, prompts, code_datastore):
    result = run_engine("redraft", prompts, ["one", "all"],
                        env={"REDRAFT_DATASTORE": code_datastore})
    assert result["outputs"] == plain["outputs"]
    (proposer,) = result["proposer"]
    assert proposer["drafted_tokens"] > 0 and proposer["errors"] == 0
