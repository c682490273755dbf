"""Deciding which drafted tokens to keep, given the target's logits over root + tree.

- Greedy: the longest path whose every token equals the target's argmax, then the argmax
  after it as the bonus token. Identical to plain greedy decoding by construction.
- Sampling (temperature / top-p / top-k): recursive rejection sampling. At each node the
  children are tried in order against the *residual* target distribution; a rejected child's
  token is removed from the residual and the rest renormalised. Our drafters are
  deterministic (each child is a point mass), so the accepted token is distributed exactly
  as the target's distribution: the output is lossless for trees with any branching.
- Typical acceptance (Medusa's rule) accepts tokens the target finds "plausible enough".
  It changes the output distribution, so it is only used when explicitly asked for (lossy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from redraft.proto.tree import Tree


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the target's logits. temperature 0 = greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    typical: bool = False  # lossy: Medusa's typical acceptance
    typical_threshold: float = 0.09
    typical_alpha: float = 0.3

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass
class Acceptance:
    """Result of one verification: accepted tree nodes (one path) and the tokens they give."""

    nodes: list[int] = field(default_factory=list)  # accepted tree indices, root to leaf
    tokens: list[int] = field(default_factory=list)  # accepted draft tokens + the bonus token
    # the target's top-k (ids, probs) after root and each node, when the loop asked for them
    candidates: tuple | None = None
    # the final hidden state of the last accepted row, when the loop asked for it
    hidden: object | None = None
    # the target's top-k (ids, probs) after each side row, when the forward had side rows
    side: tuple | None = None

    @property
    def bonus(self) -> int:
        return self.tokens[-1]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution plain sampling would draw from, row-wise: temperature, top-k, top-p."""
    x = logits.float() / max(params.temperature, 1e-8)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p. The first token always stays,
        # however small top_p is (a top_p below float32's range compares as 0).
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def accept_greedy(logits: torch.Tensor, tree: Tree) -> Acceptance:
    """Follow the target's argmax down the tree for as long as a child matches it."""
    best = logits.argmax(dim=-1).tolist()
    kids = tree.children()
    out = Acceptance()
    node = -1
    while True:
        want = best[node + 1]
        nxt = next((c for c in kids[node + 1] if tree.tokens[c] == want), None)
        out.tokens.append(want)
        if nxt is None:
            return out
        out.nodes.append(nxt)
        node = nxt


def accept_sampling(
    logits: torch.Tensor, tree: Tree, params: SamplingParams, generator: torch.Generator
) -> Acceptance:
    """Recursive rejection sampling over a multi-child tree (lossless)."""
    kids = tree.children()
    out = Acceptance()
    node = -1
    while True:
        residual = target_probs(logits[node + 1], params).cpu().double()
        nxt = None
        for c in kids[node + 1]:
            tok = tree.tokens[c]
            p = float(residual[tok])
            # A point-mass draft q = delta(tok) is accepted with prob min(1, r(tok) / q(tok)).
            if p > 0.0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < p:
                nxt = c
                break
            # Rejected: the residual becomes norm(max(r - q, 0)), i.e. r without tok.
            residual[tok] = 0.0
            total = float(residual.sum())
            if total <= 0.0:  # only reachable through rounding: nothing left to reject into
                break
            residual /= total
        if nxt is None:
            if float(residual.sum()) <= 0.0:
                residual = target_probs(logits[node + 1], params).cpu().double()
            out.tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
            return out
        out.nodes.append(nxt)
        out.tokens.append(tree.tokens[nxt])
        node = nxt


def accept_typical(
    logits: torch.Tensor, tree: Tree, params: SamplingParams, generator: torch.Generator
) -> Acceptance:
    """Medusa's typical acceptance: keep a child if p(token) > min(eps, alpha * exp(-H)).

    Lossy: the output no longer follows the target's distribution exactly.
    """
    kids = tree.children()
    out = Acceptance()
    node = -1
    while True:
        probs = target_probs(logits[node + 1], params) if not params.greedy else torch.softmax(
            logits[node + 1].float(), dim=-1
        )
        entropy = float(-(probs * torch.log(probs.clamp_min(1e-20))).sum())
        limit = min(params.typical_threshold, params.typical_alpha * math.exp(-entropy))
        good = [c for c in kids[node + 1] if float(probs[tree.tokens[c]]) > limit]
        if not good:
            if params.greedy:
                out.tokens.append(int(probs.argmax()))
            else:
                out.tokens.append(int(torch.multinomial(probs.cpu(), 1, generator=generator)))
            return out
        nxt = max(good, key=lambda c: float(probs[tree.tokens[c]]))
        out.nodes.append(nxt)
        out.tokens.append(tree.tokens[nxt])
        node = nxt


def accept(
    logits: torch.Tensor, tree: Tree, params: SamplingParams, generator: torch.Generator
) -> Acceptance:
    """Dispatch on the sampling parameters."""
    if params.typical:
        return accept_typical(logits, tree, params, generator)
    if params.greedy:
        return accept_greedy(logits, tree)
    return accept_sampling(logits, tree, params, generator)


def top_candidates(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely next tokens after each row of `logits`, with their probabilities
    (what the loop hands drafters that learn from the forward: `Drafter.observe`)."""
    logits = logits.float()
    values, ids = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
    probs = torch.exp(values - torch.logsumexp(logits, dim=-1, keepdim=True))
    return ids.cpu().numpy().astype(np.int32), probs.cpu().numpy().astype(np.float32)
