"""The heads file, and the target identity it is checked against.

Heads file: safetensors (`block.{k}.weight`, `block.{k}.bias`, and `block.{k}.embed` for
heads that read the next token, in bfloat16, `vocab_subset` int32) with one metadata entry,
`redraft`, holding JSON (format, version, sizes, the model and its fingerprint, held-out
accuracies, training details). Heads trained for another model are refused
(`HeadsMismatch`): the blocks are fitted to one model's hidden states and would draft
garbage for any other.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path

import torch
from redraft.decoder.heads.blocks import MedusaHeads
from redraft.proto.errors import RedraftError
from redraft.proto.files import write_atomically
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FORMAT = "redraft-medusa"
VERSION = 2  # 2 added heads that read the next token's embedding (`next_token`)
READS = (1, 2)


class HeadsError(RedraftError):
    """A heads file that is missing, damaged, or not a heads file."""


class HeadsMismatch(HeadsError):
    """A heads file made for another model (other weights, sizes or vocabulary)."""


# -- the target's identity --------------------------------------------------------------------

_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_fingerprint(model) -> str:
    """A hash of the target's weights that survives a change of dtype or device.

    Each parameter contributes its name, shape and up to 4,096 evenly strided values rounded
    to bfloat16 (what a bfloat16 copy of a float32 model holds exactly), so the same model
    loaded in float32 on a CPU or bfloat16 on a GPU gives one fingerprint, and a fine-tune
    that changes the weights gives another. Cached per model object.
    """
    if model in _FINGERPRINTS:
        return _FINGERPRINTS[model]
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)][:4096]
            values = sample.to(torch.bfloat16).float().cpu().numpy()
            digest.update(f"{name}:{tuple(param.shape)}:".encode())
            digest.update(values.astype("<f4").tobytes())
    out = "sha256:" + digest.hexdigest()[:32]
    _FINGERPRINTS[model] = out
    return out


def save_heads(heads: MedusaHeads, path: str | Path, meta: dict) -> None:
    """Write the blocks in bfloat16 plus the JSON metadata (atomically)."""
    tensors = {}
    for k, block in enumerate(heads.blocks):
        tensors[f"block.{k}.weight"] = block.linear.weight.detach().to(torch.bfloat16).cpu()
        tensors[f"block.{k}.bias"] = block.linear.bias.detach().to(torch.bfloat16).cpu()
        if block.embed is not None:
            tensors[f"block.{k}.embed"] = block.embed.weight.detach().to(torch.bfloat16).cpu()
    tensors["vocab_subset"] = heads.vocab_subset.to(torch.int32).cpu().contiguous()
    meta = {"format": FORMAT, "version": VERSION, "num_heads": heads.num_heads,
            "hidden_size": heads.hidden_size, "vocab_subset_size": len(heads.vocab_subset),
            "next_token": heads.next_token, "dtype": "bfloat16", **meta}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata={"redraft": json.dumps(meta, sort_keys=True)})
        tmp.chmod(0o644)  # a shareable file like any other output, not the writer's private one

    write_atomically(path, write)
    heads.meta = meta


def read_meta(path: str | Path) -> dict:
    """The JSON metadata of a heads file (no tensors read)."""
    path = Path(path)
    if not path.is_file():
        raise HeadsError(f"heads file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("redraft")
        meta = json.loads(raw) if raw else None
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise HeadsError(f"{path}: not a safetensors heads file ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise HeadsError(f"{path}: not a redraft Medusa heads file")
    if meta.get("version") not in READS:
        raise HeadsError(f"{path}: heads format version {meta.get('version')}, "
                         f"this redraft reads {', '.join(map(str, READS))}")
    return meta


def load_heads(path: str | Path, model=None) -> MedusaHeads:
    """Read a heads file; with `model`, refuse heads trained for any other model."""
    path = Path(path)
    meta = read_meta(path)
    if model is not None:
        check_model(meta, model, path)
    try:
        tensors = load_file(str(path))
        k, hidden = int(meta["num_heads"]), int(meta["hidden_size"])
        heads = MedusaHeads(hidden, k, tensors["vocab_subset"].long(), meta,
                            next_token=bool(meta.get("next_token", False)))
        for i, block in enumerate(heads.blocks):
            block.linear.weight.data.copy_(tensors[f"block.{i}.weight"].float())
            block.linear.bias.data.copy_(tensors[f"block.{i}.bias"].float())
            if block.embed is not None:
                block.embed.weight.data.copy_(tensors[f"block.{i}.embed"].float())
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise HeadsError(f"{path}: damaged heads file ({exc})") from None
    heads.eval()
    if model is not None:
        p = next(model.parameters())
        heads.to(device=p.device, dtype=p.dtype)
    return heads


def check_model(meta: dict, model, path: str | Path) -> None:
    """Raise HeadsMismatch unless the heads were trained on this model's weights."""
    cfg = model.config
    hidden, vocab = int(cfg.hidden_size), int(cfg.vocab_size)
    if int(meta.get("hidden_size", -1)) != hidden or int(meta.get("vocab_size", -1)) != vocab:
        raise HeadsMismatch(
            f"{path}: heads for hidden size {meta.get('hidden_size')} / vocabulary "
            f"{meta.get('vocab_size')} (model {meta.get('model')!r}); this model has "
            f"{hidden} / {vocab}")
    fingerprint = model_fingerprint(model)
    if meta.get("model_fingerprint") != fingerprint:
        raise HeadsMismatch(
            f"{path}: heads were trained for model {meta.get('model')!r} "
            f"({meta.get('model_fingerprint')}); this model's weights are {fingerprint}")
