"""When two greedy decodings of one model may differ without a bug: a near-tie.

Two forwards that compute the same logits with another blocking of their matmuls (a tree
forward and a one-token forward, packed and stock kernels, redraft and Hugging Face) round
differently in the last bits, and where the top two logits are that close the argmax may
flip. The rule is relative to the logits' precision: float32 logits round at ~1e-7 of their
size, so a gap under 1e-3 is a near-tie; bfloat16 logits keep 8 significant bits (one unit in
the last place is 0.0625 at a top logit of 8-16), and exact or one-ulp ties are common, so a
gap of up to 4 ulps of the top logit is.

Tested by: tests/decoder/test_generate.py, tests/decoder/cli/test_generate_cli_exact.py
"""

from __future__ import annotations

import math

import torch

FLOAT32_NEAR_TIE = 1e-3  # absolute logit gap
LOW_PRECISION_ULPS = 4  # gap in units in the last place of the top logit
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def near_tie_limit(top: float, dtype: torch.dtype) -> float:
    """The largest top-two logit gap that counts as a near-tie for logits of `dtype`."""
    bits = _MANTISSA_BITS.get(dtype)
    if bits is None or top == 0 or not math.isfinite(top):
        return FLOAT32_NEAR_TIE
    return LOW_PRECISION_ULPS * 2.0 ** (math.floor(math.log2(abs(top))) - bits)


def top2_gap(logits: torch.Tensor) -> tuple[float, float]:
    """(top logit, gap to the second) of a [V] logits row."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0]), float(top[0] - top[1])


def is_near_tie(logits: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """(whether the row's top two logits are a near-tie for `dtype`, their gap)."""
    top, gap = top2_gap(logits)
    return gap <= near_tie_limit(top, dtype), gap
