"""Packed oneDNN linear layers: same numbers as the stock kernels, switched on only inside."""

from __future__ import annotations

import pytest
import torch
from redraft.decoder.kernels import packed_linears
from redraft.decoder.tree import Tree
from redraft.decoder.verify import TreeVerifier

from .conftest import tiny_model

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2's q/k/v projections have biases
def test_packed_layers_match_stock(kind):
    model = tiny_model(kind, layers=2)
    packed = packed_linears(model)
    assert packed is not None and len(packed.forwards) == 2 * 7 + 1
    x = torch.randint(0, 64, (1, 7))
    with torch.inference_mode():
        stock = model(input_ids=x).logits
        with packed.active():
            fast = model(input_ids=x).logits
        again = model(input_ids=x).logits
    torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-5)
    assert torch.equal(again, stock)  # leaving the block restores the stock kernels
    assert all("forward" not in vars(m) for m, _ in packed.forwards)


def test_packed_once_per_model():
    model = tiny_model("llama")
    assert packed_linears(model) is packed_linears(model)


def test_not_packed_outside_float32_cpu():
    model = tiny_model("llama").to(torch.bfloat16)
    assert packed_linears(model) is None
    assert TreeVerifier(model).kernels is None


def test_verifier_tree_logits_match_with_and_without_packing():
    model = tiny_model("llama", layers=2)
    tree = Tree([5, 6, 7, 8], [-1, 0, 0, 2], [0.5] * 4)
    logits = []
    for packed in (True, False):
        v = TreeVerifier(model, packed_kernels=packed)
        assert (v.kernels is not None) == packed
        v.prefill([3, 4, 9, 10])
        logits.append(v.tree_forward(11, tree).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)


def test_weights_changed_after_packing_are_repacked_at_the_next_generation():
    model = tiny_model("llama", layers=1)
    verifier = TreeVerifier(model)
    verifier.prefill([3, 4, 5])
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # in place, as an optimizer step or adapter merge would
        model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(
            torch.randn_like(model.model.layers[0].mlp.down_proj.weight))  # replaced
    verifier.prefill([3, 4, 5])
    fast = verifier.tree_forward(6, Tree()).logits
    with torch.inference_mode():
        stock = model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits[0, -1:]
    torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-5)
