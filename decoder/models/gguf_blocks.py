"""A GGUF model's linear layers as the file stores them, for the block kernel
(`redraft.decoder.block_linear`): each `nn.Linear` of the loaded (dense) model mapped to its
tensor's blocks, in the dense model's row order.

Why read the file again: the dense copy the model is loaded as is what Hugging Face's modules
and the draft models use; the verifier's hot path reads the blocks instead (96 MB for the
default model where its dense bfloat16 copy is 269 MB). Llama's query and key rows are stored
permuted in a GGUF (llama.cpp's rotary layout); Hugging Face's loader undoes that, and so does
`_row_order` here. A few rows of every layer are checked against the dense weights before any
is used: a file laid out another way falls back to the dense path instead of computing wrong
logits.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import torch
from redraft.decoder.block_linear import FORMATS, BlockWeight

# Hugging Face's module names (after "model.layers.N.") -> the GGUF's (after "blk.N.")
_LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                  "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                  "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
_ARCHITECTURES = ("llama", "qwen2")  # the plain stacks `lean` runs
_SAMPLE_ROWS = 4

_FILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> GGUF path
_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {module: weight}


def attach(model, gguf_path: str | Path) -> None:
    """Remember the file a model was loaded from (its blocks are read on first use)."""
    _FILES[model] = Path(gguf_path)


def block_weights(model) -> dict[torch.nn.Module, BlockWeight] | None:
    """The model's linear layers' blocks, or None when the model was not loaded from a GGUF
    file, or the file's architecture, formats or layout are not ones the kernel runs."""
    if model not in _BLOCKS:
        path = _FILES.get(model)
        _BLOCKS[model] = None if path is None else _read(model, path)
    return _BLOCKS[model]


def _read(model, path: Path) -> dict[torch.nn.Module, BlockWeight] | None:
    from gguf import GGUFReader  # lazy: only models loaded from a GGUF file need it

    reader = GGUFReader(str(path))
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in _ARCHITECTURES:
        return None
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    wanted: dict[torch.nn.Module, tuple[str, int | None]] = {}
    for i, layer in enumerate(model.model.layers):
        for hf_name, gguf_name in _LAYER_TENSORS.items():
            heads = None
            if arch == "llama" and gguf_name == "attn_q":
                heads = cfg.num_attention_heads
            elif arch == "llama" and gguf_name == "attn_k":
                heads = cfg.num_key_value_heads
            wanted[layer.get_submodule(hf_name)] = (f"blk.{i}.{gguf_name}.weight", heads)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    wanted[model.get_output_embeddings()] = (head, None)
    out = {}
    for module, (name, heads) in wanted.items():
        weight = _weight(tensors.get(name), heads)
        if weight is None or not _matches(weight, module.weight):
            return None
        out[module] = weight
    return out


def _weight(tensor, heads: int | None) -> BlockWeight | None:
    """A GGUF tensor as a `BlockWeight` in Hugging Face's row order, or None if its format is
    not one the kernel reads."""
    if tensor is None:
        return None
    fmt = FORMATS.get(tensor.tensor_type.name)
    k, n = (int(d) for d in tensor.shape[:2])  # GGUF shapes list the fastest axis first
    if fmt is None or len(tensor.shape) != 2 or k % 32:
        return None
    data = torch.from_numpy(np.ascontiguousarray(tensor.data).view(np.uint8).reshape(n, -1))
    weight = BlockWeight(data.clone(), fmt, n, k)
    return weight if heads is None else weight.rows(_row_order(n, heads))


def _row_order(n: int, heads: int) -> np.ndarray:
    """For each row of the Hugging Face layout, the GGUF row it is (the rotary permutation
    llama.cpp's converter applies, undone as transformers' GGUF loader undoes it)."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)


def _matches(weight: BlockWeight, dense: torch.Tensor) -> bool:
    """Whether a few rows (first, second, middle, last) equal the dense model's, bit for bit
    in its dtype: the row order and the dequantization both agree."""
    if tuple(dense.shape) != (weight.n, weight.k):
        return False
    rows = sorted({0, min(1, weight.n - 1), weight.n // 2, weight.n - 1})[:_SAMPLE_ROWS]
    mine = weight.rows(rows).dense().to(dense.dtype)
    return torch.equal(mine, dense.detach()[rows].cpu())
