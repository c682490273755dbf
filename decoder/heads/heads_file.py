"""The heads file, and the target identity it is checked against.

Heads file: safetensors (`block.{k}.weight`, `block.{k}.bias`, and `block.{k}.embed` for
heads that read the next token, in bfloat16, `vocab_subset` int32) with one metadata entry,
`redraft`, holding JSON (format, version, sizes, the model and its fingerprint, held-out
accuracies, training details, and from version 3 a crc32 of every tensor's bytes). Heads
trained for another model are refused (`HeadsMismatch`): the blocks are fitted to one
model's hidden states and would draft garbage for any other.

Everything a file claims is checked before anything is allocated from it: the header is
parsed by hand (its length against the file's), the metadata's types and ranges, the
tensors the header lists against the ones the metadata implies (names, shapes, dtypes,
offsets), and the model's sizes and fingerprint; only then are the tensor bytes read, their
checksums compared and the subset's token ids checked. So a tampered `num_heads` or
`hidden_size` is one error, never gigabytes of blocks allocated first, and a flipped tensor
byte is one error, never heads that silently draft worse.
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from redraft.decoder.heads.blocks import PROJECTIONS, MedusaHeads
from redraft.proto.errors import RedraftError
from redraft.proto.files import write_atomically
from safetensors.torch import load, save_file

FORMAT = "redraft-medusa"
# 2 added heads that read the next token's embedding (`next_token`); 3 a crc32 per tensor
VERSION = 3
READS = (1, 2, 3)
MAX_HEADS = 64  # more heads than any tree could use (trees are at most 64 nodes)
MAX_HIDDEN = 1 << 16
MAX_HEADER = 1 << 24  # bytes of header JSON (the committed file's: 3 KB)
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}
_FLOATS = ("BF16", "F16", "F32")
_INTS = ("I32", "I64")


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


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes as safetensors stores them (little-endian, row-major)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


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
    write_heads_file(tensors, path, meta)
    heads.meta = meta


def write_heads_file(tensors: dict[str, torch.Tensor], path: str | Path, meta: dict) -> None:
    """Tensors and metadata as a heads file of this version, with a crc32 of every tensor's
    bytes (atomically)."""
    meta = {**meta, "version": VERSION,
            "crc32": {name: zlib.crc32(_tensor_bytes(t)) for name, t in tensors.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata={"redraft": json.dumps(meta, sort_keys=True)})
        tmp.chmod(0o644)  # a shareable file like any other output, not the writer's private one

    write_atomically(path, write)


# -- reading: everything checked before anything is allocated ---------------------------------


@dataclass(frozen=True)
class _Entry:
    """One tensor as the header lists it: dtype, shape, and where its bytes are in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class HeadsFile:
    """A heads file read and checked without a model: its metadata and its tensors."""

    path: Path
    meta: dict
    tensors: dict[str, torch.Tensor]


def read_meta(path: str | Path) -> dict:
    """The metadata of a heads file, checked, with the tensors its header lists (no tensor
    read)."""
    path = Path(path)
    head = _read(path, header_only=True)
    return _header(path, head, path.stat().st_size)[0]


def read_heads(path: str | Path) -> HeadsFile:
    """Every check that needs no model (metadata, header, checksums, the subset's ids), then
    the tensors."""
    path = Path(path)
    data = _read(path, header_only=False)
    meta, entries = _header(path, data, len(data))
    sums = meta.get("crc32")
    if sums is not None:
        for name, e in entries.items():
            if zlib.crc32(memoryview(data)[e.start:e.end]) != sums[name]:
                raise HeadsError(f"{path}: checksum mismatch in tensor {name} (a damaged "
                                 "heads file)")
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise HeadsError(f"{path}: damaged heads file ({exc})") from None
    ids = tensors["vocab_subset"]
    if ids.ndim != 1:
        raise HeadsError(f"{path}: vocab_subset must be one-dimensional")
    vocab = meta["vocab_size"]
    if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise HeadsError(f"{path}: vocab_subset holds token id {bad}, outside the "
                         f"vocabulary [0, {vocab})")
    return HeadsFile(path, meta, tensors)


def load_heads(path: str | Path, model=None) -> MedusaHeads:
    """Read a heads file; with `model`, refuse heads trained for any other model (checked
    before any tensor is read)."""
    path = Path(path)
    if model is not None:
        check_model(read_meta(path), model, path)
    return build_heads(read_heads(path), model)


def build_heads(f: HeadsFile, model=None) -> MedusaHeads:
    """The heads of a checked file (`read_heads`), on `model`'s device and dtype if given
    (refused unless trained for it)."""
    meta, t = f.meta, f.tensors
    if model is not None:
        check_model(meta, model, f.path)
    heads = MedusaHeads(meta["hidden_size"], meta["num_heads"], t["vocab_subset"].long(), meta,
                        next_token=meta["next_token"])
    with torch.no_grad():
        for i, block in enumerate(heads.blocks):
            block.linear.weight.copy_(t[f"block.{i}.weight"].float())
            block.linear.bias.copy_(t[f"block.{i}.bias"].float())
            if block.embed is not None:
                block.embed.weight.copy_(t[f"block.{i}.embed"].float())
    heads.eval()
    if model is not None:
        p = next(model.parameters())
        heads.to(device=p.device, dtype=p.dtype)
    return heads


def _read(path: Path, header_only: bool) -> bytes:
    """The file's bytes: its header (the 8-byte length and the JSON) or all of them."""
    if not path.is_file():
        raise HeadsError(f"heads file not found: {path}")
    try:
        with open(path, "rb") as f:
            if not header_only:
                return f.read()
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            return head + f.read(min(n, MAX_HEADER + 1))
    except OSError as exc:
        raise HeadsError(f"cannot read heads file {path}: {exc.strerror or exc}") from None


def _header(path: Path, data: bytes, size: int) -> tuple[dict, dict[str, _Entry]]:
    """(metadata, tensors) from the file's first bytes, all checked against each other."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 2 <= n <= min(MAX_HEADER, size - 8) or len(data) < 8 + n:
        raise HeadsError(f"{path}: not a safetensors heads file (header length {n} in a file "
                         f"of {size} bytes)")
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise HeadsError(f"{path}: not a safetensors heads file ({type(exc).__name__})") \
            from None
    if not isinstance(header, dict):
        raise HeadsError(f"{path}: not a safetensors heads file (header is not an object)")
    extra = header.pop("__metadata__", None)
    raw = extra.get("redraft") if isinstance(extra, dict) else None
    try:
        meta = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise HeadsError(f"{path}: not a redraft Medusa heads file")
    version = meta.get("version")
    if type(version) is not int or version not in READS:
        raise HeadsError(f"{path}: heads format version {version!r:.20}, this redraft reads "
                         f"{', '.join(map(str, READS))}")
    _check_meta(path, meta)
    entries = {name: _entry(path, name, e, 8 + n, size) for name, e in header.items()}
    _check_tensors(path, meta, entries, size)
    return meta, entries


def _bad(path: Path, what: str, value) -> HeadsError:
    return HeadsError(f"{path}: {what}, got {value!r:.60}")


def _is_int(value, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi


def _check_meta(path: Path, meta: dict) -> None:
    """The metadata's types and ranges (what the loader and the drafter read from it)."""
    sizes = (("num_heads", 1, MAX_HEADS), ("hidden_size", 1, MAX_HIDDEN),
             ("vocab_size", 1, 1 << 31))
    for key, lo, hi in sizes:
        if not _is_int(meta.get(key), lo, hi):
            raise _bad(path, f"{key} must be an integer in {lo}..{hi}", meta.get(key))
    if not _is_int(meta.get("vocab_subset_size"), 0, meta["vocab_size"]):
        raise _bad(path, f"vocab_subset_size must be an integer in 0..{meta['vocab_size']}",
                   meta.get("vocab_subset_size"))
    meta.setdefault("next_token", False)  # version 1 predates heads that read it
    if type(meta["next_token"]) is not bool:
        raise _bad(path, "next_token must be true or false", meta["next_token"])
    for key in ("model", "model_fingerprint"):
        if key in meta and not isinstance(meta[key], str):
            raise _bad(path, f"{key} must be a string", meta[key])
    if "projection" in meta and meta["projection"] not in PROJECTIONS:
        raise _bad(path, "projection must be full or subset", meta["projection"])
    accuracy = meta.get("accuracy", {})
    if not isinstance(accuracy, dict):
        raise _bad(path, "accuracy must be an object", accuracy)
    for projection in PROJECTIONS:
        if projection in accuracy:
            _check_accuracy(path, projection, accuracy[projection], meta["num_heads"])
    if meta["version"] >= 3:
        sums = meta.get("crc32")
        if not isinstance(sums, dict) or not all(_is_int(v, 0, (1 << 32) - 1)
                                                 for v in sums.values()):
            raise _bad(path, "crc32 must map every tensor to its checksum", sums)


def _check_accuracy(path: Path, projection: str, acc, num_heads: int) -> None:
    """accuracy.<projection>.topk: one row per head of cumulative accuracies in [0, 1]."""
    where = f"accuracy.{projection}"
    if not isinstance(acc, dict) or "topk" not in acc:
        raise _bad(path, f"{where} must be an object with a 'topk' list", acc)
    rows = acc["topk"]
    if not isinstance(rows, list) or len(rows) != num_heads:
        raise _bad(path, f"{where}.topk must be a list of {num_heads} rows (one per head)",
                   rows)
    for row in rows:
        if not isinstance(row, list) or not row or not all(
                type(x) in (int, float) and math.isfinite(x) and 0 <= x <= 1 for x in row):
            raise _bad(path, f"{where}.topk rows must be lists of accuracies in [0, 1]", row)


def _entry(path: Path, name: str, e, data_start: int, size: int) -> _Entry:
    """One header entry, its offsets within the file and its byte count its shape's."""
    try:
        dtype, shape, (start, end) = e["dtype"], e["shape"], e["data_offsets"]
        ok = (dtype in _ITEMSIZE and isinstance(shape, list) and len(shape) <= 4
              and all(_is_int(d, 0, 1 << 40) for d in shape)
              and _is_int(start, 0, size) and _is_int(end, start, size - data_start)
              and end - start == math.prod(shape) * _ITEMSIZE[dtype])
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise HeadsError(f"{path}: damaged header (tensor {name!r:.40})")
    return _Entry(dtype, tuple(shape), data_start + start, data_start + end)


def _check_tensors(path: Path, meta: dict, entries: dict[str, _Entry], size: int) -> None:
    """The header lists exactly the tensors the metadata implies, with their shapes and
    dtypes, and its data fills the rest of the file."""
    h, k, s = meta["hidden_size"], meta["num_heads"], meta["vocab_subset_size"]
    want: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {"vocab_subset": (_INTS, (s,))}
    for i in range(k):
        want[f"block.{i}.weight"] = (_FLOATS, (h, h))
        want[f"block.{i}.bias"] = (_FLOATS, (h,))
        if meta["next_token"]:
            want[f"block.{i}.embed"] = (_FLOATS, (h, h))
    missing = sorted(set(want) - set(entries))
    if missing:
        raise HeadsError(f"{path}: the metadata (num_heads {k}, next_token "
                         f"{str(meta['next_token']).lower()}) needs tensor {missing[0]}, "
                         "which the file lacks")
    extra = sorted(set(entries) - set(want))
    if extra:
        raise HeadsError(f"{path}: unexpected tensor {extra[0]!r:.40} (num_heads {k})")
    for name, (dtypes, shape) in want.items():
        e = entries[name]
        if e.dtype not in dtypes or e.shape != shape:
            raise HeadsError(f"{path}: tensor {name} is {e.dtype} {list(e.shape)}; the "
                             f"metadata (hidden_size {h}) needs {list(shape)}")
    if max(e.end for e in entries.values()) != size:
        raise HeadsError(f"{path}: damaged heads file ({size} bytes; its tensors end at "
                         f"{max(e.end for e in entries.values())})")
    sums = meta.get("crc32")
    if sums is not None and set(sums) != set(entries):
        raise HeadsError(f"{path}: crc32 lists other tensors than the file holds")


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
