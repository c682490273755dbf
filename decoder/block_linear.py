"""Linear layers on a model's weights as it ships them: the GGUF's Q4_1 / Q8_0 blocks (or dense
bfloat16 / float32 rows), multiplied by the compiled kernel (`redraft.decoder.native`).

Why: a CPU forward of a small model is bound by the bytes of weights it reads. The default
model ships as 96 MB of blocks; its dense bfloat16 copy is 269 MB (float32: 538 MB). The
kernel dequantizes each block once per call, into a buffer that stays in the core's cache,
and uses it for every row of the call, so a draft tree of 16 rows reads what one token reads.

Exactness: a row's result is the same bits whatever the other rows of the call and however
many threads share it (threads split output columns, and each row runs the same sequence of
operations), so a tree row's logits are what a one-token forward computes. The dequantized
weights are the dense copy's bit for bit (d * q + m in float32, rounded to bfloat16 for a
bfloat16 model); only the order of the sums differs from a dense matmul's.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from redraft.decoder.kernels import PackedFused
from redraft.decoder.native import _blocks

FORMATS = {"F32": _blocks.F32, "BF16": _blocks.BF16, "Q4_1": _blocks.Q4_1,
           "Q8_0": _blocks.Q8_0}
_KINDS = {torch.float32: _blocks.KIND_F32, torch.bfloat16: _blocks.KIND_BF16}


@dataclass(frozen=True)
class BlockWeight:
    """A weight matrix [n, k] as n rows of blocks (`data`: uint8 [n, row bytes]) in one of
    `FORMATS` (GGML's type ids)."""

    data: torch.Tensor
    fmt: int
    n: int
    k: int

    def __post_init__(self) -> None:
        want = (self.n, _blocks.row_bytes(self.fmt, self.k))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"weight blocks of shape {tuple(self.data.shape)} "
                             f"({self.data.dtype}), expected {want} uint8")
        if not self.data.is_contiguous():
            raise ValueError("weight blocks must be contiguous")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dense(self) -> torch.Tensor:
        """The weights as float32 [n, k], as the dense copy holds them."""
        out = torch.empty((self.n, self.k), dtype=torch.float32)
        _blocks.dequantize(self.data.data_ptr(), self.fmt, self.n, self.k, out.data_ptr())
        return out

    def rows(self, index: torch.Tensor | Sequence[int]) -> BlockWeight:
        """These rows, in this order (a permutation, or a subset)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return BlockWeight(self.data.index_select(0, idx).contiguous(), self.fmt, len(idx),
                           self.k)


def stacked(weights: Sequence[BlockWeight]) -> BlockWeight:
    """Several layers' weights as one, their outputs side by side (fused projections)."""
    first = weights[0]
    if len(weights) == 1:
        return first
    if any(w.fmt != first.fmt or w.k != first.k for w in weights):
        raise ValueError("only weights of one format and input width can be stacked")
    return BlockWeight(torch.cat([w.data for w in weights]).contiguous(), first.fmt,
                       sum(w.n for w in weights), first.k)


# model -> a function giving its layers' blocks (or None), read on first use; a model made of
# another's layers -> that model. Filled by the model loaders (`redraft.decoder.models`), read
# by the verifier: the loop never imports the loaders.
_PROVIDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(model, provider: Callable[[object], dict | None]) -> None:
    """`provider(model)` gives the model's {layer: BlockWeight} (or None), on first use."""
    _PROVIDERS[model] = provider


def share(target, model) -> None:
    """`model` is made of `target`'s own layers (a draft model of its first layers): it runs
    on the target's blocks, which are keyed by layer."""
    if target in _PROVIDERS or target in _SHARED:
        _SHARED[model] = target


def model_blocks(model) -> dict | None:
    """The model's {layer: BlockWeight}, or None when nothing provides blocks for it."""
    if model in _SHARED:
        return model_blocks(_SHARED[model])
    if model not in _BLOCKS:
        provider = _PROVIDERS.get(model)
        _BLOCKS[model] = None if provider is None else provider(model)
    return _BLOCKS[model]


def row_bytes(fmt: int, k: int) -> int:
    """Bytes of one weight row of width k in that format."""
    return _blocks.row_bytes(fmt, k)


def supports(dtype: torch.dtype) -> bool:
    """Whether the kernel computes with activations of this dtype (float32, bfloat16)."""
    return dtype in _KINDS


def kernel_path(dtype: torch.dtype) -> str:
    """The code path that runs activations of this dtype on this CPU ("amx", "avx512bf16",
    "avx2" or "scalar"): for reports, cost-curve keys, and a failing test to name the kernel."""
    return _blocks.path(_KINDS[dtype])


@contextlib.contextmanager
def on_path(dtype: torch.dtype, name: str | None) -> Iterator[None]:
    """Run this dtype on the named path for a while (None: the default), e.g. to measure the
    avx512bf16 path beside amx on one CPU. Process-wide, so not for concurrent use."""
    before = kernel_path(dtype)
    if name is not None:
        _blocks.use_path(_KINDS[dtype], name)
    try:
        yield
    finally:
        _blocks.use_path(_KINDS[dtype], before)


def fast(dtype: torch.dtype) -> bool:
    """Whether that path is a SIMD one (the scalar path is a reference, not for speed)."""
    return supports(dtype) and kernel_path(dtype) != "scalar"


_calls = 0  # calls run on blocks, process-wide (the verifier reports which kernels ran)


def calls() -> int:
    """Linear-layer calls run by the block kernel so far in this process."""
    return _calls


def ran(count: int) -> None:
    """Counts linear-layer calls the compiled layer loop ran on blocks."""
    global _calls
    _calls += count


class BlockLinear:
    """x W^T (no bias) for x [..., k] of the layer's dtype; the lean forward's `Linear`."""

    def __init__(self, weight: BlockWeight, dtype: torch.dtype) -> None:
        if dtype not in _KINDS:
            raise ValueError(f"the block kernel has no {dtype} path")
        self.weight = weight
        self.dtype = dtype
        self._kind = _KINDS[dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        global _calls
        _calls += 1
        w = self.weight
        if x.dtype != self.dtype or x.shape[-1] != w.k:
            raise ValueError(f"input {tuple(x.shape)} {x.dtype}, expected [..., {w.k}] "
                             f"{self.dtype}")
        flat = x.reshape(-1, w.k).contiguous()
        m = flat.shape[0]
        out = torch.empty((m, w.n), dtype=self.dtype)
        _blocks.matmul(flat.data_ptr(), m, w.k, w.data.data_ptr(), w.fmt, w.n, out.data_ptr(),
                       self._kind, torch.get_num_threads())
        return out.view(*x.shape[:-1], w.n)


class FusedBlocks:
    """The lean forward's fused linear (query/key/value, gate/up, or one layer) on the
    layers' blocks, their outputs side by side. If a layer's dense weights change after
    loading (an adapter, a test editing them), the file's blocks no longer hold them:
    `refresh` then moves it to packed dense weights for good."""

    def __init__(self, modules: Sequence[torch.nn.Linear], weight: BlockWeight,
                 dtype: torch.dtype) -> None:
        self.modules = tuple(modules)
        self.stamps = [_stamp(m) for m in self.modules]
        self.run: Callable[[torch.Tensor], torch.Tensor] = BlockLinear(weight, dtype)

    def refresh(self) -> bool:
        if [_stamp(m) for m in self.modules] == self.stamps:
            return False
        self.stamps = [_stamp(m) for m in self.modules]
        self.run = PackedFused(self.modules)
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


# first layer -> {layers' ids: their stacked blocks}: verifiers of one model share one copy
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fused(blocks: dict, dtype: torch.dtype, modules: Sequence[torch.nn.Linear]):
    """The lean forward's `LinearFactory` over a model's blocks (`gguf_blocks`): layers with
    blocks of one format and no bias run on them, any other group on packed dense weights."""
    modules = tuple(modules)
    weights = [blocks.get(m) for m in modules]
    if (any(w is None for w in weights) or len({(w.fmt, w.k) for w in weights}) != 1
            or any(m.bias is not None for m in modules)):
        return PackedFused(modules)
    entries = _FUSED.setdefault(modules[0], {})
    key = tuple(id(m) for m in modules)
    if key not in entries:
        entries[key] = stacked(weights)
    return FusedBlocks(modules, entries[key], dtype)


def _stamp(module: torch.nn.Linear) -> tuple:
    """Identity and in-place version of a layer's weight."""
    return (module.weight.data_ptr(), module.weight._version)
