"""Draft models made from the target: int8 linear layers and the int8 model, the lean int8
decoder, and early exit (the first layers)."""

from __future__ import annotations

import pytest
import torch
from redraft.decoder.drafter import UnknownDrafter
from redraft.decoder.drafters.draft_model import ModelRunner
from redraft.decoder.models.early_exit import first_layers
from redraft.decoder.models.int8 import Int8Linear
from redraft.decoder.models.int8 import quantized_int8 as int8_model
from redraft.decoder.models.int8_decoder import Int8Decoder, lean_int8

from ..conftest import tiny_model

PROMPT = [5, 9, 13, 7, 22, 5, 9]

def test_first_layers_share_the_targets_weights_and_exit_early():
    target = tiny_model("llama", layers=3)
    draft = first_layers(target, 1)
    assert draft.config.num_hidden_layers == 1 and target.config.num_hidden_layers == 3
    shared = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in shared for p in draft.parameters())
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        after_one = target(ids, output_hidden_states=True).hidden_states[1]
        expected = target.lm_head(target.model.norm(after_one))
        assert torch.allclose(draft(ids).logits, expected, atol=1e-5)
    with pytest.raises(UnknownDrafter, match="only 3 layers"):
        first_layers(target, 3)


def test_int8_model_keeps_the_targets_other_weights_and_stays_close():
    target = tiny_model("llama", init=0.3)
    draft = int8_model(target)
    assert sum(isinstance(m, Int8Linear) for m in draft.modules()) == sum(
        type(m) is torch.nn.Linear for m in target.modules())
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert not any(isinstance(m, Int8Linear) for m in target.modules())  # target untouched
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        exact, approx = target(ids).logits, draft(ids).logits
    assert (approx - exact).abs().mean() < 0.1 * exact.abs().mean()
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean() > 0.8


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


def test_the_cpu_default_dtype_is_bfloat16_only_with_bf16_units():
    from redraft.decoder.kernels import cpu_has_bf16
    from redraft.decoder.models.loading import resolve_dtype

    expected = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert resolve_dtype(None, "cpu") == resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
