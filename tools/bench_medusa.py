"""What Medusa heads cost per decoding step, relative to a one-token forward of the target.

One process, interleaved rounds: a one-token verification forward over a cached prefix (the
verifier's own packed kernels), then the heads on one hidden state with the full shared
projection and with the vocabulary-subset projection, each exact (float, packed weights) and
in int8 (each: K blocks, one projection matmul, top-k). Reports the median and the fastest
of the rounds, and the ratios, plus the held-out accuracies recorded in the heads file
(computed exactly, in float) and, with `--accuracy-docs N`, each predictor's top-1 accuracy
per head on the first N held-out documents of the training corpus, through the same
`topk` calls the drafter makes (what int8 costs in accuracy).

    .venv/bin/python -m tools.bench_medusa --threads 1 [--heads FILE] [--rounds 200] \
        [--accuracy-docs 40 --data tools/corpora/self_distill.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from redraft.decoder.heads.committed import default_heads_path
from redraft.decoder.heads.heads_file import load_heads
from redraft.decoder.heads.hidden_cache import HiddenCache
from redraft.decoder.heads.predictor import HeadsPredictor
from redraft.decoder.heads.training import summary_table
from redraft.decoder.heads.training_data import Positions, read_documents, split_held_out
from redraft.decoder.models.loading import load_model
from redraft.decoder.verify import TreeVerifier
from redraft.proto.models import load_tokenizer
from redraft.proto.tree import Tree

from tools import harness


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--heads", default=None, help="heads file (default: the committed one)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--prefix", type=int, default=256, help="cached tokens before each forward")
    ap.add_argument("--topk", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--accuracy-docs", type=int, default=0, metavar="N",
                    help="also measure each predictor's top-1 on N held-out documents")
    ap.add_argument("--data", default="tools/corpora/self_distill.jsonl",
                    help="the heads' training corpus (its held-out split is used)")
    ap.add_argument("--held-out", type=float, default=5.0, help="held-out percent, as trained")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    run = harness.Run()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    path = args.heads or default_heads_path(args.model)
    if path is None:
        raise SystemExit("no heads file: pass --heads")
    heads = load_heads(path, model)
    predictors = {f"{p}_{kind}": HeadsPredictor(heads, model, p, int8=kind == "int8")
                  for p in ("full", "subset") for kind in ("float", "int8")}
    verifier = TreeVerifier(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(model.config.vocab_size), (args.prefix + 1,), generator=gen)
    verifier.prefill(ids[:-1].tolist())
    hidden = torch.randn(int(model.config.hidden_size), generator=gen).to(model.dtype)

    def forward() -> None:
        verifier.tree_forward(int(ids[-1]), Tree())
        verifier.commit([])

    jobs = {"forward": forward}
    for name, pred in predictors.items():
        jobs[f"heads_{name}"] = lambda pred=pred: pred.topk(hidden, args.topk, int(ids[-1]))
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for rnd in range(args.rounds + 3):
        for name, job in jobs.items():
            t0 = time.perf_counter()
            job()
            if rnd >= 3:  # the first rounds warm up allocations and kernels
                times[name].append(time.perf_counter() - t0)
    out = {"threads": torch.get_num_threads(), "rounds": args.rounds,
           "heads": heads.num_heads, "subset": len(heads.vocab_subset)}
    for name, ts in times.items():
        out[name] = {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3}
    for name in predictors:
        key = f"heads_{name}"
        out[key]["ratio_median"] = out[key]["median_ms"] / out["forward"]["median_ms"]
        out[key]["ratio_min"] = out[key]["min_ms"] / out["forward"]["min_ms"]
    if args.accuracy_docs > 0:
        out["top1"] = held_out_top1(model, args, heads, predictors)
    if args.json:
        run.print(out)
        return
    print(f"threads {out['threads']}, {args.rounds} interleaved rounds, K={heads.num_heads}, "
          f"subset {out['subset']} ids")
    print("| step part | median ms | fastest ms | median / forward | fastest / forward |")
    print("|---|---|---|---|---|")
    for name in jobs:
        r = out[name]
        ratio = (f"{r['ratio_median']:.3f} | {r['ratio_min']:.3f}" if name != "forward"
                 else "1 | 1")
        print(f"| {name} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {ratio} |")
    if heads.meta.get("accuracy"):
        print(summary_table(heads.meta["accuracy"]))
    if "top1" in out:
        top1 = out["top1"]
        print(f"top-1 per head through each predictor, {top1.pop('positions')} held-out "
              "positions:")
        for name, row in top1.items():
            print(f"| {name} | " + " | ".join(f"{a:.4f}" for a in row) + " |")


def held_out_top1(model, args, heads, predictors: dict) -> dict:
    """Top-1 accuracy per head of each predictor on the first held-out documents."""
    docs, _ = read_documents([args.data], load_tokenizer(args.model))
    _, held = split_held_out(docs, args.held_out)
    docs = [docs[i] for i in held[: args.accuracy_docs]]
    positions = Positions.of(docs)
    with tempfile.TemporaryDirectory() as tmp:
        cache = HiddenCache(Path(tmp), docs, heads.hidden_size)
        cache.fill(model, "hidden states")
        hidden = torch.from_numpy(np.asarray(cache.hidden, dtype=np.float32)).to(model.dtype)
    labels = positions.labels(np.arange(len(positions)), heads.num_heads)
    hits = {name: np.zeros(heads.num_heads) for name in predictors}
    for row in range(len(positions)):
        for name, pred in predictors.items():
            ids, _ = pred.topk(hidden[row], 1, int(positions.next_tokens[row]))
            hits[name] += ids[:, 0] == labels[row]  # -1 (no label) never matches
    counts = np.maximum((labels >= 0).sum(0), 1)
    return {"positions": len(positions),
            **{name: (h / counts).round(4).tolist() for name, h in hits.items()}}


if __name__ == "__main__":
    main()
