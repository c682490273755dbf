"""A lean int8 decoder for drafting: the target's own Llama-style stack on the lean forward
(`redraft.decoder.lean`), with int8 matmuls over fused weights and float32 activations.

Why not the Hugging Face model with int8 linear layers: on the default model a one-token
forward through those modules costs ~40 ms on this CPU, of which the int8 matmuls are about
a third; the rest is per-module and per-op overhead (seven separate projections per layer,
each quantizing the same activations again, the cache object, the mask machinery). The lean
forward fuses the query/key/value and gate/up projections into one int8 matmul each
(per-channel weight scales make the fused matmul compute exactly what the separate ones
would) and keeps its cache in two preallocated tensors per layer.

Activations, norms, rotary and the cache are float32 whatever the target's dtype: the int8
kernels take and return float32 anyway, and CPU attention in bfloat16 is several times slower.

Only plain Llama/Qwen2 stacks run this way (`lean.plain_stack`); `lean_int8` returns None
for anything else and the caller uses the module-by-module int8 model instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from redraft.decoder.lean import CausalAttention, LeanStack, plain_stack
from redraft.decoder.models.int8 import Int8Linear


def lean_int8(target) -> Int8Decoder | None:
    """The target as an `Int8Decoder`, or None where its architecture is not a plain stack."""
    return Int8Decoder(target) if plain_stack(target) else None


class Int8Decoder:
    """The target's stack in int8 with a KV cache of its own: `extend` appends tokens,
    `next_logits` appends tokens and returns the logits after the last, `truncate` rolls
    back. Embeddings and rotary tables are the target's own tensors."""

    def __init__(self, target) -> None:
        self.config = target.config
        self.stack = LeanStack(target, lambda linears: Int8Linear.fused(*linears),
                               torch.float32)

    @property
    def cached_len(self) -> int:
        return self.stack.length

    def reset(self) -> None:
        self.stack.length = 0

    def truncate(self, length: int) -> None:
        self.stack.truncate(length)

    @torch.inference_mode()
    def extend(self, tokens: Sequence[int]) -> None:
        if tokens:
            self._run(tokens)

    @torch.inference_mode()
    def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append `tokens` to the cache; float32 logits [V] after the last of them."""
        hidden = self._run(tokens)[-1:]
        return self.stack.logits(self.stack.final(hidden))[0]

    def _run(self, tokens: Sequence[int]) -> torch.Tensor:
        start = self.stack.length
        return self.stack.run(tokens, range(start, start + len(tokens)), CausalAttention())
