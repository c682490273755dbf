"""The lean forward's compiled layer loop (`LeanStack.compiled_layers`): a forward whose
layers all run on blocks with `RowAttention` is one kernel call, and it must give the Python
layer loop's bits (hidden states and the cache), for prompt chunks and draft trees, in
float32 and bfloat16, at one and two threads, on the default model's own blocks."""

from __future__ import annotations

import functools

import pytest
import torch
from redraft.decoder import block_linear
from redraft.decoder.lean import LeanStack, RowAttention
from redraft.decoder.verify import tree_mask_rows
from redraft.proto.tree import Tree

PROMPT = [1, 504, 3250, 28, 1125, 2079, 30, 198, 2, 87, 1000, 40, 5, 77, 923, 11, 401, 2000]
TREE = Tree([30, 28, 198, 504, 11, 40, 7], [-1, 0, 0, 1, 3, -1, 5], [0.5] * 7, ["pld"] * 7)


def stack(model, dtype: torch.dtype, compiled: bool) -> LeanStack:
    blocks = block_linear.model_blocks(model)
    if blocks is None:
        pytest.skip("the default model's blocks are not available")
    s = LeanStack(model, functools.partial(block_linear.fused, blocks, dtype), dtype)
    s.compiled_layers = compiled
    return s


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def run(s: LeanStack) -> list[torch.Tensor]:
    """A prompt in two chunks, then a tree over the cache, then the tree's first branch
    kept and one more row: every hidden state and the cache."""
    out = []
    for chunk in (PROMPT[:11], PROMPT[11:]):
        start = s.length
        rows = [list(range(r + 1)) for r in range(len(chunk))]
        out.append(s.run(chunk, range(start, start + len(chunk)), RowAttention(rows)))
    past = s.length
    ids = [PROMPT[-1], *TREE.tokens]
    depths = [0, *(d + 1 for d in TREE.depths())]
    out.append(s.run(ids, [past + d for d in depths], RowAttention(tree_mask_rows(TREE))))
    s.keep(past, [past, past + 1, past + 2])
    out.append(s.run([7], [s.length], RowAttention([[0]])))
    return out + [t[:, : s.length] for t in s.keys + s.values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_layers_give_the_python_loops_bits(default_model, dtype, threads):
    model, _ = default_model
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calls = block_linear.calls()
        compiled = run(stack(model, dtype, True))
        assert block_linear.calls() - calls == 4 * 4 * len(model.model.layers)  # 4 forwards
        python = run(stack(model, dtype, False))
    finally:
        torch.set_num_threads(before)
    assert len(compiled) == len(python)
    for a, b in zip(compiled, python):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    assert torch.isfinite(compiled[2].float()).all()


def test_silu_mul_matches_torch_to_a_rounding(default_model):
    """The kernel's SiLU(gate) * up against torch's (its exp is the attention's polynomial)."""
    model, _ = default_model
    s = stack(model, torch.float32, True)
    gate_up = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    ours = s.silu_mul(gate_up)
    torch.testing.assert_close(ours, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)
    bf = gate_up.bfloat16()
    torch.testing.assert_close(s.silu_mul(bf).float(), (torch.nn.functional.silu(bf[:, :1536])
                               * bf[:, 1536:]).float(), rtol=1e-2, atol=1e-2)
