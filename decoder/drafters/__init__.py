"""Drafters: one module per source of drafts, behind the `Drafter` interface (`base`).

Which drafters exist, their options and how to build them: `redraft.decoder.registry`.
"""

from redraft.decoder.drafters.base import (
    DEFAULT_MAX_DEPTH,
    Drafter,
    MergedDrafter,
    UnknownDrafter,
)

__all__ = ["DEFAULT_MAX_DEPTH", "Drafter", "MergedDrafter", "UnknownDrafter"]
