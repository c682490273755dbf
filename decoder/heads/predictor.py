"""Running the heads at inference: each head's top-k after one hidden state.

Tested by: tests/decoder/heads/test_heads.py"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from redraft.decoder.heads.blocks import PROJECTIONS, MedusaHeads
from redraft.decoder.heads.heads_file import HeadsError
from redraft.decoder.kernels import can_pack
from redraft.decoder.models.int8 import Int8Linear


class HeadsPredictor:
    """Runs the heads on one hidden state and returns each head's top-k token ids.

    The K head states go through the projection as one [K, H] x [H, V'] product, so the
    projection rows (the whole LM head, or the subset's rows) are read once per step. A step
    reads far more weight bytes than it computes with, so on a CPU model (any dtype) it runs in
    int8 by default (`int8=None`): the K blocks as two stacked int8 matmuls and the
    projection as a third, a quarter of the bytes (what that costs in accuracy:
    `tools/bench_medusa.py --accuracy-docs N`); `int8=False` keeps the exact float path, on
    packed oneDNN weights as the verifier does for the target's own layers. Drafts only:
    either way the target decides what is accepted.
    """

    def __init__(self, heads: MedusaHeads, model, projection: str = "full",
                 int8: bool | None = None) -> None:
        if projection not in PROJECTIONS:
            raise HeadsError(f"unknown projection {projection!r} (known: full, subset)")
        if projection == "subset" and not len(heads.vocab_subset):
            raise HeadsError("these heads have no vocabulary subset")
        lm_head = model.get_output_embeddings()
        weight = lm_head.weight.detach()
        bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()
        self.ids: torch.Tensor | None = None
        if projection == "subset":
            self.ids = heads.vocab_subset.to(weight.device)
            weight = weight.index_select(0, self.ids).contiguous()
            bias = None if bias is None else bias.index_select(0, self.ids)
        self.heads = heads.to(device=weight.device, dtype=weight.dtype)
        self.device, self.dtype = weight.device, weight.dtype
        self.embedding = model.get_input_embeddings().weight if heads.next_token else None
        self.projection = projection
        self.width = int(weight.shape[0])  # projection rows: guesses available per head
        if int8 is None:
            # on a CPU whatever the target's dtype: drafts only need the heads' top guesses,
            # and int8 is 2-3x cheaper than the exact path in float32 and bfloat16 alike
            int8 = weight.device.type == "cpu"
        self.int8 = False
        if int8:
            try:
                self._blocks, self._linear = _Int8Blocks(self.heads), Int8Linear(weight, bias)
                self.int8 = True
            except RuntimeError:  # a torch build without quantized CPU kernels
                pass
        if not self.int8:
            self._blocks = lambda h, e: self.heads(h, e)[0]
            self._linear = _linear_for(weight, bias)

    @torch.inference_mode()
    def topk(self, hidden: torch.Tensor, k: int, next_token: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids [K, k] (full-vocabulary ids) and their softmax probabilities [K, k].

        `next_token` is the token `hidden`'s row predicts (the tree's root); heads that read
        its embedding need it."""
        embedded = None
        if self.embedding is not None:
            if next_token is None:
                raise ValueError("these heads need the next token")
            embedded = self.embedding[next_token].reshape(1, -1).to(self.device, self.dtype)
        states = self._blocks(hidden.reshape(1, -1).to(self.device, self.dtype), embedded)
        logits = self._linear(states).float()
        values, idx = torch.topk(logits, k, dim=-1)
        probs = torch.exp(values - torch.logsumexp(logits, dim=-1, keepdim=True))
        if self.ids is not None:
            idx = self.ids[idx]
        return idx.cpu().numpy(), probs.cpu().numpy()


class _Int8Blocks:
    """The K blocks as int8 matmuls: every W_k stacked into one [K*H, H] layer (with the
    biases), every U_k into another. h and e are quantized separately: one activation scale
    shared by both would spend the 8 bits on the hidden state's outliers and flatten the
    embedding."""

    def __init__(self, heads: MedusaHeads) -> None:
        blocks = heads.blocks
        self.shape = (heads.num_heads, heads.hidden_size)
        self.w = Int8Linear.fused(*[b.linear for b in blocks])
        self.u = Int8Linear.fused(*[b.embed for b in blocks]) if heads.next_token else None

    def __call__(self, hidden: torch.Tensor, embedded: torch.Tensor | None) -> torch.Tensor:
        z = self.w(hidden)
        if self.u is not None:
            z = z + self.u(embedded)
        return hidden + F.silu(z.reshape(self.shape))


def _linear_for(weight: torch.Tensor, bias: torch.Tensor | None):
    """x -> x W^T + b, on packed oneDNN weights on a CPU where they apply (few rows, big W)."""
    if can_pack(weight.dtype, weight.device):
        try:
            with torch.inference_mode():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        except RuntimeError:  # a torch build whose oneDNN lacks the packed ops
            pass
    return lambda x: F.linear(x, weight, bias)
