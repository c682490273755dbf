"""Loading the target model: the same name resolution as the datastore side, so both agree.

CUDA and bfloat16 when a GPU is present (verification is memory-bound there and bf16 halves
the traffic); float32 on CPU, where bf16 matmuls are slow and rounding would make tree and
sequential forwards disagree more often.
"""

from __future__ import annotations

import contextlib
import io

import torch
from redraft.proto.errors import ModelNotFound
from redraft.proto.models import load_tokenizer, resolve_model
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ModelNotFound(f"unknown dtype {dtype!r} (known: {', '.join(_DTYPES)})") from None


_LOADED: dict[tuple, tuple] = {}


def load_model(name: str | None = None, device: str | None = None, dtype=None):
    """Return (model, tokenizer) for a model name (see `resolve_model`), in eval mode.

    Loaded models are kept for the life of the process (loading the default model means
    de-quantising a GGUF file, ~10 s), so repeated calls with the same arguments are free.
    """
    source = resolve_model(name)
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    key = (source, device, torch_dtype)
    if key not in _LOADED:
        _LOADED[key] = _load(source, name, device, torch_dtype)
    return _LOADED[key]


def _load(source, name, device: str, torch_dtype: torch.dtype):
    tokenizer = load_tokenizer(name)
    # Progress bars (GGUF de-quantisation writes a bare tqdm bar to stderr) would clutter
    # streamed output; the captured text is dropped unless loading fails.
    hf_logging.disable_progress_bar()
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            model = AutoModelForCausalLM.from_pretrained(
                source.path, dtype=torch_dtype, **source.kwargs()
            )
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"cannot load model {source.name!r}: {exc}") from exc
    finally:
        hf_logging.enable_progress_bar()
    model.to(device)
    model.eval()
    return model, tokenizer
