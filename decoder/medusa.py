"""Medusa heads: small learned blocks that guess several tokens ahead from one hidden state.

After a verification forward the target's final (post-norm) hidden state of the last accepted
row already gives the next token through the target's own LM head (the bonus token). Head k
(k = 1..K) guesses the token k places after that one: a residual SiLU block
`h + SiLU(W_k h + b_k)` followed by an LM projection. That next token is known when drafting
(it is the tree's root), so heads may also read its input embedding e:
`h + SiLU(W_k h + U_k e + b_k)` (`next_token`; Medusa-1's heads do not, and EAGLE-style
drafters show how much the token itself tells). The blocks start at zero, so an untrained
head repeats the next-token prediction, which is a sensible start.

The projection is the frozen target's LM head, shared (no weights stored), either in full or
restricted to a frequency-ranked vocabulary subset (the ids the model itself emits most
often, as FR-Spec does): K blocks of H x H weights are all a heads file stores, and one
projection matmul serves all K heads, so the head cost per step is about one pass over
the projection rows (`HeadsPredictor`).

Heads file: safetensors (`block.{k}.weight`, `block.{k}.bias`, and `block.{k}.embed` for
heads that read the next token, in bfloat16, `vocab_subset` int32) with one metadata entry,
`redraft`, holding JSON (see README: Medusa heads). Heads trained for another model are
refused (`HeadsMismatch`): the blocks are fitted to one model's hidden states and would
draft garbage for any other.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from redraft.decoder.draft_models import Int8Linear
from redraft.proto.errors import RedraftError
from torch import nn

FORMAT = "redraft-medusa"
VERSION = 2  # 2 added heads that read the next token's embedding (`next_token`)
READS = (1, 2)
DEFAULT_HEADS = 4
PROJECTIONS = ("full", "subset")
HEADS_DIR = Path(__file__).resolve().parent / "heads"


class HeadsError(RedraftError):
    """A heads file that is missing, damaged, or not a heads file."""


class HeadsMismatch(HeadsError):
    """A heads file made for another model (other weights, sizes or vocabulary)."""


class ResidualBlock(nn.Module):
    """h + SiLU(W h + b), or h + SiLU(W h + U e + b) when the block also sees e, the next
    token's input embedding; zero-initialised so that it starts as the identity."""

    def __init__(self, hidden_size: int, next_token: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.embed: nn.Linear | None = None
        if next_token:
            self.embed = nn.Linear(hidden_size, hidden_size, bias=False)
            nn.init.zeros_(self.embed.weight)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor | None = None) -> torch.Tensor:
        z = self.linear(hidden)
        if self.embed is not None:
            z = z + self.embed(embedded)
        return hidden + F.silu(z)


class MedusaHeads(nn.Module):
    """K residual blocks plus what the heads file records about them.

    `forward(hidden [..., H], embedded [..., H]) -> [..., K, H]`: each head's hidden state,
    ready for the LM projection. With `next_token`, the blocks also read `embedded`, the
    input embedding of the token the hidden state's own row predicts (the next token, known
    when drafting: it is the tree's root); Medusa-1's heads (`next_token=False`) do not, and
    have to guess past it. `vocab_subset` lists the projection subset's token ids (most
    frequent first).
    """

    def __init__(self, hidden_size: int, num_heads: int = DEFAULT_HEADS,
                 vocab_subset: torch.Tensor | None = None, meta: dict | None = None,
                 next_token: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.next_token = next_token
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, next_token)
                                    for _ in range(num_heads))
        subset = torch.zeros(0, dtype=torch.long) if vocab_subset is None else vocab_subset
        self.register_buffer("vocab_subset", subset.to(torch.long), persistent=False)
        self.meta = dict(meta or {})

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor | None = None
                ) -> torch.Tensor:
        if self.next_token and embedded is None:
            raise ValueError("these heads read the next token's embedding too")
        return torch.stack([block(hidden, embedded) for block in self.blocks], dim=-2)

    def accuracy(self, projection: str) -> list[list[float]] | None:
        """Held-out top-1..top-n accuracy per head (cumulative) for a projection, if recorded."""
        acc = self.meta.get("accuracy", {}).get(projection)
        return None if acc is None else [list(map(float, row)) for row in acc["topk"]]


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


# -- the heads file -------------------------------------------------------------------------


def save_heads(heads: MedusaHeads, path: str | Path, meta: dict) -> None:
    """Write the blocks in bfloat16 plus the JSON metadata (atomically)."""
    from safetensors.torch import save_file

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
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"redraft": json.dumps(meta, sort_keys=True)})
    tmp.chmod(0o644)  # a shareable file like any other output, not the writer's private one
    tmp.replace(path)
    heads.meta = meta


def read_meta(path: str | Path) -> dict:
    """The JSON metadata of a heads file (no tensors read)."""
    from safetensors import safe_open

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
    from safetensors.torch import load_file

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


def default_heads_path(model_name: str | None) -> Path | None:
    """The committed heads of a known model name (`decoder/heads/NAME.safetensors`), if any."""
    from redraft.proto.models import DEFAULT_MODEL

    name = model_name or DEFAULT_MODEL
    if "/" in name or name.endswith(".gguf"):
        return None
    path = HEADS_DIR / f"{name}.safetensors"
    return path if path.is_file() else None


# -- inference: the heads' top-k after one hidden state ------------------------------------


class HeadsPredictor:
    """Runs the heads on one hidden state and returns each head's top-k token ids.

    The K head states go through the projection as one [K, H] x [H, V'] product, so the
    projection rows (the whole LM head, or the subset's rows) are read once per step. A step
    reads far more weight bytes than it computes with, so on a float32 CPU model it runs in
    int8 by default (`int8=None`): the K blocks as two stacked int8 matmuls and the
    projection as a third, a quarter of the bytes (what that costs in accuracy:
    `tools/bench_medusa.py --accuracy-docs N`); `int8=False` keeps the exact float path, on
    packed oneDNN weights as the verifier does for the target's own layers. Drafts only:
    either way the target decides what is accepted.
    """

    def __init__(self, heads: MedusaHeads, model, projection: str = "full",
                 int8: bool | None = None) -> None:
        if projection not in PROJECTIONS:
            raise HeadsError(f"unknown projection {projection!r} (known: full, subset)")
        if projection == "subset" and not len(heads.vocab_subset):
            raise HeadsError("these heads have no vocabulary subset")
        lm_head = model.get_output_embeddings()
        weight = lm_head.weight.detach()
        bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()
        self.ids: torch.Tensor | None = None
        if projection == "subset":
            self.ids = heads.vocab_subset.to(weight.device)
            weight = weight.index_select(0, self.ids).contiguous()
            bias = None if bias is None else bias.index_select(0, self.ids)
        self.heads = heads.to(device=weight.device, dtype=weight.dtype)
        self.device, self.dtype = weight.device, weight.dtype
        self.embedding = model.get_input_embeddings().weight if heads.next_token else None
        self.projection = projection
        self.width = int(weight.shape[0])  # projection rows: guesses available per head
        if int8 is None:
            int8 = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.int8 = False
        if int8:
            try:
                self._blocks, self._linear = _Int8Blocks(self.heads), Int8Linear(weight, bias)
                self.int8 = True
            except RuntimeError:  # a torch build without quantized CPU kernels
                pass
        if not self.int8:
            self._blocks = lambda h, e: self.heads(h, e)[0]
            self._linear = _linear_for(weight, bias)

    @torch.inference_mode()
    def topk(self, hidden: torch.Tensor, k: int, next_token: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids [K, k] (full-vocabulary ids) and their softmax probabilities [K, k].

        `next_token` is the token `hidden`'s row predicts (the tree's root); heads that read
        its embedding need it."""
        embedded = None
        if self.embedding is not None:
            if next_token is None:
                raise ValueError("these heads need the next token")
            embedded = self.embedding[next_token].reshape(1, -1).to(self.device, self.dtype)
        states = self._blocks(hidden.reshape(1, -1).to(self.device, self.dtype), embedded)
        logits = self._linear(states).float()
        values, idx = torch.topk(logits, k, dim=-1)
        probs = torch.exp(values - torch.logsumexp(logits, dim=-1, keepdim=True))
        if self.ids is not None:
            idx = self.ids[idx]
        return idx.cpu().numpy(), probs.cpu().numpy()


class _Int8Blocks:
    """The K blocks as int8 matmuls: every W_k stacked into one [K*H, H] layer (with the
    biases), every U_k into another. h and e are quantized separately: one activation scale
    shared by both would spend the 8 bits on the hidden state's outliers and flatten the
    embedding."""

    def __init__(self, heads: MedusaHeads) -> None:
        blocks = heads.blocks
        self.shape = (heads.num_heads, heads.hidden_size)
        self.w = Int8Linear.fused(*[b.linear for b in blocks])
        self.u = Int8Linear.fused(*[b.embed for b in blocks]) if heads.next_token else None

    def __call__(self, hidden: torch.Tensor, embedded: torch.Tensor | None) -> torch.Tensor:
        z = self.w(hidden)
        if self.u is not None:
            z = z + self.u(embedded)
        return hidden + F.silu(z.reshape(self.shape))


def _linear_for(weight: torch.Tensor, bias: torch.Tensor | None):
    """x -> x W^T + b, on packed oneDNN weights for float32 on a CPU (few rows, big W)."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and \
            torch.backends.mkldnn.is_available():
        try:
            with torch.inference_mode():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        except RuntimeError:  # a torch build whose oneDNN lacks the packed ops
            pass
    return lambda x: F.linear(x, weight, bias)
