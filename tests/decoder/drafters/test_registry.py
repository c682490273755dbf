"""The drafter registry, and the hidden states the loop hands to drafters that ask for them."""

from __future__ import annotations

import argparse

import pytest
import torch
from redraft.decoder.budget import CostModel
from redraft.decoder.drafter import MergedDrafter, UnknownDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.drafters.registry import (
    REGISTRY,
    DrafterSpec,
    Option,
    add_options,
    build_drafter,
    default_drafters,
    options_from_args,
    parse_names,
)
from redraft.decoder.generate import Generator
from redraft.proto.models import load_tokenizer

from ..conftest import tiny_model


def test_names_are_checked_against_the_registry():
    assert parse_names("PLD, recycle,pld") == ["pld", "recycle"]
    with pytest.raises(UnknownDrafter, match="unknown drafter 'ngram'.*known: none, pld"):
        parse_names("pld,ngram")
    with pytest.raises(UnknownDrafter, match="cannot be combined"):
        parse_names("none,pld")
    with pytest.raises(UnknownDrafter, match="needs a datastore"):
        build_drafter("rest")
    assert build_drafter("none") is None


def test_the_default_is_hybrid_where_the_model_has_committed_heads():
    assert default_drafters(True, "smollm2-135m") == default_drafters(False, None) == "hybrid"
    assert default_drafters(True, "other-model") == "pld,rest,recycle"
    assert default_drafters(False, "models/other.gguf") == "pld,recycle"
    # unnamed drafters for a model without heads: the copying drafters
    d = build_drafter(None, model_name="other-model")
    assert [m.name for m in d.drafters] == ["pld", "recycle"]


def test_combinations_are_built_in_registry_order():
    d = build_drafter("recycle,pld")
    assert isinstance(d, MergedDrafter)
    assert [m.name for m in d.drafters] == ["pld", "recycle"]


def test_a_new_drafter_is_one_registry_entry_with_its_options(monkeypatch):
    """A spec's options become command-line flags and reach its factory through the context."""
    seen = {}

    def make(ctx):
        seen["depth"] = ctx.option("probe_depth")
        seen["model"] = ctx.model
        return PLDDrafter(max_depth=ctx.option("probe_depth"))

    monkeypatch.setitem(globals(), "make_probe", make)
    spec = DrafterSpec("probe", "a test drafter", f"{__name__}:make_probe",
                       options=(Option("probe-depth", "depth", default=3, type=int),))
    monkeypatch.setitem(REGISTRY, "probe", spec)
    parser = argparse.ArgumentParser()
    add_options(parser)
    assert options_from_args(parser.parse_args([])) == {}
    opts = options_from_args(parser.parse_args(["--probe-depth", "5"]))
    loads = []
    d = build_drafter("probe", model_loader=lambda: loads.append(1) or "the model",
                      options=opts)
    assert d.max_depth == 5 and seen == {"depth": 5, "model": "the model"} and loads == [1]
    build_drafter("probe")
    assert seen["depth"] == 3  # the spec's default


class HiddenProbe(PLDDrafter):
    """PLD drafts (so acceptance paths vary) plus a record of every hidden state handed over."""

    hidden_wanted = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def observe_hidden(self, context, hidden) -> None:
        self.seen.append((list(context), hidden.clone()))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_loop_hands_over_the_hidden_state_that_predicted_the_root(kind):
    model = tiny_model(kind, init=0.2)
    probe = HiddenProbe()
    gen = Generator(model, load_tokenizer(None), MergedDrafter([probe]),
                    cost=CostModel([1, 2, 64], [1.0, 1.0, 1.0]))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: PLD drafts get accepted
    result = gen.generate(prompt, max_new_tokens=30, eos=False)
    assert len(probe.seen) >= 5 and result.stats.steps < 30
    for context, hidden in probe.seen:
        assert context[-1] == (prompt + result.tokens)[len(context) - 1]
        with torch.no_grad():
            ref = model.base_model(torch.tensor([context[:-1]])).last_hidden_state[0, -1]
        assert torch.allclose(hidden, ref, atol=1e-4), "not the row that predicted the root"
