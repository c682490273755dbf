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

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from redraft.decoder import block_linear
from redraft.decoder.block_linear import FORMATS, BlockWeight, row_bytes

# Hugging Face's module names (after "model.layers.N.") -> the GGUF's (after "blk.N.")
_LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                  "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                  "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
_ARCHITECTURES = ("llama", "qwen2")  # the plain stacks `lean` runs
_SAMPLE_ROWS = 4


def attach(model, gguf_path: str | Path) -> None:
    """Have the verifier run `model` on the blocks of the file it was loaded from (read on
    first use)."""
    block_linear.attach(model, lambda m: _read(m, Path(gguf_path)))


def block_weights(model) -> dict[torch.nn.Module, BlockWeight] | None:
    """The model's linear layers' blocks, or None when the model was not loaded from a GGUF
    file, or the file's architecture, formats or layout are not ones the kernel runs."""
    return block_linear.model_blocks(model)


def _read(model, path: Path) -> dict[torch.nn.Module, BlockWeight] | None:
    try:
        arch, tensors = read_tensors(path)
    except (OSError, ValueError, struct.error):  # gone or unreadable since loading: dense
        return None
    if arch not in _ARCHITECTURES:
        return None
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
        found = tensors.get(name)
        if found is None:
            return None
        weight = BlockWeight(torch.from_numpy(np.array(found.data)), found.fmt, found.n,
                             found.k)  # copied off the file map
        if heads is not None:
            weight = weight.rows(_row_order(weight.n, heads))
        if not _matches(weight, module.weight):
            return None
        out[module] = weight
    return out


@dataclass
class GgufTensor:
    """A 2-D tensor of a GGUF file, mapped: its rows of blocks and their format."""

    data: np.ndarray  # uint8 [n, row bytes]
    fmt: int
    n: int
    k: int


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_tensors(path: str | Path) -> tuple[str | None, dict[str, GgufTensor]]:
    """A GGUF file's architecture and its 2-D tensors in `FORMATS` (mapped, not read).

    Only the header is parsed: gguf-py's reader also decodes every metadata field (the
    default model's 49,152-entry vocabulary) into arrays, which takes seconds; skipping
    them takes milliseconds."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mapped)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    n_tensors, n_fields = struct.unpack_from("<QQ", buf, 8)
    pos = 24
    fields: dict[str, object] = {}

    def string(at: int) -> tuple[str, int]:
        (size,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8 : at + 8 + size]).decode("utf-8", "replace"), at + 8 + size

    def value(kind: int, at: int) -> tuple[object, int]:
        if kind == _STRING:
            return string(at)
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALARS:  # skipped whole: only scalars and strings are kept
                return None, at + count * struct.calcsize(_SCALARS[item])
            for _ in range(count):
                _, at = value(item, at)
            return None, at
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)

    for _ in range(n_fields):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        fields[key], pos = value(kind, pos + 4)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", buf, pos)
        shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        infos.append((name, shape, kind, offset))
    align = int(fields.get("general.alignment") or 32)
    start = -(-pos // align) * align
    tensors = {}
    for name, shape, kind, offset in infos:
        if len(shape) != 2 or kind not in FORMATS.values() or shape[0] % 32:
            continue
        k, n = (int(d) for d in shape)  # GGUF lists the fastest axis first
        size = row_bytes(kind, k)
        data = mapped[start + offset : start + offset + n * size].reshape(n, size)
        tensors[name] = GgufTensor(data, kind, n, k)
    arch = fields.get("general.architecture")
    return (arch if isinstance(arch, str) else None), tensors


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
