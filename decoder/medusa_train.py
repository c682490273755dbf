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
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from redraft.decoder.medusa import (
    DEFAULT_HEADS,
    MedusaHeads,
    model_fingerprint,
    save_heads,
)
from redraft.proto.errors import RedraftError

LOSS_DECAY = 0.8
TOP_N = 10  # accuracies recorded for ranks 1..TOP_N
DEFAULT_SUBSET = 8192


class TrainingError(RedraftError):
    """Bad training input: unreadable data, records without an assistant answer, bad sizes."""


@dataclass
class Document:
    name: str  # file:line
    ids: list[int]  # the whole chat, template applied
    start: int  # index of the first answer token
    end: int  # one past the answer's last token (its end-of-turn token included)

    @property
    def positions(self) -> int:
        """Hidden states used: those of the tokens start-1 .. end-2 (each predicts an answer
        token with the LM head; the heads predict the ones after it)."""
        return self.end - self.start


# -- data ------------------------------------------------------------------------------------


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def read_documents(paths: Sequence[str], tokenizer) -> tuple[list[Document], str]:
    """Chat records (`messages` ending with the assistant's answer) -> documents + digest.

    The digest hashes the files' bytes: it names the hidden-state cache and is recorded in
    the heads file.
    """
    end_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    digest = hashlib.sha256()
    docs: list[Document] = []
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise TrainingError(f"cannot read {path}: {exc.strerror or exc}") from None
        digest.update(hashlib.sha256(data).digest())
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise TrainingError(f"{path}: not UTF-8 text") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                ok = (isinstance(messages, list) and len(messages) >= 2
                      and all(isinstance(m.get("content"), str) for m in messages)
                      and messages[-1].get("role") == "assistant")
            except (ValueError, KeyError, TypeError, AttributeError):
                ok = False
            if not ok:
                raise TrainingError(f"{path}:{n}: needs a 'messages' list ending with the "
                                    "assistant's answer")
            prompt = _chat_ids(tokenizer, messages[:-1], True)
            ids = _chat_ids(tokenizer, messages, False)
            if ids[: len(prompt)] != prompt:
                raise TrainingError(f"{path}:{n}: the chat template does not extend the prompt")
            end = len(ids)
            while end > len(prompt) and ids[end - 1] not in end_ids:
                end -= 1  # drop what the template adds after the end-of-turn token
            if end - len(prompt) >= 2:
                docs.append(Document(f"{Path(path).name}:{n}", ids[:end], len(prompt), end))
    if not docs:
        raise TrainingError("no training documents in " + ", ".join(map(str, paths)))
    return docs, "sha256:" + digest.hexdigest()[:32]


def split_held_out(docs: Sequence[Document], percent: float) -> tuple[list[int], list[int]]:
    """Document indices (train, held-out), decided by a hash of each document's name."""
    train, held = [], []
    for i, d in enumerate(docs):
        h = int.from_bytes(hashlib.sha256(d.name.encode()).digest()[:4], "little")
        (held if h % 10_000 < percent * 100 else train).append(i)
    return train, held


@dataclass
class Positions:
    """Answer positions of some documents: the next token of each, and how many follow."""

    next_tokens: np.ndarray  # [N] the token the LM head predicts from this hidden state
    remaining: np.ndarray  # [N] answer tokens from next_tokens[i] to the document's end

    @classmethod
    def of(cls, docs: Sequence[Document]) -> Positions:
        toks = [np.asarray(d.ids[d.start : d.end], dtype=np.int64) for d in docs]
        rem = [np.arange(d.positions, 0, -1, dtype=np.int64) for d in docs]
        return cls(np.concatenate(toks), np.concatenate(rem))

    def __len__(self) -> int:
        return len(self.next_tokens)

    def labels(self, rows: np.ndarray, num_heads: int) -> np.ndarray:
        """[len(rows), K] label of head k (the token k places after the next), -1 if none."""
        k = np.arange(1, num_heads + 1)
        idx = rows[:, None] + k[None, :]
        valid = k[None, :] < self.remaining[rows][:, None]
        out = np.full(idx.shape, -1, dtype=np.int64)
        out[valid] = self.next_tokens[idx[valid]]
        return out


def frequency_subset(positions: Positions, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` token ids the model emits most often (ties by id), most frequent first."""
    counts = np.bincount(positions.next_tokens, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return torch.from_numpy(order[: min(size, vocab_size)].copy())


# -- stage 1: hidden states, cached ----------------------------------------------------------


def fast_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where matmuls in it are fast (GPUs, CPUs with bf16 units), else float32."""
    if device.type == "cuda":
        return torch.bfloat16
    try:
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return torch.bfloat16
    except (AttributeError, RuntimeError):
        pass
    return torch.float32


class HiddenCache:
    """float16 hidden states [N, H] of some documents' answer positions, on disk.

    `progress.json` records how many documents are done; it is written only after the
    memory map was flushed, so a killed run loses at most one chunk.
    """

    def __init__(self, directory: Path, docs: Sequence[Document], hidden_size: int) -> None:
        self.dir = directory
        self.docs = list(docs)
        self.offsets = np.concatenate([[0], np.cumsum([d.positions for d in docs])])
        self.hidden_size = hidden_size
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "hidden.f16"
        shape = (int(self.offsets[-1]), hidden_size)
        mode = "r+" if path.is_file() and path.stat().st_size == 2 * shape[0] * shape[1] else "w+"
        if mode == "w+":
            self._write_progress(0)
        self.hidden = np.memmap(path, dtype=np.float16, mode=mode, shape=shape)

    @property
    def done(self) -> int:
        try:
            return int(json.loads((self.dir / "progress.json").read_text())["docs"])
        except (OSError, ValueError, KeyError):
            return 0

    def _write_progress(self, docs: int) -> None:
        tmp = self.dir / "progress.json.tmp"
        tmp.write_text(json.dumps({"docs": docs, "total": len(self.docs)}))
        os.replace(tmp, self.dir / "progress.json")

    @torch.inference_mode()
    def fill(self, model, desc: str, chunk: int = 32) -> None:
        """Run the target over every document not done yet."""
        from tqdm import tqdm

        base = model.base_model  # the decoder stack: its output is the post-norm hidden state
        device = next(model.parameters()).device
        start = self.done
        todo = self.docs[start:]
        if not todo:
            return
        bar = tqdm(total=int(self.offsets[-1] - self.offsets[start]), desc=desc, unit="tok",
                   unit_scale=True, dynamic_ncols=True, mininterval=1.0)
        for i, doc in enumerate(todo, start):
            ids = torch.tensor([doc.ids[: doc.end - 1]], device=device)
            hidden = base(input_ids=ids).last_hidden_state[0, doc.start - 1 :]
            self.hidden[self.offsets[i] : self.offsets[i + 1]] = (
                hidden.float().cpu().numpy().astype(np.float16))
            bar.update(doc.positions)
            if (i + 1) % chunk == 0 or i + 1 == len(self.docs):
                self.hidden.flush()
                self._write_progress(i + 1)
        bar.close()


def cache_root() -> Path:
    root = os.environ.get("REDRAFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "redraft")
    return Path(root) / "medusa"


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
    from tqdm import tqdm

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
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"key": cfg.key(), "heads": heads.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


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
    from redraft.decoder.models import default_device, load_model, resolve_dtype
    from redraft.proto.models import DEFAULT_MODEL, load_tokenizer

    if cfg.num_heads < 1 or cfg.epochs <= 0 or cfg.subset_size < 1 or cfg.batch_size < 1:
        raise TrainingError("--heads, --epochs, --subset and --batch-size must be positive")
    name = model_name or DEFAULT_MODEL
    dev = torch.device(device or default_device())
    tokenizer = load_tokenizer(model_name)
    docs, digest = read_documents(data, tokenizer)
    train_idx, held_idx = split_held_out(docs, cfg.held_out_percent)
    if not train_idx or not held_idx:
        raise TrainingError(f"{len(docs)} documents are too few for a held-out split")
    model, _ = load_model(model_name, device=dev.type)
    fingerprint = model_fingerprint(model)
    hidden_size, vocab = int(model.config.hidden_size), int(model.config.vocab_size)
    fast = resolve_dtype(hidden_dtype, dev.type) if hidden_dtype else fast_dtype(dev)
    root = Path(cache_dir) if cache_dir else cache_root()
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
    from redraft.decoder.drafters.medusa import sparse_tree
    from redraft.proto.tree import Tree

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
