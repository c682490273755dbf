"""The draft-model drafter: draft models made from the target (int8, first layers), its own KV
cache kept in step with the context, depth chosen from measured costs, lossless greedy output
on tiny random models. (A draft model with another tokenizer: cli/test_generate_cli.py.)"""

from __future__ import annotations

import pytest
from redraft.decoder.budget import CostModel
from redraft.decoder.drafter import UnknownDrafter
from redraft.decoder.drafters.draft_model import (
    ALT_SOURCE,
    SOURCE,
    DraftModelDrafter,
    parse_spec,
)
from redraft.decoder.generate import Generator
from redraft.decoder.models.early_exit import first_layers
from redraft.decoder.models.int8 import quantized_int8 as int8_model
from redraft.decoder.models.int8_decoder import Int8Decoder, lean_int8
from redraft.proto.models import load_tokenizer

from ..conftest import tiny_model

FLAT = CostModel.flat(63)  # every tree is worth verifying whole
PROMPT = [5, 9, 13, 7, 22, 5, 9]


def test_spec_parsing():
    assert parse_spec("int8") == ("int8", None)
    assert parse_spec("skip:6") == ("skip", 6)
    assert parse_spec("some/model") == ("name", None)
    for bad in ("", "skip:", "skip:0", "skip:x"):
        with pytest.raises(UnknownDrafter):
            parse_spec(bad)


@pytest.mark.parametrize("kind", ["same", "other", "int8", "lean-int8", "skip"])
def test_greedy_output_is_plain_greedy(kind):
    target = tiny_model("llama", init=0.3, layers=2)
    draft = {"same": lambda: tiny_model("llama", init=0.3, layers=2),
             "other": lambda: tiny_model("llama", init=0.3, layers=2, seed=7),
             "int8": lambda: int8_model(target),
             "lean-int8": lambda: lean_int8(target),
             "skip": lambda: first_layers(target, 1)}[kind]()
    tok = load_tokenizer(None)
    plain = Generator(target, tok, None, cost=FLAT)
    # A fixed depth for the perfect draft model: how deep pays depends on timings (tested
    # apart), and on a loaded machine a tiny model's timings are noise.
    drafter = DraftModelDrafter(draft, top_k=2, branch_steps=2, depth=3 if kind == "same" else 0)
    spec = Generator(target, tok, drafter, cost=FLAT)
    for prompt in (PROMPT, [3, 4, 5], PROMPT + [11, 12]):  # later prompts reuse the cache
        ref = plain.generate(prompt, max_new_tokens=40, eos=False)
        got = spec.generate(prompt, max_new_tokens=40, eos=False)
        assert got.tokens == ref.tokens
        assert got.stats.drafter_errors == 0
    if kind == "same":  # a perfect draft model: its whole chain is accepted
        assert got.stats.tokens_per_step > 1.5
        assert got.stats.accepted[SOURCE] == got.stats.tried[SOURCE]
        assert ALT_SOURCE not in got.stats.accepted


def test_cache_follows_the_context_as_a_fresh_drafter_would():
    """After drafts the target rejected and a conversation that diverged, the draft model's
    cache holds exactly the shared prefix: it proposes what a fresh drafter proposes."""
    target = tiny_model("llama", init=0.3)
    used = DraftModelDrafter(tiny_model("llama", init=0.3, seed=3), top_k=2, branch_steps=2)
    contexts = [PROMPT, PROMPT + [1, 2], PROMPT + [1, 2, 40, 41, 42], PROMPT[:3] + [8],
                [2 + i % 60 for i in range(150)]]  # the last one is long: fed in chunks
    for context in contexts:
        fresh = DraftModelDrafter(tiny_model("llama", init=0.3, seed=3), top_k=2,
                                  branch_steps=2)
        for d in (used, fresh):  # a draft forward's time is worth ~nothing: depth 16 always
            d._step_seconds, d._step_tokens = 1e6, 1.0
        a, b = used.propose(context, 8), fresh.propose(context, 8)
        assert a.tokens == b.tokens and a.parents == b.parents
        assert a.probs == pytest.approx(b.probs, abs=1e-5)
        assert used._cached == list(context) + used._chain[:-1]
        assert used.runner.cached_len == len(used._cached)
    del target


def test_depth_follows_what_a_draft_forward_is_worth():
    """A draft forward that costs a whole step's worth of tokens is not run at all (after the
    first), one that costs nothing runs to the depth limit."""
    model = tiny_model("llama", init=0.3)
    cheap = DraftModelDrafter(model, max_depth=8, top_k=1)
    cheap._step_seconds, cheap._step_tokens = 1e6, 1.0  # a forward's time is worth ~nothing
    assert len(cheap.propose(PROMPT, 32)) == 8

    dear = DraftModelDrafter(model, max_depth=8, top_k=1)
    first = dear.propose(PROMPT, 32)  # no measurement yet: drafts on a prior
    dear._step_tokens = 1.0
    dear._step_seconds = dear._forward_seconds  # a draft forward costs a whole step
    depths = [len(dear.propose(PROMPT, 32)) for _ in range(2 * 8)]
    assert len(first) >= 1 and max(depths) <= 1
    assert depths.count(0) >= 8  # most steps draft nothing; a few probe
    assert dear.forward_value() > cheap.forward_value()


def test_default_model_int8_draft_model_is_lossless_and_drafts_deep(default_model):
    """The default model drafting for itself in int8 (the lean decoder): plain greedy's
    tokens, several of them per target forward."""
    from redraft.decoder.drafters.draft_model import draft_model

    model, tok = default_model
    draft = draft_model("int8", lambda: model, tok)
    assert isinstance(draft, Int8Decoder)
    prompt = tok("Write three sentences about the sea.")["input_ids"]
    plain = Generator(model, tok, None).generate(prompt, max_new_tokens=48, eos=False)
    drafter = DraftModelDrafter(draft, top_k=2, branch_steps=1, depth=4)
    got = Generator(model, tok, drafter).generate(prompt, max_new_tokens=48, eos=False)
    assert got.tokens == plain.tokens
    assert got.stats.tokens_per_step > 2.0
