"""The benchmark's methods: Hugging Face's own `generate` (greedy, or with its prompt lookup)
and redraft's Generator with a drafter configuration, named `hf-*` and `redraft-*`.

Tested by: tests/decoder/bench/test_greedy.py, tests/decoder/bench/test_sampling.py"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from redraft.decoder.bench.questions import BenchError
from redraft.decoder.drafters.registry import (
    NONE,
    REGISTRY,
    default_drafters,
    parse_names,
)
from redraft.decoder.kernels import packed_calls
from redraft.decoder.text import chat_ids

NOLEARN = "-nolearn"
# `X-dense` is X verified on the model's dense copy (packed oneDNN) instead of the blocks its
# GGUF file ships (the block kernel): the two kernels side by side in one run.
DENSE = "-dense"
LLAMA_CPP = "llama-cpp"  # plain llama-cpp-python on the GGUF (`bench.llama_cpp_method`)


@dataclass
class TurnResult:
    tokens: list[int]
    text: str
    steps: int  # target forwards that produced new tokens
    seconds: float  # wall clock of the whole call, prefill included, for every method alike
    forwards: int = 0  # every target forward, prefill included
    packed_forwards: int = 0  # of those, the ones whose linear layers really ran packed
    # this process's CPU time for the call: with one torch thread it leaves out the time other
    # processes held the core, so it is the steadier clock on a shared machine
    cpu_seconds: float = 0.0
    draft_seconds: float = 0.0  # of which inside the drafter (redraft's methods)
    accepted: dict[str, int] = field(default_factory=dict)  # draft tokens accepted per source
    tried: dict[str, int] = field(default_factory=dict)  # verified with their parent accepted


class Method:
    """One way of generating a turn's answer from chat messages."""

    name = "method"
    compared = True  # its tokens are checked against hf-greedy's (same model, same dtype)

    def run(self, messages: list[dict], max_new_tokens: int) -> TurnResult:
        raise NotImplementedError


class HFMethod(Method):
    """Hugging Face's own `generate`: greedy, or greedy with its prompt lookup."""

    def __init__(self, name: str, model, tokenizer, prompt_lookup_num_tokens: int | None = None):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.kwargs = {}
        if prompt_lookup_num_tokens:
            self.kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
        self._forwards = self._packed = self._calls_before = 0
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def _before(self, *_args) -> None:
        self._forwards += 1
        self._calls_before = packed_calls()

    def _after(self, *_args) -> None:
        self._packed += packed_calls() > self._calls_before  # never, unless a bug packs them

    def run(self, messages: list[dict], max_new_tokens: int) -> TurnResult:
        ids = chat_ids(self.tokenizer, messages)
        input_ids = torch.tensor([ids], device=self.model.device)
        eos = self.model.generation_config.eos_token_id
        self._forwards = self._packed = 0
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, eos_token_id=eos,
                pad_token_id=self.tokenizer.pad_token_id or eos, **self.kwargs,
            )
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = out[0, len(ids):].tolist()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        # HF's prefill forward already yields the first new token, so every forward counts.
        return TurnResult(tokens, text, self._forwards, seconds, self._forwards, self._packed,
                          cpu)


class RedraftMethod(Method):
    """redraft's Generator with one drafter configuration (None = plain decoding)."""

    def __init__(self, name: str, generator) -> None:
        self.name = name
        self.generator = generator

    def run(self, messages: list[dict], max_new_tokens: int) -> TurnResult:
        ids = chat_ids(self.generator.tokenizer, messages)  # outside the clock, as for HF
        verifier = self.generator.verifier
        forwards, packed = verifier.forwards, verifier.packed_forwards
        t0, c0 = time.perf_counter(), time.process_time()
        res = self.generator.generate(ids, max_new_tokens=max_new_tokens)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = res.stats
        return TurnResult(res.tokens, res.text, s.steps, seconds,
                          verifier.forwards - forwards, verifier.packed_forwards - packed, cpu,
                          s.draft_seconds, dict(s.accepted), dict(s.tried))


HF_METHODS = ("hf-greedy", "hf-pld")
# Named variants: a drafter with some of its options set (they win over the command line's).
VARIANTS: dict[str, tuple[str, dict]] = {
    "redraft-draft-model-int8": ("draft-model", {"draft_model": "int8"}),
    "redraft-draft-model-skip24": ("draft-model", {"draft_model": "skip:24"}),
}


def redraft_methods(model_name: str | None = None) -> dict[str, str]:
    """Method name -> drafter names for build_drafter: `redraft-NAME` for every registered
    drafter, plus plain decoding, PLD + retrieval, and the default drafters (of `model_name`:
    `hybrid` only where it has heads). Any other combination is `redraft-` + names joined by
    `+` (e.g. `redraft-pld+medusa`)."""
    out = {f"redraft-{NONE}": NONE}
    out.update({f"redraft-{name}": name for name in REGISTRY})
    out["redraft-pld-rest"] = "pld,rest"
    out["redraft-default"] = default_drafters(True, model_name)
    out.update({name: drafters for name, (drafters, _) in VARIANTS.items()})
    return out


def method_drafters(method: str, model_name: str | None = None) -> str | None:
    """The drafter names of a redraft method for a model, None for an unknown method
    (`X-nolearn` is X with learned drafts off, `X-dense` X on the dense weights)."""
    method = split_learning(split_dense(method)[0])[0]
    known = redraft_methods(model_name)
    if method in known:
        return known[method]
    if method.startswith("redraft-") and "+" in method:
        return method[len("redraft-"):].replace("+", ",")
    return None


DEFAULT_SAMPLING_METHODS = "redraft-default,redraft-default-nolearn"
DEFAULT_METHODS = ("hf-greedy,hf-pld,redraft-pld,redraft-rest,redraft-recycle,redraft-pld-rest,"
                   "redraft-default")


def parse_methods(spec: str, has_retrieval: bool) -> list[str]:
    names = [m.strip() for m in spec.split(",") if m.strip()]
    for m in names:
        if m in HF_METHODS or m == LLAMA_CPP:
            continue
        drafters = method_drafters(m)
        if drafters is None:
            known = ", ".join([*HF_METHODS, LLAMA_CPP, *redraft_methods()])
            raise BenchError(f"unknown method {m!r} (known: {known}, or redraft-A+B)")
        needs = [n for n in parse_names(drafters) if n in REGISTRY
                 and REGISTRY[n].needs_retrieval]
        if needs and not has_retrieval:
            raise BenchError(f"{m} needs --datastore DIR or --draft-service ADDR")
    if "hf-greedy" not in names:
        names.insert(0, "hf-greedy")
    return list(dict.fromkeys(names))


def split_dense(method: str) -> tuple[str, bool]:
    """(the method without a `-dense` suffix, whether it runs on the dense weights)."""
    if method.endswith(DENSE):
        return method[: -len(DENSE)], True
    return method, False


def split_learning(method: str) -> tuple[str, bool]:
    """(the method without a `-nolearn` suffix, whether it learns)."""
    if method.endswith(NOLEARN):
        return method[: -len(NOLEARN)], False
    return method, True


def drafter_options(method: str, given: dict, run_id: str) -> dict:
    """A method's drafter options: learning off for `-nolearn`, and a tenant of its own per
    run (so a draft service's learned outputs never cross methods or runs)."""
    options = dict(given)
    if not split_learning(split_dense(method)[0])[1]:
        options["learn"] = "off"
    if not options.get("tenant"):
        options["tenant"] = f"bench-{run_id}-{method}"
    return options


def warm_up(methods: Sequence[Method]) -> None:
    """One short answer per method before timing: first-call costs (allocations, oneDNN
    primitives, the kernel choice trying both kinds) must not land on the first question."""
    for method in methods:
        method.run([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                   max_new_tokens=8)
