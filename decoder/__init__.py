"""The decoder side: lossless speculative decoding over Hugging Face causal LMs.

The loop lives at the top of this package (generate, verify, acceptance, budget, text,
kernels, and the `drafter` interface it talks to); `policy` holds the torch-free rules it
shares with `engines/` (calibration and the budget's choice); `models/` loads and
quantizes models, `drafters/` holds one module per drafter and the registry, `heads/` the
Medusa heads, `bench/` the benchmark and `cli/` the `redraft` command.

    from redraft.decoder import Generator, load_model, build_drafter
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redraft.decoder.drafters.registry import build_drafter
    from redraft.decoder.generate import Generator
    from redraft.decoder.models.loading import load_model

__all__ = ["Generator", "build_drafter", "load_model"]


def __getattr__(name: str):
    """The public API, imported on first use: the `redraft` command starts through this
    package, and its datastore commands must not import torch."""
    if name == "Generator":
        from redraft.decoder.generate import Generator  # lazy: torch, see above

        return Generator
    if name == "load_model":
        from redraft.decoder.models.loading import load_model  # lazy: torch, see above

        return load_model
    if name == "build_drafter":
        from redraft.decoder.drafters.registry import build_drafter  # lazy: torch, see above

        return build_drafter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
