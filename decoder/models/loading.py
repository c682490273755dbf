"""Loading the target model: the same name resolution as the datastore side, so both agree.

CUDA and bfloat16 when a GPU is present (verification is memory-bound there and bf16 halves
the traffic). On a CPU the default (`auto`) is bfloat16 where the CPU has bf16 units
(`kernels.cpu_has_bf16`: AVX512-BF16 or AMX), float32 elsewhere: with bf16 units the default
drafters run about 1.4x faster in bfloat16 (docs/decoding.md), and the verifier's exact
forwards keep speculative output identical to plain decoding in bfloat16. Without them
oneDNN emulates bf16, slower than float32. `--dtype float32` stays selectable everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import os
import shutil

import torch
import transformers
from redraft.decoder.kernels import cpu_has_bf16
from redraft.decoder.models import gguf_blocks
from redraft.proto.errors import ModelNotFound
from redraft.proto.files import cache_root, write_cache
from redraft.proto.models import ModelSource, gguf_key, load_tokenizer, resolve_model
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_cpu_dtype() -> torch.dtype:
    """The CPU's default precision: bfloat16 on a CPU with bf16 units, else float32."""
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """A dtype name (or None / "auto": the device's default) as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype.lower() == "auto":
        return torch.bfloat16 if device.startswith("cuda") else default_cpu_dtype()
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ModelNotFound(f"unknown dtype {dtype!r} (known: {', '.join(_DTYPES)})") from None


def add_dtype_option(parser, extra: str = "") -> None:
    """`--dtype` for the commands that load the target model."""
    parser.add_argument(
        "--dtype", default=None, type=_checked_dtype, metavar="DTYPE",
        help="float32, bfloat16 or auto (the default: bfloat16 on a GPU and on a CPU with "
        "bf16 units, float32 on other CPUs)" + extra)


def _checked_dtype(name: str) -> str:
    if name.lower() != "auto" and name.lower() not in _DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r} (known: auto, "
                                         f"{', '.join(_DTYPES)})")
    return name


_LOADED: dict[tuple, tuple] = {}


def load_model(name: str | None = None, device: str | None = None, dtype=None):
    """Return (model, tokenizer) for a model name (see `resolve_model`), in eval mode.

    Loaded models are kept for the life of the process, so repeated calls with the same
    arguments are free. A GGUF model's dense weights are also kept on disk (`dense_weights`):
    de-quantising the default model takes 15-20 s, reading its dense copy about one.
    """
    source = resolve_model(name)
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    key = (source, device, torch_dtype)
    if key not in _LOADED:
        _LOADED[key] = _load(source, name, device, torch_dtype)
    return _LOADED[key]


def _load(source: ModelSource, name, device: str, torch_dtype: torch.dtype):
    tokenizer = load_tokenizer(name)
    model = (dense_weights(source, torch_dtype) if source.gguf_file
             else _from_pretrained(source, source.path, torch_dtype))
    model.to(device)
    model.eval()
    if source.gguf_file:  # the verifier reads the file's own blocks (gguf_blocks)
        gguf_blocks.attach(model, os.path.join(source.path, source.gguf_file))
    return model, tokenizer


def dense_weights(source: ModelSource, torch_dtype: torch.dtype):
    """A GGUF model, de-quantised once and then read from a dense float32 copy in the cache
    (a Hugging Face folder keyed by the GGUF file and the transformers version), cast to
    `torch_dtype`. Casting the float32 copy is what loading the GGUF file in that dtype does,
    so the weights are the same either way (tests/decoder/models/test_loading.py). A cache
    that cannot be read is converted again; one that cannot be written only costs time."""
    folder = cache_root() / "models" / gguf_key(source, f"|{transformers.__version__}")
    if (folder / "config.json").is_file():
        try:
            return _from_pretrained(source, str(folder), torch_dtype)
        except Exception:  # a damaged or foreign cache entry: converted again below
            shutil.rmtree(folder, ignore_errors=True)
    dense = dense_copy(_from_pretrained(source, source.path, torch.float32,
                                        gguf_file=source.gguf_file))
    with _quiet():
        write_cache(folder, lambda tmp: dense.save_pretrained(str(tmp)))
    return cast_parameters(dense, torch_dtype)


def cast_parameters(model, torch_dtype: torch.dtype):
    """The model's parameters in `torch_dtype`, its buffers (the rotary embedding's inverse
    frequencies) kept in float32, as `from_pretrained` in that dtype leaves them: a model cast
    whole would compute its rotary angles in bfloat16, and the first run (converted from the
    GGUF) would decode other tokens than every later one (read from the cache)."""
    buffers = [(module, name, b) for module in model.modules()
               for name, b in module._buffers.items() if b is not None]
    model.to(torch_dtype)
    for module, name, b in buffers:
        module._buffers[name] = b
    return model


def dense_copy(model):
    """The same weights, in float32, in a model built from its config: transformers refuses
    to save a model loaded from GGUF (it keeps the quantization config), though its weights
    are dense."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(model.state_dict())
    dense.generation_config = copy.deepcopy(model.generation_config)
    return dense.eval()


def _from_pretrained(source: ModelSource, path: str, torch_dtype: torch.dtype, **kwargs):
    try:
        with _quiet():
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"cannot load model {source.name!r}: {exc}") from exc


@contextlib.contextmanager
def _quiet():
    """Progress bars (GGUF de-quantisation and saving write bare tqdm bars to stderr) would
    clutter streamed output; the captured text is dropped. The GGUF loader's warning that
    bfloat16 is slower for its quantized kernels is silenced too: the model is dense after
    loading, so it does not apply (and its logger writes to the real stderr)."""
    hf_logging.disable_progress_bar()
    gguf_log = hf_logging.get_logger("transformers.quantizers.quantizer_gguf")
    level = gguf_log.level
    gguf_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.enable_progress_bar()
        gguf_log.setLevel(level)
