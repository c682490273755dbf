"""Training Medusa heads on the target's own answers (`redraft train-medusa`).

The data are chat records whose assistant turn the target itself wrote (the self-distilled
corpus), so the labels are the target's own tokens: what a head learns is what verification
will accept. Three stages, each resumable:

1. **Hidden states, once.** Every document goes through the frozen target; the final
   (post-norm) hidden state of every answer position is written to a float16 memory map in
   a cache directory keyed by the model's fingerprint and the data's digest. Progress is
   recorded after each chunk of documents, so an interrupted run continues where it stopped.
   The training split is computed in bfloat16 where the hardware does that fast (a GPU, or a
   CPU with bfloat16 matrix units: ~3x faster than float32 here), the held-out split in the
   model's inference dtype, so the reported accuracies are those decoding will see.
2. **Heads.** Loss = sum over heads of 0.8^(k-1) x CE_k. Only the blocks train; the LM head
   is frozen and shared, and its backward pass (the gradient with respect to the head
   states) dominates the cost: through all 49 K rows it is 28 M multiply-adds per head and
   position each way. Training therefore projects onto the frequency subset plus every label
   of the batch (a softmax over ~8.5 K columns instead of 49 K, ~6x cheaper, exact for the
   labels it scores). A checkpoint every few hundred steps makes training resumable too.
3. **Held-out accuracy**, by document: top-1..top-10 per head for the full projection and
   for the subset one, stored in the heads file (the tree drafter builds its tree from them).

Tested by: tests/decoder/heads/test_heads.py
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from redraft.decoder.heads.blocks import DEFAULT_HEADS, MedusaHeads
from redraft.decoder.heads.heads_file import MAX_HEADS, model_fingerprint, save_heads
from redraft.decoder.heads.hidden_cache import HiddenCache, fast_dtype, hidden_cache_dir
from redraft.decoder.heads.training_data import (
    Positions,
    TrainingError,
    frequency_subset,
    read_documents,
    split_held_out,
)
from redraft.decoder.heads.tree_shape import sparse_tree
from redraft.decoder.models.loading import default_device, load_model, resolve_dtype
from redraft.proto.files import check_writable, write_atomically
from redraft.proto.models import DEFAULT_MODEL, load_tokenizer, vocab_size
from redraft.proto.tree import Tree
from tqdm import tqdm

LOSS_DECAY = 0.8
TOP_N = 10  # accuracies recorded for ranks 1..TOP_N
DEFAULT_SUBSET = 8192


# -- stage 2: training -------------------------------------------------------------------------


@dataclass
class TrainConfig:
    num_heads: int = DEFAULT_HEADS
    epochs: float = 1.0
    batch_size: int = 1024
    lr: float = 1e-3
    warmup: int = 50
    subset_size: int = DEFAULT_SUBSET
    held_out_percent: float = 5.0
    seed: int = 0
    checkpoint_every: int = 200
    next_token: bool = True  # heads also read the next token's embedding

    def validate(self) -> None:
        """TrainingError unless every setting is usable (finite, positive, in range): checked
        before anything loads, so a typo costs no model load and no training."""
        if self.num_heads < 1 or self.subset_size < 1 or self.batch_size < 1:
            raise TrainingError("--heads, --subset and --batch-size must be positive")
        if self.num_heads > MAX_HEADS:
            raise TrainingError(f"--heads must be at most {MAX_HEADS}, got {self.num_heads}")
        for flag, value in (("--epochs", self.epochs), ("--lr", self.lr)):
            if not (math.isfinite(value) and value > 0):
                raise TrainingError(f"{flag} must be a positive finite number, got {value}")
        if not 0 < self.held_out_percent < 100:  # also false for nan
            raise TrainingError("--held-out must be a percentage in (0, 100), got "
                                f"{self.held_out_percent}")
        if self.warmup < 1 or self.checkpoint_every < 1:
            raise TrainingError("warmup and checkpoint_every must be positive")

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()[:16]


def head_weights(num_heads: int) -> torch.Tensor:
    return torch.tensor([LOSS_DECAY**k for k in range(num_heads)])


def heads_loss(heads: MedusaHeads, hidden: torch.Tensor, labels: torch.Tensor,
               weight: torch.Tensor, columns: torch.Tensor,
               embedded: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted CE of every head over the projection rows `columns` (the labels among them).

    Returns (loss, per-head top-1 hits, per-head label counts). `labels` [B, K] holds
    full-vocabulary ids, -1 where a head has no label; `embedded` [B, H] the next tokens'
    embeddings (for heads that read them).
    """
    lookup = torch.full((weight.shape[0],), -1, dtype=torch.long, device=labels.device)
    lookup[columns] = torch.arange(len(columns), device=labels.device)
    target = torch.where(labels >= 0, lookup[labels.clamp(min=0)], -1)
    states = heads(hidden, embedded)  # [B, K, H]
    logits = (states @ weight[columns].T).float()  # [B, K, C]
    k = heads.num_heads
    decay = head_weights(k).to(logits.device)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                         ignore_index=-1, reduction="none").reshape(-1, k)
    mask = (target >= 0).float()
    counts = mask.sum(0)
    loss = ((ce * mask).sum(0) / counts.clamp(min=1) * decay).sum()
    hits = ((logits.argmax(-1) == target) & (target >= 0)).sum(0)
    return loss, hits, counts


def next_embeddings(heads: MedusaHeads, embedding: torch.Tensor | None, positions: Positions,
                    rows: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """The next tokens' input embeddings at `rows`, for heads that read them (else None)."""
    if not heads.next_token:
        return None
    if embedding is None:
        raise TrainingError("heads that read the next token need the input embeddings")
    ids = torch.from_numpy(positions.next_tokens[rows]).to(embedding.device)
    return embedding[ids].to(device)


def train_heads(heads: MedusaHeads, hidden: np.ndarray, positions: Positions,
                weight: torch.Tensor, cfg: TrainConfig, checkpoint: Path,
                device: torch.device, embedding: torch.Tensor | None = None) -> dict:
    """Train `heads` in place over the cached hidden states; resumes from `checkpoint`.
    `embedding` is the target's input embedding matrix (heads that read the next token)."""
    rows_per_epoch = len(positions)
    steps_per_epoch = max(1, rows_per_epoch // cfg.batch_size)
    total = max(1, int(round(cfg.epochs * steps_per_epoch)))
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, total)
                                                                    / total)))
    step = 0
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        if state.get("key") == cfg.key():
            heads.load_state_dict(state["heads"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            step = int(state["step"])
    subset = heads.vocab_subset.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=fast_dtype(device) == torch.bfloat16)
    k = heads.num_heads
    run_hits, run_counts, run_loss = torch.zeros(k), torch.zeros(k), 0.0
    bar = tqdm(total=total, initial=step, desc="train heads", unit="step", dynamic_ncols=True,
               mininterval=1.0)
    heads.train()
    t0 = time.perf_counter()
    while step < total:
        epoch, offset = divmod(step, steps_per_epoch)
        order = np.random.default_rng(cfg.seed + epoch).permutation(rows_per_epoch)
        rows = np.sort(order[offset * cfg.batch_size : (offset + 1) * cfg.batch_size])
        labels = torch.from_numpy(positions.labels(rows, k)).to(device)
        h = torch.from_numpy(np.asarray(hidden[rows], dtype=np.float32)).to(device)
        columns = torch.unique(torch.cat([subset, labels[labels >= 0]]))
        e = next_embeddings(heads, embedding, positions, rows, device)
        with autocast:
            loss, hits, counts = heads_loss(heads, h, labels, weight, columns, e)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        decay = 0.98
        run_loss = decay * run_loss + (1 - decay) * loss.item()
        run_hits = decay * run_hits + (1 - decay) * hits.float().cpu()
        run_counts = decay * run_counts + (1 - decay) * counts.cpu()
        acc = (run_hits / run_counts.clamp(min=1e-9)).tolist()
        bar.set_postfix_str(f"loss {run_loss / (1 - decay**step):.3f} acc "
                            + " ".join(f"{a:.2f}" for a in acc))
        bar.update(1)
        if step % cfg.checkpoint_every == 0 or step == total:
            _save_checkpoint(checkpoint, cfg, heads, opt, sched, step)
    bar.close()
    heads.eval()
    return {"steps": total, "positions": rows_per_epoch, "seconds": time.perf_counter() - t0}


def _save_checkpoint(path: Path, cfg: TrainConfig, heads, opt, sched, step: int) -> None:
    state = {"key": cfg.key(), "heads": heads.state_dict(), "opt": opt.state_dict(),
             "sched": sched.state_dict(), "step": step}
    write_atomically(path, lambda tmp: torch.save(state, tmp))


# -- stage 3: held-out accuracy ----------------------------------------------------------------


@torch.inference_mode()
def evaluate(heads: MedusaHeads, hidden: np.ndarray, positions: Positions,
             weight: torch.Tensor, device: torch.device, batch: int = 512,
             embedding: torch.Tensor | None = None) -> dict:
    """Top-1..TOP_N accuracy per head (cumulative), full projection and subset projection.

    Computed in the model's dtype, on every held-out position that has a label for the head.
    """
    k = heads.num_heads
    subset = heads.vocab_subset.to(device)
    hits = {p: torch.zeros(k, TOP_N) for p in ("full", "subset")}
    counts = torch.zeros(k)
    for lo in range(0, len(positions), batch):
        rows = np.arange(lo, min(lo + batch, len(positions)))
        labels = torch.from_numpy(positions.labels(rows, k)).to(device)
        h = torch.from_numpy(np.asarray(hidden[rows], dtype=np.float32)).to(device, weight.dtype)
        e = next_embeddings(heads, embedding, positions, rows, device)
        states = heads(h, None if e is None else e.to(weight.dtype))
        valid = labels >= 0
        counts += valid.sum(0).cpu().float()
        for proj, rows_w, ids in (("full", weight, None), ("subset", weight[subset], subset)):
            top = torch.topk(states @ rows_w.T, TOP_N, dim=-1).indices  # [B, K, TOP_N]
            if ids is not None:
                top = ids[top]
            found = (top == labels[..., None]) & valid[..., None]
            hits[proj] += found.cumsum(-1).clamp(max=1).sum(0).cpu().float()
    out = {}
    for proj, h in hits.items():
        topk = (h / counts.clamp(min=1)[:, None]).tolist()
        out[proj] = {"top1": [round(r[0], 4) for r in topk], "top5": [round(r[4], 4) for r in topk],
                     "topk": [[round(x, 4) for x in r] for r in topk]}
    out["positions"] = [int(c) for c in counts.tolist()]
    return out


# -- the whole job ---------------------------------------------------------------------------


def train_medusa(model_name: str | None, data: Sequence[str], out: str | Path,
                 cfg: TrainConfig, device: str | None = None,
                 cache_dir: str | Path | None = None, hidden_dtype: str | None = None,
                 log=print) -> dict:
    """Cache hidden states, train, evaluate, write the heads file; returns its metadata.

    `hidden_dtype` is the dtype of the training split's forwards (default: `fast_dtype`).
    """

    cfg.validate()
    check_writable(out, "heads file")
    name = model_name or DEFAULT_MODEL
    dev = torch.device(device or default_device())
    tokenizer = load_tokenizer(model_name)
    vocab = vocab_size(tokenizer)
    if cfg.subset_size > vocab:
        raise TrainingError(f"--subset must be at most the vocabulary size ({vocab}), got "
                            f"{cfg.subset_size}")
    docs, digest = read_documents(data, tokenizer)
    train_idx, held_idx = split_held_out(docs, cfg.held_out_percent)
    if not train_idx or not held_idx:
        raise TrainingError(f"{len(docs)} documents are too few for a held-out split")
    # float32 on a CPU whatever the default: the held-out accuracies the heads file records
    # stay comparable from machine to machine (the train split has its own `hidden_dtype`)
    model, _ = load_model(model_name, device=dev.type,
                          dtype=torch.float32 if dev.type == "cpu" else None)
    fingerprint = model_fingerprint(model)
    hidden_size, vocab = int(model.config.hidden_size), int(model.config.vocab_size)
    fast = resolve_dtype(hidden_dtype, dev.type) if hidden_dtype else fast_dtype(dev)
    root = Path(cache_dir) if cache_dir else hidden_cache_dir()
    key = hashlib.sha256(f"{fingerprint}|{digest}|{cfg.held_out_percent}".encode()).hexdigest()
    cache = root / key[:16]
    train_docs = [docs[i] for i in train_idx]
    held_docs = [docs[i] for i in held_idx]
    t0 = time.perf_counter()
    train_cache = HiddenCache(cache / f"train-{str(fast).split('.')[-1]}", train_docs, hidden_size)
    held_cache = HiddenCache(cache / f"held-{str(model.dtype).split('.')[-1]}", held_docs,
                             hidden_size)
    held_cache.fill(model, "hidden states (held-out)")
    if train_cache.done < len(train_docs):
        # A converted copy, not a second load: a GGUF file loaded in bfloat16 keeps its
        # weights quantized and casts around every matmul, several times slower.
        fast_model = model if fast == model.dtype else copy.deepcopy(model).to(fast)
        train_cache.fill(fast_model, "hidden states (train)")
        del fast_model
    cache_seconds = time.perf_counter() - t0

    train_pos, held_pos = Positions.of(train_docs), Positions.of(held_docs)
    subset = frequency_subset(train_pos, cfg.subset_size, vocab)
    weight = model.get_output_embeddings().weight.detach()
    embedding = model.get_input_embeddings().weight.detach()
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(hidden_size, cfg.num_heads, subset, next_token=cfg.next_token).to(dev)
    stats = train_heads(heads, train_cache.hidden, train_pos, weight.to(fast), cfg,
                        cache / "checkpoint.pt", dev, embedding.to(fast))
    t1 = time.perf_counter()
    heads.to(model.dtype)
    accuracy = evaluate(heads, held_cache.hidden, held_pos, weight, dev, embedding=embedding)
    coverage = float(np.isin(held_pos.next_tokens, subset.numpy()).mean())
    meta = {
        "model": name, "model_fingerprint": fingerprint, "vocab_size": vocab,
        "projection": choose_projection(accuracy),
        "accuracy": accuracy,
        "training": {
            "data": [Path(p).name for p in data], "data_digest": digest,
            "documents": len(train_docs), "held_out_documents": len(held_docs),
            "positions": len(train_pos), "held_out_positions": len(held_pos),
            "next_token": cfg.next_token,
            "epochs": cfg.epochs, "steps": stats["steps"], "batch_size": cfg.batch_size,
            "lr": cfg.lr, "loss_decay": LOSS_DECAY, "hidden_dtype": str(fast).split(".")[-1],
            "subset_coverage_held_out": round(coverage, 4),
            "seconds": {"hidden_states": round(cache_seconds, 1),
                        "train": round(stats["seconds"], 1),
                        "evaluate": round(time.perf_counter() - t1, 1)},
        },
    }
    save_heads(heads, out, meta)
    (cache / "checkpoint.pt").unlink(missing_ok=True)
    log(summary_table(accuracy))
    return meta


def expected_accepted(cumulative: Sequence[Sequence[float]], nodes: int = 16) -> float:
    """Expected accepted tokens of the drafter's best `nodes`-node tree for these accuracies."""
    shape = sparse_tree(cumulative, nodes)
    return Tree([0] * len(shape), shape.parents, shape.probs, ["medusa"] * len(shape)
                ).expected_accepted


def choose_projection(accuracy: dict, tolerance: float = 0.01) -> str:
    """The subset projection (several times cheaper per step) unless its tree is expected to
    get more than `tolerance` (relative) fewer tokens accepted than the full one's."""
    full = expected_accepted(accuracy["full"]["topk"])
    subset = expected_accepted(accuracy["subset"]["topk"])
    return "subset" if subset >= (1 - tolerance) * full else "full"


def summary_table(accuracy: dict) -> str:
    """Held-out top-1 / top-5 per head and projection, as the README shows them."""
    k = len(accuracy["full"]["top1"])
    lines = ["| head | predicts | top-1 full | top-5 full | top-1 subset | top-5 subset |",
             "|---|---|---|---|---|---|"]
    for i in range(k):
        f, s = accuracy["full"], accuracy["subset"]
        lines.append(f"| {i + 1} | t+{i + 2} | {f['top1'][i]:.3f} | {f['top5'][i]:.3f} | "
                     f"{s['top1'][i]:.3f} | {s['top5'][i]:.3f} |")
    return "\n".join(lines)
