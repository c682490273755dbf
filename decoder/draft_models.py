"""The models the `draft-model` drafter drafts with: a named causal LM, or one made from the target.

- a model name (anything `load_model` resolves): it must share the target's tokenizer, which
  is checked by fingerprint before the model is loaded;
- `int8`: the target with every linear layer dynamically quantized to int8 (weights per
  output channel, activations per call): the same weights with cheaper arithmetic. PyTorch's
  quantized CPU kernels read a quarter of the bytes float32 reads, so on a memory-bound CPU
  forward this is several times faster than the target while agreeing with it on most
  tokens. CPU only.
- `skip:L`: the target's first L decoder layers, its final norm and LM head, sharing the
  target's weights (no copy): an early exit without training.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from redraft.decoder.drafters.base import UnknownDrafter
from redraft.proto.errors import RedraftError
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint

INT8 = "int8"
SKIP = "skip"


def parse_spec(spec: str) -> tuple[str, int | None]:
    """("int8", None), ("skip", L) or ("name", None); a malformed skip:L is an error."""
    spec = spec.strip()
    if not spec:
        raise UnknownDrafter("--draft-model needs a value: int8, skip:L or a model name")
    if spec.lower() == INT8:
        return INT8, None
    if spec.lower().startswith(SKIP + ":"):
        value = spec.split(":", 1)[1]
        if not value.isdigit() or int(value) < 1:
            raise UnknownDrafter(f"--draft-model {spec}: skip:L needs a layer count L >= 1")
        return SKIP, int(value)
    return "name", None


def check_tokenizer(name: str, target_tokenizer) -> None:
    """Refuse a draft model whose token ids mean something else than the target's."""
    try:
        theirs = tokenizer_fingerprint(load_tokenizer(name))
    except RedraftError as exc:
        raise UnknownDrafter(f"draft model {name!r}: {exc}") from None
    ours = tokenizer_fingerprint(target_tokenizer)
    if theirs != ours:
        raise UnknownDrafter(f"draft model {name!r} has another tokenizer than the target "
                             f"(fingerprint {theirs} vs {ours}); it must share the target's")


def draft_model(spec: str, load_target: Callable[[], Any], target_tokenizer):
    """The draft model a `--draft-model` value names, in eval mode.

    The target is loaded (`load_target()`) only after the value and the tokenizer check out.
    A named model goes on the target's device, in its dtype.
    """
    kind, layers = parse_spec(spec)
    if kind == "name":
        check_tokenizer(spec, target_tokenizer)
    target = load_target()
    if kind == INT8:
        from redraft.decoder.int8_decoder import lean_int8

        return lean_int8(target) or quantized_int8(target)
    if kind == SKIP:
        return first_layers(target, layers)
    from redraft.decoder.models import load_model

    p = next(target.parameters())
    return load_model(spec, device=str(p.device), dtype=p.dtype)[0]


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


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """The body's stack of decoder layers (Llama/Qwen2 `layers`, GPT-2 `h`) and its name."""
    body = model.base_model
    count = getattr(model.config, "num_hidden_layers", None)
    for name, child in body.named_children():
        if isinstance(child, torch.nn.ModuleList) and len(child) == count:
            return name, child
    raise UnknownDrafter(f"--draft-model skip:L: cannot find the decoder layers of a "
                         f"{type(model).__name__}")


def first_layers(target, layers: int):
    """The target's first `layers` layers + final norm + LM head, sharing its weights.

    Built as a model of the target's own class with a shallower config, on the meta device
    (nothing allocated), whose every submodule is then the target's own.
    """
    name, stack = decoder_layers(target)
    if layers >= len(stack):
        raise UnknownDrafter(f"--draft-model skip:{layers}: the target has only {len(stack)} "
                             "layers; a draft model must skip some")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        model = type(target)(config)
    body, target_body = model.base_model, target.base_model
    for child, _ in list(body.named_children()):
        setattr(body, child, getattr(target_body, child))
    setattr(body, name, torch.nn.ModuleList(list(stack)[:layers]))
    model.set_output_embeddings(target.get_output_embeddings())
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise UnknownDrafter(f"--draft-model skip:L: cannot share {leftover[0]} with the target")
    return model.eval()
