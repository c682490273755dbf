"""A lean int8 decoder for drafting: the target's own Llama-style stack, one plain function
per stage, int8 matmuls over fused weights, its own flat KV cache.

Why not the Hugging Face model with int8 linear layers: on the default model a one-token
forward through those modules costs ~40 ms on this CPU, of which the int8 matmuls are about
a third; the rest is per-module and per-op overhead (seven separate projections per layer,
each quantizing the same activations again, the cache object, the mask machinery). Here the
query/key/value and gate/up projections are fused into one int8 matmul each (per-channel
weight scales make the fused matmul compute exactly what the separate ones would), the cache
is two preallocated tensors per layer, and a step runs a few dozen tensor ops per layer.

Only the plain pre-norm Llama/Qwen2 layer (RMSNorm, rotary attention with grouped keys,
SiLU-gated MLP, full attention everywhere) is built this way; `lean_int8` returns None for
anything else and the caller uses the module-by-module int8 model instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from redraft.decoder.models.int8 import Int8Linear

_FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj"}


@dataclass
class _Layer:
    norm1: torch.Tensor
    qkv: Int8Linear
    out: Int8Linear
    norm2: torch.Tensor
    gate_up: Int8Linear
    down: Int8Linear


def _plain_stack(target) -> bool:
    """Whether every layer of the target is the plain Llama/Qwen2 layer this module runs."""
    cfg = target.config
    if type(target).__name__ not in _FAMILIES or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False
    if next(target.parameters()).device.type != "cpu":
        return False
    for layer in target.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if {n for n, _ in attn.named_children()} != _ATTENTION:  # e.g. Qwen3's q/k norms
            return False
        if {n for n, _ in mlp.named_children()} - {"act_fn"} != _MLP:
            return False
        if any(type(getattr(attn, n)) is not torch.nn.Linear for n in _ATTENTION):
            return False
        if any(type(getattr(mlp, n)) is not torch.nn.Linear for n in _MLP):
            return False
    return True


def lean_int8(target) -> Int8Decoder | None:
    """The target as an `Int8Decoder`, or None where its architecture is not a plain stack."""
    return Int8Decoder(target) if _plain_stack(target) else None


class Int8Decoder:
    """The target's stack in int8 with a KV cache of its own: `extend` appends tokens,
    `next_logits` appends tokens and returns the logits after the last, `truncate` rolls
    back. Embeddings, norms and rotary tables are the target's own tensors."""

    def __init__(self, target) -> None:
        cfg = target.config
        self.config = cfg
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        body = target.model
        self.embed = body.embed_tokens.weight
        self.rotary = body.rotary_emb
        self.final_norm = body.norm.weight
        self.lm_head = Int8Linear.fused(target.get_output_embeddings())
        self.layers = [
            _Layer(layer.input_layernorm.weight,
                   Int8Linear.fused(layer.self_attn.q_proj, layer.self_attn.k_proj,
                                    layer.self_attn.v_proj),
                   Int8Linear.fused(layer.self_attn.o_proj),
                   layer.post_attention_layernorm.weight,
                   Int8Linear.fused(layer.mlp.gate_proj, layer.mlp.up_proj),
                   Int8Linear.fused(layer.mlp.down_proj))
            for layer in body.layers
        ]
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.cached_len = 0

    def reset(self) -> None:
        self.cached_len = 0

    def truncate(self, length: int) -> None:
        self.cached_len = min(self.cached_len, length)

    @torch.inference_mode()
    def extend(self, tokens: Sequence[int]) -> None:
        if tokens:
            self._run(tokens)

    @torch.inference_mode()
    def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append `tokens` to the cache; float32 logits [V] after the last of them."""
        hidden = self._run(tokens)[-1:]
        return self.lm_head(self._norm(hidden, self.final_norm))[0]

    # -- the stages of one forward ---------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def _reserve(self, length: int) -> None:
        """Room in the cache for `length` tokens (grown by doubling, contents kept)."""
        have = self._keys[0].shape[1] if self._keys else 0
        if length <= have:
            return
        size = max(length, 2 * have, 256)
        shape = (self.kv_heads, size, self.head_dim)
        for store in (self._keys, self._values):
            for i in range(len(self.layers)):
                grown = torch.zeros(shape, dtype=self.embed.dtype)
                if i < len(store):
                    grown[:, :have] = store[i]
                    store[i] = grown
                else:
                    store.append(grown)

    def _run(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed `tokens` after the cached ones; their final hidden states [n, H] (pre-norm)."""
        n, past = len(tokens), self.cached_len
        end = past + n
        self._reserve(end)
        x = self.embed[torch.tensor(list(tokens), dtype=torch.long)]  # [n, H]
        positions = torch.arange(past, end).unsqueeze(0)
        cos, sin = (t[0] for t in self.rotary(x, positions))  # [n, D]
        mask = None
        if n > 1:  # causal among the new tokens; every cached token is visible
            mask = torch.ones(n, end, dtype=torch.bool).tril(past)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [n, 1, D]: one row for every head
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        for i, layer in enumerate(self.layers):
            h = layer.qkv(self._norm(x, layer.norm1)).view(n, heads + 2 * kv_heads, dim)
            qk = h[:, : heads + kv_heads]  # queries and keys rotate together
            qk = qk * cos + _rotate_half(qk) * sin
            keys, values = self._keys[i], self._values[i]
            keys[:, past:end] = qk[:, heads:].transpose(0, 1)
            values[:, past:end] = h[:, heads + kv_heads :].transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                qk[:, :heads].transpose(0, 1).unsqueeze(0), keys[:, :end].unsqueeze(0),
                values[:, :end].unsqueeze(0), attn_mask=mask, enable_gqa=True)
            x = x + layer.out(attn[0].transpose(0, 1).reshape(n, heads * dim))
            gate, up = layer.gate_up(self._norm(x, layer.norm2)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        self.cached_len = end
        return x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
