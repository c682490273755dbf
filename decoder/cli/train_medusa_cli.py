"""`redraft train-medusa`: train Medusa heads for a model on its own answers.

Tested by: tests/decoder/heads/test_heads.py"""

from __future__ import annotations

import argparse

import torch
from redraft.decoder.heads.training import TrainConfig, TrainingError, train_medusa
from redraft.proto.models import DEFAULT_MODEL


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-medusa",
        help="train Medusa heads on the model's own answers",
        description="Cache the target's hidden states over chat records it answered itself, "
        "train K heads (head k guesses the token k places after the next one), report "
        "held-out top-1/top-5 accuracy per head, and write a heads file.",
    )
    p.add_argument("--model", default=None, help=f"model name (default: {DEFAULT_MODEL})")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE.jsonl",
                   help="chat records ({'messages': [..., assistant]}) the model answered")
    p.add_argument("--out", required=True, metavar="HEADS",
                   help="heads file to write (.safetensors)")
    p.add_argument("--heads", type=int, default=4, help="number of heads K (default 4)")
    p.add_argument("--epochs", type=float, default=1.0,
                   help="passes over the training positions (fractions allowed; default 1)")
    p.add_argument("--subset", type=int, default=8192,
                   help="size of the frequency-ranked vocabulary subset (default 8192)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--held-out", type=float, default=5.0, metavar="PERCENT",
                   help="percent of documents held out for the accuracy report (default 5)")
    p.add_argument("--hidden-only", action="store_true",
                   help="heads read only the hidden state, as Medusa-1's do (default: also "
                   "the next token's input embedding)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--hidden-dtype", default=None, choices=("float32", "bfloat16"),
                   help="dtype of the training split's forwards (default: bfloat16 where the "
                   "hardware has fast bfloat16 matmuls, else float32; the held-out split "
                   "always uses the model's own dtype)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--cache-dir", default=None,
                   help="where hidden states and checkpoints go (default ~/.cache/redraft/medusa)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = TrainConfig(num_heads=args.heads, epochs=args.epochs, batch_size=args.batch_size,
                      lr=args.lr, subset_size=args.subset, held_out_percent=args.held_out,
                      seed=args.seed, next_token=not args.hidden_only)
    cfg.validate()  # train_medusa checks again, with --out and the vocabulary, before loading
    if args.threads is not None:
        if args.threads < 1:
            raise TrainingError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    train_medusa(args.model, args.data, args.out, cfg, device=args.device,
                 cache_dir=args.cache_dir, hidden_dtype=args.hidden_dtype)
    return 0
