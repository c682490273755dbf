"""Int8 computation for drafting: `Int8Linear` (a linear layer on PyTorch's dynamic-quantization
kernels) and `quantized_int8` (a model with every linear layer in int8).

The same weights with cheaper arithmetic: PyTorch's quantized CPU kernels read a quarter of
the bytes float32 reads, so on a memory-bound CPU forward an int8 copy of the target is
several times faster while agreeing with it on most tokens. CPU only. The lean decoder
(`int8_decoder`) and the int8 Medusa heads build on `Int8Linear`.
"""

from __future__ import annotations

import copy
import warnings

import torch
from redraft.decoder.drafter import UnknownDrafter


class Int8Linear(torch.nn.Module):
    """A linear layer computing in int8: weights quantized once per output channel,
    activations per call (PyTorch's dynamic-quantization kernels).

    Activations use the full 8 bits where the CPU has VNNI instructions (their int32
    accumulation cannot saturate); elsewhere 7, as PyTorch's own dynamic layers always do.
    The whole call shares one activation scale, so callers keep outlier rows (the first
    token's) and long prompts out of multi-row calls (see the draft-model drafter).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        bias = None if bias is None else bias.detach().float()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are marked deprecated
            qweight = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        vnni = getattr(torch.cpu, "_is_vnni_supported", lambda: False)()
        self.reduce_range = not vnni
        self.out_features, self.in_features = w.shape

    @classmethod
    def fused(cls, *linears: torch.nn.Linear) -> Int8Linear:
        """One int8 layer computing the given layers' outputs side by side (or one layer's)."""
        weight = torch.cat([lin.weight.detach() for lin in linears])
        biases = [lin.bias for lin in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        return cls(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.float(), self._packed, self.reduce_range)
        return y.to(x.dtype)


def quantized_int8(target):
    """The target with every `nn.Linear` computing in int8 (`Int8Linear`); every other
    weight (embeddings, norms) is the target's own tensor, not a copy."""
    if next(target.parameters()).device.type != "cpu":
        raise UnknownDrafter("--draft-model int8 uses PyTorch's quantized CPU kernels: "
                             "it needs a target on the CPU")
    shared = {id(t): t for t in [*target.parameters(), *target.buffers()]}
    for module in target.modules():  # hooks on the target (e.g. a forward counter) stay there
        for key, value in vars(module).items():
            if "hook" in key and isinstance(value, dict):
                shared[id(value)] = type(value)()
    model = copy.deepcopy(target, shared)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Int8Linear(child.weight, child.bias))
    return model.eval()
