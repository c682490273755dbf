"""The heads committed with redraft: `decoder/heads/NAME.safetensors` for a model name.

Kept apart from the heads file's code so that finding them (what the default drafters
depend on) imports nothing heavy.

Tested by: tests/decoder/heads/test_heads_file.py
"""

from __future__ import annotations

from pathlib import Path

from redraft.proto.models import DEFAULT_MODEL

HEADS_DIR = Path(__file__).resolve().parent


def default_heads_path(model_name: str | None) -> Path | None:
    """The committed heads of a known model name (`decoder/heads/NAME.safetensors`), if any."""
    name = model_name or DEFAULT_MODEL
    if "/" in name or name.endswith(".gguf"):
        return None
    path = HEADS_DIR / f"{name}.safetensors"
    return path if path.is_file() else None
