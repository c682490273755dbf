"""Packed oneDNN linear layers: same numbers as the stock kernels, switched on only inside."""

from __future__ import annotations

import time

import pytest
import torch
from redraft.decoder.kernels import KernelChoice, can_pack, packed_calls, packed_linears
from redraft.decoder.verify import TreeVerifier
from redraft.proto.tree import Tree

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


def test_not_packed_in_float16_on_a_cpu():
    model = tiny_model("llama").to(torch.float16)
    assert packed_linears(model) is None
    assert TreeVerifier(model).kernels is None


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN without bfloat16")
def test_bfloat16_packs_and_matches_stock_bits():
    """oneDNN's bf16 inner product is the same brgemm as `F.linear` in bf16: same bits."""
    model = tiny_model("llama", layers=2).to(torch.bfloat16)
    packed = packed_linears(model)
    assert packed is not None
    x = torch.randint(0, 64, (1, 7))
    with torch.inference_mode():
        stock = model(input_ids=x).logits
        with packed.active():
            fast = model(input_ids=x).logits
    torch.testing.assert_close(fast, stock, rtol=2e-2, atol=2e-2)


def test_verifier_tree_logits_match_with_and_without_packing():
    model = tiny_model("llama", layers=2)
    tree = Tree([5, 6, 7, 8], [-1, 0, 0, 2], [0.5] * 4)
    logits = []
    for packed in (True, False):
        v = TreeVerifier(model, packed_kernels=packed, choose_kernels=False)  # every forward
        assert (v.kernels is not None) == packed
        v.prefill([3, 4, 9, 10])
        logits.append(v.tree_forward(11, tree).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)


def test_verifier_counts_the_forwards_that_really_ran_packed():
    model = tiny_model("llama", layers=2)
    packed = TreeVerifier(model, choose_kernels=False)
    stock = TreeVerifier(model, packed_kernels=False)
    for v in (packed, stock):
        before = packed_calls()
        v.prefill([3, 4, 9])
        v.tree_forward(10, Tree([5, 6], [-1, 0], [0.5, 0.5]))
        v.commit([0])
        assert v.forwards == 2 and v.last_forward_seconds > 0
        ran = packed_calls() - before
        if v is packed:  # every linear layer of both forwards ran packed (prefill: no LM head)
            assert v.packed_forwards == 2 and ran == 2 * len(v.kernels.forwards) - 1
        else:
            assert v.packed_forwards == 0 and ran == 0
    assert packed.kernels.pack_seconds > 0 and packed.kernels.repacked == 0


def test_forward_costs_leave_out_time_the_process_was_not_running():
    v = TreeVerifier(tiny_model("llama"))
    assert torch.get_num_threads() == 1  # conftest: one thread, so CPU time is the clock
    start = v.cost_clock()
    time.sleep(0.2)  # as if another process held the core
    assert v.cost_clock() - start < 0.05


def test_weights_changed_after_packing_are_repacked_at_the_next_generation():
    model = tiny_model("llama", layers=1)
    verifier = TreeVerifier(model)
    verifier.prefill([3, 4, 5])
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # in place, as an optimizer step or adapter merge would
        model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(
            torch.randn_like(model.model.layers[0].mlp.down_proj.weight))  # replaced
    verifier.prefill([3, 4, 5])
    assert verifier.kernels.repacked == 2
    fast = verifier.tree_forward(6, Tree()).logits
    with torch.inference_mode():
        stock = model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits[0, -1:]
    torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-5)


def test_kernel_choice_follows_the_faster_kind_per_size_and_keeps_checking():
    choice = KernelChoice(explore=8)
    cost = {(1, True): 1.2, (1, False): 1.0, (8, True): 1.5, (8, False): 2.5}  # a loaded CPU

    def run(n: int) -> bool:
        packed = choice.packed(n)
        choice.record(n, packed, cost[(n, packed)])
        return packed

    first = [run(1) for _ in range(4)]
    assert first == [True, True, False, False]  # both kinds measured, packed first
    ones, eights = [run(1) for _ in range(40)], [run(8) for _ in range(68)][4:]
    # one in 8 tries the other kind; one in 32 where that kind was over 25% slower
    assert ones.count(True) == 5 and eights.count(False) == 2
    assert choice.summary() == {"1": "stock", "8-15": "packed"}
    cost[(1, True)] = 0.8  # the other jobs stopped: packed is faster again at one token
    assert [run(1) for _ in range(40)][-8:].count(True) >= 7


def test_verifier_runs_each_forward_on_the_chosen_kernels():
    model = tiny_model("llama", layers=2)
    assert TreeVerifier(model).choice is None  # the lean forward: packed for every size
    v = TreeVerifier(model, lean=False)  # through the modules, kernels chosen per size
    for _ in range(2):  # one-token forwards measured faster on stock, tree forwards on packed
        for n, packed, seconds in ((1, True, 2.0), (1, False, 1.0), (3, True, 1.0),
                                   (3, False, 2.0)):
            v.choice.record(n, packed, seconds)
    v.prefill([3, 4, 9])
    before = v.packed_forwards
    v.tree_forward(10, Tree())
    v.commit([])
    assert v.packed_forwards == before  # stock
    v.tree_forward(10, Tree([5, 6], [-1, 0], [0.5, 0.5]))
    v.commit([0])
    assert v.packed_forwards == before + 1  # packed
