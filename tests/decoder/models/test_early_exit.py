"""Early exit: a draft model of the target's first layers."""

from __future__ import annotations

import pytest
import torch
from redraft.decoder.drafter import UnknownDrafter
from redraft.decoder.models.early_exit import first_layers

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
