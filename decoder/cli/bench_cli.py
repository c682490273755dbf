"""`redraft bench`: the benchmark's command line (the driver: `redraft.decoder.bench`).

Tested by: tests/decoder/bench/test_greedy.py"""

from __future__ import annotations

import argparse

from redraft.datastore.cli import add_client_options
from redraft.decoder.bench.driver import run
from redraft.decoder.bench.methods import DEFAULT_METHODS, HF_METHODS, LLAMA_CPP, redraft_methods
from redraft.decoder.drafters.registry import add_options
from redraft.decoder.models.loading import add_dtype_option
from redraft.proto.models import DEFAULT_MODEL


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` to the `redraft` parser."""
    p = sub.add_parser(
        "bench",
        help="Spec-Bench, side by side with Hugging Face generate and prompt lookup",
        description="Run Spec-Bench questions with every method interleaved per question; "
        "report tokens per forward, tokens/s, speed-up over hf-greedy and token identity.",
    )
    p.add_argument("--model", default=None, help=f"model name (default: {DEFAULT_MODEL})")
    p.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl",
                   help="Spec-Bench question.jsonl")
    p.add_argument("--per-category", type=int, default=10,
                   help="questions per category (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run every question N times, interleaved; report each speed-up's "
                   "median and range over the runs")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, from {', '.join([*HF_METHODS, *redraft_methods()])}"
                   f", {LLAMA_CPP} (plain llama-cpp-python on the model's GGUF)"
                   ", or redraft-A+B for any combination of drafters; X-nolearn is X without "
                   f"learned drafts (default {DEFAULT_METHODS}; with --samples "
                   "redraft-default,redraft-default-nolearn)")
    p.add_argument("--samples", type=int, default=1, metavar="N",
                   help="answer each math and coding question N times with sampling at "
                   "--temperature, methods interleaved; tokens per forward reported on sample "
                   "1 and samples 2..N (default 1: greedy Spec-Bench)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature with --samples (default %(default)s)")
    rest = p.add_mutually_exclusive_group()
    rest.add_argument("--datastore", metavar="DIR", help="datastore for the rest drafters")
    rest.add_argument("--draft-service", metavar="ADDR",
                      help="draft service for rest drafters (host:port; replicas: several, "
                      "comma-separated, or dns:///name:port)")
    p.add_argument("--out", default="bench-out/spec_bench", help="output directory")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_dtype_option(p, "; Hugging Face's baselines run the same model, in the same dtype")
    p.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                   help="redraft's methods verify the best N drafted nodes every step, ignoring "
                   "this machine's cost curve (tokens per forward at a fixed tree size, as on a "
                   "GPU; the wall clock still pays for every row here)")
    kernels = p.add_mutually_exclusive_group()
    kernels.add_argument("--stock-kernels", action="store_true",
                         help="redraft's methods on PyTorch's stock CPU kernels, like Hugging "
                         "Face's")
    kernels.add_argument("--always-packed", action="store_true",
                         help="redraft's methods on packed kernels for every forward, without "
                         "the per-size choice of the faster kind")
    add_client_options(p)
    add_options(p)
    p.set_defaults(func=run)
