"""What the vLLM and SGLang adapters' tests share: the real default model as the engine's
target, greedy verification of chains and trees, and a datastore whose corpus holds the
plain answers (so that drafts are long and accepted)."""

from __future__ import annotations

import pytest
from redraft.datastore import build_datastore
from redraft.decoder.acceptance import accept_greedy
from redraft.decoder.verify import TreeVerifier
from redraft.proto.tree import Tree

from ..conftest import have_default_model

QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python class for a stack with push and pop methods.",
    "Explain in two sentences what a hash table is.",
]
NEW_TOKENS = 32


def chat_ids(tokenizer, question: str) -> list[int]:
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class GreedySequence:
    """One request on the target, as a speculative engine runs it under greedy sampling:
    each step one forward over the last token and the drafts (a chain or a tree), the
    longest drafted path the target's argmax agrees with, plus the argmax after it."""

    def __init__(self, model, prompt: list[int]) -> None:
        self.verifier = TreeVerifier(model, packed_kernels=False)
        self.verifier.prefill(prompt[:-1])
        self.root = prompt[-1]
        self.output: list[int] = []
        self.accepted = 0  # drafted tokens the target agreed with
        self.forwards = 0

    def step(self, drafts: Tree) -> list[int]:
        """Verify `drafts` (a chain is a tree); returns the tokens this step produced."""
        logits = self.verifier.tree_forward(self.root, drafts).logits
        result = accept_greedy(logits, drafts)
        self.verifier.commit(result.nodes)
        self.root = result.tokens[-1]
        self.output.extend(result.tokens)
        self.accepted += len(result.nodes)
        self.forwards += 1
        return result.tokens


@pytest.fixture(scope="session")
def plain_answers(default_model) -> dict[str, tuple[list[int], list[int]]]:
    """{question: (prompt ids, NEW_TOKENS greedy tokens without drafts)} on the same
    verifier, one token per forward: plain decoding on the same backend."""
    model, tokenizer = default_model
    out = {}
    for q in QUESTIONS:
        prompt = chat_ids(tokenizer, q)
        seq = GreedySequence(model, prompt)
        while len(seq.output) < NEW_TOKENS:
            seq.step(Tree())
        out[q] = (prompt, seq.output[:NEW_TOKENS])
    return out


@pytest.fixture(scope="session")
def answers_store(tmp_path_factory, default_model, plain_answers) -> str:
    """A datastore whose corpus holds three of the four plain answers (the last question's
    drafts come from prompt lookup alone) and an unrelated document."""
    if not have_default_model():
        pytest.skip("default model package not installed (make install)")
    _, tokenizer = default_model
    docs = tmp_path_factory.mktemp("engine-corpus")
    for i, q in enumerate(QUESTIONS[:3]):
        (docs / f"answer{i}.txt").write_text(tokenizer.decode(plain_answers[q][1]))
    (docs / "other.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = str(tmp_path_factory.mktemp("engine-ds") / "ds")
    build_datastore([str(docs)], out, tokenizer="smollm2-135m", corpus="answers")
    return out


@pytest.fixture()
def service(monkeypatch, servers, answers_store):
    """A real `redraft serve` over the answers datastore, named in the environment the
    adapters read; learning off, so that a context's drafts depend on the context alone."""
    serve = servers.start(answers_store, "--port", "0")
    monkeypatch.setenv("REDRAFT_SERVICE", serve.address)
    monkeypatch.setenv("REDRAFT_LEARN", "0")
    monkeypatch.delenv("REDRAFT_DATASTORE", raising=False)
    monkeypatch.delenv("REDRAFT_ADAPTIVE", raising=False)
    return serve
