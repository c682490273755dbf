"""redraft inside a real vLLM engine: vLLM's CPU build, in its own environment
(`make vllm-env`: `.venv-vllm`, with the default model as a Hugging Face folder), runs
`RedraftProposer` as its `custom_class` speculative method, drafting from a real
`redraft serve` on a loopback port or from a datastore opened in the engine's process.

The reference is vLLM's own plain greedy output from its OpenAI-compatible API server (how
users run vLLM), each prompt alone and all at once. Each engine under test runs in
`vllm_engine_driver.py` under vLLM's Python (vLLM's engine core in a process of its own, as
vLLM runs it), or is the API server again with RedraftProposer, driven by the `openai`
client. Greedy output must be the reference token for token, one request at a time and all
at once, and with the service SIGKILLed mid-generation; the service gets at most one Batch
call per engine step, and a request's sequence ends once the engine has finished it; vLLM's
and the service's Prometheus counters both count the accepted drafts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from redraft.datastore import build_datastore
from redraft.datastore.service.spawn import free_port

from ..conftest import have_default_model
from .conftest import QUESTIONS, chat_ids
from .vllm_server import (
    HF_MODEL,
    MODEL_NAME,
    REDRAFT_SPEC,
    VLLM_PYTHON,
    ApiServer,
    scrape,
    total,
    vllm_environ,
)

DRIVER = Path(__file__).with_name("vllm_engine_driver.py")
MAX_TOKENS = 48

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (VLLM_PYTHON.exists() and HF_MODEL.exists()),
                       reason="vLLM's environment not built (make vllm-env)"),
    pytest.mark.skipif(not have_default_model(), reason="default model not installed"),
]


class Engine:
    """One vLLM engine process running the driver."""

    def __init__(self, method: str, prompts: list[list[int]], phases: list[str],
                 env: dict | None = None, **extra) -> None:
        args = {"model": str(HF_MODEL), "method": method, "prompts": prompts,
                "max_tokens": MAX_TOKENS, "phases": phases, **extra}
        environ = vllm_environ(env)
        environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the driver's collective_rpc
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


def complete(client, prompt: list[int], stream: bool = False) -> tuple[str, list[int]]:
    """A greedy completion of `prompt` (token ids): its text and, unstreamed, its ids."""
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                      max_tokens=MAX_TOKENS, stream=stream,
                                      extra_body={"return_token_ids": True})
    if stream:
        return "".join(c.choices[0].text for c in reply if c.choices), []
    return reply.choices[0].text, list(reply.choices[0].token_ids)


def chat(client, question: str, stream: bool = False) -> str:
    """A greedy chat answer to `question`, as its text."""
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=MAX_TOKENS, stream=stream)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def plain(prompts) -> dict:
    """vLLM's own greedy output, no speculation, from its API server: the reference. Each
    prompt's token ids alone and all at once (`outputs`: "one", "all"), their texts, and
    the chat answers to the first two questions. The server is stopped once read."""
    server = ApiServer(free_port())
    try:
        server.wait_ready()
        client = server.client()
        one = [complete(client, p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            every = list(pool.map(lambda p: complete(client, p), prompts))
        chats = {q: chat(client, q) for q in QUESTIONS[:2]}
    finally:
        server.close()
    return {"outputs": {"one": [ids for _, ids in one], "all": [ids for _, ids in every]},
            "texts": [text for text, _ in one], "chat": chats}


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


def counted(server: ApiServer, serve, timeout: float = 60) -> tuple[list, list]:
    """vLLM's and the service's /metrics once both count accepted drafts, the proposer's
    own counters on vLLM's too (the service publishes its counts every 0.1 s, the proposer
    every second; vLLM's frontend records each step's as it reads it), or as they are after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        engine, service = scrape(server.url), scrape(serve.metrics_url)
        if (total(engine, "vllm:spec_decode_num_accepted_tokens_total") > 0
                and total(engine, "redraft:adapter_spec_decode_num_accepted_tokens_total") > 0
                and total(service, "redraft:spec_decode_num_accepted_tokens_total") > 0) \
                or time.monotonic() > deadline:
            return engine, service
        time.sleep(0.5)


@pytest.mark.timeout(600)  # the server's start is waited for up to 420 s on a busy machine
def test_openai_server_with_the_proposer_answers_as_plain_vllm(plain, prompts, code_datastore,
                                                               servers, tmp_path):
    """vLLM's OpenAI-compatible server as users run it, RedraftProposer drafting from a real
    `redraft serve`: chat, completions and streams, from one client and from two at once,
    each the plain server's greedy answer; both /metrics count accepted drafts, vLLM's
    the proposer's own counters too (prometheus_client's multiprocess mode, which vLLM's
    /metrics reads when PROMETHEUS_MULTIPROC_DIR is set)."""
    serve = servers.start(code_datastore, "--port", "0", "--metrics-port", "0",
                          "--learn-persist-seconds", "0")
    # Every row gets its whole chain, whatever the busy machine's step times say (pacing is
    # test_vllm_pacing.py's), and a slow reply is waited for rather than drafted by prompt
    # lookup: the counts below then never depend on the machine's load.
    server = ApiServer(servers.free_port(), REDRAFT_SPEC,
                       env={"REDRAFT_SERVICE": serve.address, "REDRAFT_ADAPTIVE": "0",
                            "REDRAFT_TIMEOUT": "10", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    first, second = QUESTIONS[:2]
    try:
        server.wait_ready()
        client = server.client()
        answers = {"chat": chat(client, first), "completion": complete(client, prompts[0]),
                   "chat stream": chat(client, first, stream=True)}
        # Two clients at once: their requests share the engine's steps (two rows a Batch).
        start = threading.Barrier(2)

        def at_once(job):
            start.wait(30)
            return job(server.client())

        with ThreadPoolExecutor(2) as pool:
            streamed, chatted = pool.map(at_once, [
                lambda c: complete(c, prompts[1], stream=True), lambda c: chat(c, second)])
        engine, service = counted(server, serve)
    finally:
        server.close()
    assert answers["chat"] == plain["chat"][first]
    assert answers["completion"] == (plain["texts"][0], plain["outputs"]["one"][0])
    assert answers["chat stream"] == plain["chat"][first]
    assert streamed[0] == plain["texts"][1]
    assert chatted == plain["chat"][second]
    # vLLM's own counters: steps drafted, draft tokens, accepted tokens, the first position.
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert total(engine, f"vllm:spec_decode_{name}_total") > 0, name
    assert total(engine, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    # The proposer's own counters, from the engine core process, on vLLM's /metrics.
    assert total(engine, "redraft:adapter_spec_decode_num_accepted_tokens_total",
                 engine="vllm") > 0
    # The service's, from what the proposer reported back: Batch calls, accepted tokens.
    assert total(service, "redraft:batch_call_seconds_count") > 0
    assert total(service, "redraft:spec_decode_num_accepted_tokens_total") > 0
    assert total(service, "redraft:spec_decode_num_accepted_tokens_per_pos_total",
                 position="0") > 0


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
