"""Medusa heads: small learned blocks that guess several tokens ahead from one hidden state.

After a verification forward the target's final (post-norm) hidden state of the last accepted
row already gives the next token through the target's own LM head (the bonus token). Head k
(k = 1..K) guesses the token k places after that one: a residual SiLU block
`h + SiLU(W_k h + b_k)` followed by an LM projection. That next token is known when drafting
(it is the tree's root), so heads may also read its input embedding e:
`h + SiLU(W_k h + U_k e + b_k)` (`next_token`; Medusa-1's heads do not, and EAGLE-style
drafters show how much the token itself tells). The blocks start at zero, so an untrained
head repeats the next-token prediction, which is a sensible start.

The projection is the frozen target's LM head, shared (no weights stored), either in full or
restricted to a frequency-ranked vocabulary subset (the ids the model itself emits most
often, as FR-Spec does): K blocks of H x H weights are all a heads file stores, and one
projection matmul serves all K heads (`predictor.HeadsPredictor`).

Tested by: tests/decoder/heads/test_heads.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_HEADS = 4
PROJECTIONS = ("full", "subset")


class ResidualBlock(nn.Module):
    """h + SiLU(W h + b), or h + SiLU(W h + U e + b) when the block also sees e, the next
    token's input embedding; zero-initialised so that it starts as the identity."""

    def __init__(self, hidden_size: int, next_token: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.embed: nn.Linear | None = None
        if next_token:
            self.embed = nn.Linear(hidden_size, hidden_size, bias=False)
            nn.init.zeros_(self.embed.weight)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor | None = None) -> torch.Tensor:
        z = self.linear(hidden)
        if self.embed is not None:
            z = z + self.embed(embedded)
        return hidden + F.silu(z)


class MedusaHeads(nn.Module):
    """K residual blocks plus what the heads file records about them.

    `forward(hidden [..., H], embedded [..., H]) -> [..., K, H]`: each head's hidden state,
    ready for the LM projection. With `next_token`, the blocks also read `embedded`, the
    input embedding of the token the hidden state's own row predicts (the next token, known
    when drafting: it is the tree's root); Medusa-1's heads (`next_token=False`) do not, and
    have to guess past it. `vocab_subset` lists the projection subset's token ids (most
    frequent first).
    """

    def __init__(self, hidden_size: int, num_heads: int = DEFAULT_HEADS,
                 vocab_subset: torch.Tensor | None = None, meta: dict | None = None,
                 next_token: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.next_token = next_token
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, next_token)
                                    for _ in range(num_heads))
        subset = torch.zeros(0, dtype=torch.long) if vocab_subset is None else vocab_subset
        self.register_buffer("vocab_subset", subset.to(torch.long), persistent=False)
        self.meta = dict(meta or {})

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor | None = None
                ) -> torch.Tensor:
        if self.next_token and embedded is None:
            raise ValueError("these heads read the next token's embedding too")
        return torch.stack([block(hidden, embedded) for block in self.blocks], dim=-2)

    def accuracy(self, projection: str) -> list[list[float]] | None:
        """Held-out top-1..top-n accuracy per head (cumulative) for a projection, if recorded."""
        acc = self.meta.get("accuracy", {}).get(projection)
        return None if acc is None else [list(map(float, row)) for row in acc["topk"]]
