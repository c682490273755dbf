"""Int8 linear layers and the int8 model made from the target."""

from __future__ import annotations

import torch
from redraft.decoder.models.int8 import Int8Linear
from redraft.decoder.models.int8 import quantized_int8 as int8_model

from ..conftest import tiny_model

PROMPT = [5, 9, 13, 7, 22, 5, 9]


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
