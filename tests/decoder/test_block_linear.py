"""The lean forward's linear layers on blocks: fused groups, shared copies, and a layer whose
dense weights change after loading moves to them (the file's blocks no longer hold it)."""

from __future__ import annotations

import torch
from redraft.decoder import block_linear
from redraft.decoder.block_linear import FORMATS, BlockWeight, stacked

from .conftest import tiny_model


def exact_blocks(module: torch.nn.Linear) -> BlockWeight:
    """A layer's float32 weights as F32 'blocks' (the kernel's dense format)."""
    w = module.weight.detach().contiguous()
    return BlockWeight(w.view(torch.uint8).clone(), FORMATS["F32"], w.shape[0], w.shape[1])


def test_fused_layers_compute_their_outputs_side_by_side():
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    mods = [attn.q_proj, attn.k_proj, attn.v_proj]
    blocks = {m: exact_blocks(m) for m in mods}
    fused = block_linear.fused(blocks, torch.float32, mods)
    x = torch.randn(5, 32)
    want = torch.cat([x @ m.weight.T for m in mods], dim=-1)
    assert torch.allclose(fused(x), want, atol=1e-5)
    again = block_linear.fused(blocks, torch.float32, mods)
    assert again.run.weight is fused.run.weight  # one stacked copy per group of layers


def test_a_layer_edited_after_loading_runs_on_its_new_weights():
    model = tiny_model("llama")
    layer = model.model.layers[0].mlp.down_proj
    linear = block_linear.fused({layer: exact_blocks(layer)}, torch.float32, [layer])
    x = torch.randn(3, layer.in_features)
    assert not linear.refresh()
    with torch.no_grad():
        layer.weight.mul_(2)
    assert linear.refresh()
    assert torch.allclose(linear(x), x @ layer.weight.T, atol=1e-5)


def test_groups_without_blocks_of_one_format_run_dense():
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    linear = block_linear.fused({mlp.gate_proj: exact_blocks(mlp.gate_proj)}, torch.float32,
                                [mlp.gate_proj, mlp.up_proj])
    assert not isinstance(linear, block_linear.FusedBlocks)
    x = torch.randn(2, 32)
    assert torch.allclose(linear(x), torch.cat([x @ mlp.gate_proj.weight.T,
                                                x @ mlp.up_proj.weight.T], -1), atol=1e-5)


def test_stacking_keeps_rows_in_order():
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    both = stacked([exact_blocks(mlp.gate_proj), exact_blocks(mlp.up_proj)])
    assert torch.equal(both.dense(), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
