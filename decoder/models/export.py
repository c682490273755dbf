"""A model as a plain Hugging Face folder (config, float32 safetensors, tokenizer).

Why: engines such as vLLM load a Hugging Face folder, not the GGUF file the default model
ships as; the folder holds exactly the weights redraft's own loader de-quantises, so the
engine and redraft verify with the same model.

    python -m redraft.decoder.models.export OUT_DIR [--model NAME]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from redraft.decoder.models.loading import load_model
from redraft.proto.errors import RedraftError
from redraft.proto.models import DEFAULT_MODEL


def export_hf_folder(out: str | os.PathLike, model: str | None = None) -> Path:
    """Write `model` (default: the default model) to `out` as float32; the folder is written
    beside it and renamed into place, so a folder at `out` is always whole."""
    out = Path(out)
    if out.exists():
        raise RedraftError(f"{out} exists; remove it first")
    # A GGUF model loads as its dense copy (`dense_weights`), which saves as any model does.
    dense, tokenizer = load_model(model, device="cpu", dtype="float32")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted export
    dense.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m redraft.decoder.models.export",
                                description=__doc__.splitlines()[0])
    p.add_argument("out", help="the folder to write (must not exist)")
    p.add_argument("--model", default=None, help=f"model name or path (default {DEFAULT_MODEL})")
    args = p.parse_args(argv)
    try:
        print(export_hf_folder(args.out, args.model))
    except RedraftError as exc:
        print(f"export: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
