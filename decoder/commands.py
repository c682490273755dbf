"""The decoder's subcommands: `redraft generate` (and `redraft bench`)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add generate/bench to the `redraft` parser (filled in by the decoder issue)."""
