"""llama-cpp-python with `RedraftDraft`: greedy output identical to plain llama-cpp-python.

The engine is the real one: `Llama.generate` (llama_cpp/llama.py) calls the draft model with
the whole sequence after every forward and verifies the returned chain; these tests drive it
exactly as a user does, on the default model's GGUF, one thread, flash attention on.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from redraft.datastore import TokenizerMismatch, build_datastore
from redraft.datastore.service.client import DraftClient
from redraft.proto.errors import DatastoreNotFound, ModelNotFound

from ...conftest import free_port
from ..conftest import have_default_model

llama_cpp = pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed")

from redraft.decoder.engines.llama_cpp import (  # noqa: E402
    Llama,
    RedraftDraft,
    model_path,
)
from redraft.decoder.engines.streams import EngineConfigError  # noqa: E402

pytestmark = pytest.mark.skipif(not have_default_model(), reason="default model not installed")

QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python class for a stack with push and pop methods.",
    "Explain in two sentences what a hash table is.",
]
NEW_TOKENS = 40
LLAMA_ARGS = dict(n_ctx=1024, n_threads=1, n_threads_batch=1, verbose=False, seed=0)


# Run in a fresh interpreter: a crash in llama.cpp's native code (SIGSEGV) then fails this
# test with what the engine reports about the CPU, instead of killing the pytest worker.
_DECODE = """
import json, llama_cpp
from redraft.decoder.engines.llama_cpp import model_path
llm = llama_cpp.Llama(model_path=model_path(), n_ctx=256, n_threads=1, n_threads_batch=1,
                      verbose=False, seed=0)
out = llm.create_completion("def fib(n):", max_tokens=16, temperature=0.0)
print(json.dumps(out["choices"][0]["text"]))
"""


def test_the_engine_is_built_without_amx_and_decodes_the_gguf():
    """`make install` builds llama-cpp-python without llama.cpp's AMX code: on some AMX CPUs
    it dies with SIGSEGV in the first decode of the default GGUF (ggml_backend_amx_mul_mat,
    llama.cpp issue 20824). First in this file, so a crash is reported here and named."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "AMX_INT8 = 1" not in info, (
            f"llama-cpp-python was built with llama.cpp's AMX code (rebuild it with `make "
            f"install`): {info}")
    proc = subprocess.run([sys.executable, "-c", _DECODE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (
        f"greedy decoding of the default GGUF exited with {proc.returncode} (a negative "
        f"number is the signal); the engine reports: {info}\n{proc.stderr[-2000:]}")
    text = json.loads(proc.stdout.strip().splitlines()[-1])
    assert text.strip(), f"no text decoded; the engine reports: {info}"


def chat(llm, question: str) -> list[int]:
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def greedy(llm, prompt: list[int], n: int = NEW_TOKENS, after=None) -> list[int]:
    """Greedy tokens from llama-cpp-python's own generation loop (a fresh context each time,
    so every run evaluates its prompt the same way). `after(k)` runs after the k-th token."""
    llm.reset()
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0):
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            break
        out.append(int(token))
        if after is not None:
            after(len(out))
        if len(out) >= n:
            break
    return out


@pytest.fixture(scope="module")
def plain():
    return llama_cpp.Llama(model_path=model_path(), flash_attn=True, **LLAMA_ARGS)


@pytest.fixture(scope="module")
def answers(plain) -> dict[str, list[int]]:
    return {q: greedy(plain, chat(plain, q)) for q in QUESTIONS}


@pytest.fixture(scope="module")
def store(tmp_path_factory, plain, answers) -> str:
    """A datastore whose corpus overlaps the answers: three of the four plain answers (the
    last question is left out, so its drafts come from prompt lookup alone) and two
    unrelated documents."""
    docs = tmp_path_factory.mktemp("corpus")
    for i, q in enumerate(QUESTIONS[:3]):
        (docs / f"answer{i}.txt").write_text(plain.detokenize(answers[q]).decode())
    (docs / "other.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    (docs / "code.txt").write_text("def add(a, b):\n    return a + b\n" * 10)
    out = str(tmp_path_factory.mktemp("ds") / "ds")
    build_datastore([str(docs)], out, tokenizer="smollm2-135m", corpus="answers")
    return out


def drafted_equals_plain(draft: RedraftDraft, answers, **kwargs) -> None:
    llm = Llama(draft_model=draft, **LLAMA_ARGS, **kwargs)
    for q in QUESTIONS:
        assert greedy(llm, chat(llm, q)) == answers[q], q


def test_greedy_with_an_in_process_datastore_equals_plain(store, answers):
    with RedraftDraft(datastore=store, adaptive=False) as draft:
        drafted_equals_plain(draft, answers)
        s = draft.stats
        assert s["generations"] == len(QUESTIONS)
        assert s["drafted"] > 0 and s["accepted"] > 0
        # the answers in the corpus are drafted far ahead and accepted
        assert s["accepted"] >= NEW_TOKENS
        # every forward stayed below llama.cpp's 64-row tiled attention
        assert s["drafted"] <= s["drafted_calls"] * 62
        # the in-process counters (what Prometheus reads) are the adapter's own statistics
        m = draft.metrics
        assert (m.drafts, m.num_draft_tokens) == (s["drafted_calls"], s["drafted"])
        assert m.num_accepted_tokens == s["accepted"] and m.steps == s["calls"]
        assert m.accepted_per_pos[0] > 0 and set(m.draft_tokens) <= {
            "rest", "pld", "learned", "pld+rest", "learned+rest", "learned+pld",
            "learned+pld+rest"}


def test_greedy_with_the_draft_service_equals_plain(store, answers, servers):
    address = servers.start(store, "--port", "0").address
    with RedraftDraft(service=address, adaptive=False, tenant="t1") as draft:
        drafted_equals_plain(draft, answers)
        assert draft.stats["accepted"] >= NEW_TOKENS and draft.failures == 0
    with DraftClient(address, timeout=10) as c:
        stats = c.stats()
    assert stats["sessions_opened"] >= len(QUESTIONS)


def test_a_dead_service_mid_generation_does_not_change_the_output(store, answers, servers):
    serve = servers.start(store, "--port", "0")
    address = serve.address
    killed = []

    def kill_after(k: int) -> None:
        if k == 5 and not killed:
            serve.kill()
            killed.append(k)

    draft = RedraftDraft(service=address, adaptive=False, timeout=2.0)
    llm = Llama(draft_model=draft, **LLAMA_ARGS)
    q = QUESTIONS[0]
    assert greedy(llm, chat(llm, q), after=kill_after) == answers[q]
    assert killed and draft.failures == 1
    drafted_before = draft.stats["drafted"]
    # the next generation starts without the service (within its retry delay): prompt
    # lookup only, same output
    q = QUESTIONS[3]
    assert greedy(llm, chat(llm, q)) == answers[q]
    assert draft.failures == 1 and draft.stats["drafted"] > drafted_before
    draft.close()


def test_an_unreachable_service_at_start_falls_back_to_prompt_lookup(answers):
    draft = RedraftDraft(service=f"127.0.0.1:{free_port()}", adaptive=False)
    assert draft.failures == 1
    llm = Llama(draft_model=draft, **LLAMA_ARGS)
    q = QUESTIONS[0]
    assert greedy(llm, chat(llm, q)) == answers[q]
    draft.close()


LONG_QUESTION = ("Here is some code:\n" + "".join(
    f"def f{i}(x):\n    return x * {i} + {i + 1}\n\n" for i in range(12))
    + "Write one more function in the same style.")


@pytest.mark.parametrize("logits_all", [None, True])
def test_long_prompts_past_n_batch_stay_identical(store, logits_all):
    # The helper's Llama computes the prompt's logits for its last row only (a prompt over 63
    # tokens) and every row's where drafts are verified; with logits_all=True, every row's
    # everywhere. Either way its logits buffer has a row per position, so contexts past
    # n_batch work. Plain decoding runs with the same n_batch: llama.cpp splits the prompt's
    # forward at n_batch tokens.
    small = dict(n_batch=16, n_ubatch=16)
    plain = llama_cpp.Llama(model_path=model_path(), flash_attn=True, **LLAMA_ARGS, **small)
    prompt = chat(plain, LONG_QUESTION)
    assert len(prompt) > 100
    want = greedy(plain, prompt)
    with RedraftDraft(datastore=store, adaptive=False, max_drafts=14) as draft:
        extra = {} if logits_all is None else {"logits_all": logits_all}
        llm = Llama(draft_model=draft, **LLAMA_ARGS, **small, **extra)
        assert type(llm).__name__ == ("DraftingLlama" if logits_all is None else "Llama")
        assert greedy(llm, prompt) == want
        assert draft.stats["accepted"] > 0
        text = plain.detokenize(prompt).decode()
        if logits_all:  # every row's logits: prompt logprobs work
            out = llm.create_completion(text, max_tokens=2, logprobs=1, echo=True)
            assert out["choices"][0]["logprobs"]["token_logprobs"]
        else:  # llama-cpp-python's own error, not logprobs from logits never computed
            with pytest.raises(ValueError, match="logprobs"):
                llm.create_completion(text, max_tokens=2, logprobs=1)


def test_the_adapter_follows_generations_from_its_calls(store):
    """Direct calls in llama-cpp-python's pattern: a continuation is the last input plus an
    accepted prefix of the drafts handed out plus one token; anything else is a new
    generation."""
    with RedraftDraft(datastore=store, adaptive=False) as draft:
        prompt = np.arange(100, 140, dtype=np.intc)
        first = draft(np.concatenate([prompt, prompt[:5]]))  # PLD finds prompt[5:] again
        assert first.dtype == np.intc and list(first[:3]) == [105, 106, 107]
        assert draft.stats["generations"] == 1
        # two drafts accepted, then the sampled token
        seq = np.concatenate([prompt, prompt[:5], first[:2], [7]]).astype(np.intc)
        draft(seq)
        assert draft.stats["generations"] == 1 and draft.stats["accepted"] == 2
        assert draft.metrics.accepted_per_pos[:3] == [1, 1, 0]
        assert sum(draft.metrics.accepted_tokens.values()) == 2
        # the same tokens with a token that was never drafted in between: a new generation
        draft(np.concatenate([seq, [8, 9]]).astype(np.intc))
        assert draft.stats["generations"] == 2


def test_bad_arguments_are_clear_errors(store, tmp_path):
    assert Path(model_path()).suffix == ".gguf"  # the default model's file
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    with pytest.raises(EngineConfigError, match="gguf"):
        model_path(str(hf_dir))  # a Hugging Face model directory: not for llama.cpp
    with pytest.raises(ModelNotFound):
        model_path(str(tmp_path / "nothing.gguf"))
    with pytest.raises(EngineConfigError, match="exactly one of"):
        RedraftDraft()
    with pytest.raises(EngineConfigError, match="exactly one of"):
        RedraftDraft(service="127.0.0.1:1", datastore=store)
    with pytest.raises(EngineConfigError, match="HOST:PORT"):
        RedraftDraft(service="localhost")
    with pytest.raises(EngineConfigError, match="HOST:PORT"):
        RedraftDraft(service="127.0.0.1:99999")
    with pytest.raises(EngineConfigError, match="budget"):
        RedraftDraft(datastore=store, budget=0)
    with pytest.raises(EngineConfigError, match="max_drafts"):
        RedraftDraft(datastore=store, max_drafts=63)
    with pytest.raises(EngineConfigError, match="timeout"):
        RedraftDraft(datastore=store, timeout=0)
    with pytest.raises(EngineConfigError, match="unknown corpora"):
        RedraftDraft(datastore=store, corpora=["nope"])
    with pytest.raises(DatastoreNotFound):
        RedraftDraft(datastore=str(tmp_path / "missing"))
    other = str(tmp_path / "other")
    build_datastore(None, other, documents=[[1, 2, 3]], fingerprint="sha256:other",
                    vocab_size=49152)
    with pytest.raises(TokenizerMismatch):
        RedraftDraft(datastore=other, tokenizer="smollm2-135m")
    with pytest.raises(TokenizerMismatch):  # the helper checks the model's tokenizer
        Llama(draft_model=RedraftDraft(datastore=other), **LLAMA_ARGS)
    with pytest.raises(EngineConfigError, match="flash_attn"):
        Llama(flash_attn=False, **LLAMA_ARGS)



def test_missing_extra_is_a_one_line_hint(tmp_path):
    # A Python where llama_cpp cannot be imported: the adapter names the extra to install.
    blocker = tmp_path / "llama_cpp.py"
    blocker.write_text("raise ImportError('no llama_cpp here')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", "import redraft.decoder.engines.llama_cpp"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "redraft[llamacpp]" in proc.stderr
