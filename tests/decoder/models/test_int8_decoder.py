"""The lean int8 decoder: the int8 model's logits on the lean forward, plain stacks only."""

from __future__ import annotations

import pytest
import torch
from redraft.decoder.drafters.draft_model import ModelRunner
from redraft.decoder.models.int8 import quantized_int8 as int8_model
from redraft.decoder.models.int8_decoder import Int8Decoder, lean_int8

from ..conftest import tiny_model

PROMPT = [5, 9, 13, 7, 22, 5, 9]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lean_int8_decoder_computes_what_the_int8_model_computes(family):
    """Fed the same tokens in the same calls (int8 activations share a scale per call), the
    lean decoder's logits are the module-by-module int8 model's; its cache rolls back."""
    target = tiny_model(family, init=0.3, layers=3)
    lean, modules = lean_int8(target), ModelRunner(int8_model(target))
    assert isinstance(lean, Int8Decoder)
    calls = [PROMPT[:1], PROMPT[1:5], PROMPT[5:6], PROMPT[6:]]
    for tokens in calls:
        want = modules.next_logits(tokens)
        assert torch.allclose(lean.next_logits(tokens), want, atol=1e-4, rtol=1e-4)
    assert lean.cached_len == modules.cached_len == len(PROMPT)
    lean.truncate(5)  # roll back to after the second call, feed the rest again
    lean.extend(PROMPT[5:6])
    assert torch.allclose(lean.next_logits(PROMPT[6:]), want, atol=1e-4, rtol=1e-4)


def test_lean_int8_decoder_only_takes_plain_stacks():
    assert lean_int8(tiny_model("gpt2")) is None  # the drafter uses the int8 modules there
    qwen3_like = tiny_model("llama")
    qwen3_like.model.layers[0].self_attn.add_module("q_norm", torch.nn.Identity())
    assert lean_int8(qwen3_like) is None
