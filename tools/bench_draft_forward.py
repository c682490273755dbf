"""What one draft-model forward costs, relative to a one-token forward of the target.

One process, interleaved rounds over the same cached prefix: the target's one-token
verification forward (its own kernels), the int8 draft model run module by module through a
verifier (`quantized_int8`), and the lean int8 decoder the `int8` draft model uses
(`Int8Decoder`). Reports the median and the fastest round of each, and the ratios.

    .venv/bin/python -m tools.bench_draft_forward --threads 1 [--rounds 100] [--prefix 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from redraft.decoder.drafters.draft_model import ModelRunner
from redraft.decoder.models.int8 import quantized_int8
from redraft.decoder.models.int8_decoder import lean_int8
from redraft.decoder.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--prefix", type=int, default=256, help="cached tokens before each forward")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    lean = lean_int8(model)
    if lean is None:
        raise SystemExit("the lean int8 decoder does not apply to this model's architecture")
    runners = {"target, one-token forward": ModelRunner(model),
               "int8 draft model, module by module": ModelRunner(quantized_int8(model)),
               "int8 draft model, lean decoder": lean}
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, int(model.config.vocab_size), (args.prefix,), generator=gen)
    for runner in runners.values():
        runner.extend(prefix[:1].tolist())  # the first token alone, as the drafter feeds it
        runner.extend(prefix[1:].tolist())
    times: dict[str, list[float]] = {name: [] for name in runners}
    for rnd in range(args.rounds + 3):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            runner.next_logits([int(prefix[rnd % args.prefix])])
            if rnd >= 3:  # the first rounds warm up allocations and kernels
                times[name].append(time.perf_counter() - t0)
            runner.truncate(args.prefix)
    base = list(runners)[0]
    med = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    low = {n: min(ts) * 1e3 for n, ts in times.items()}
    print(f"threads {torch.get_num_threads()}, {args.rounds} interleaved rounds, "
          f"{args.prefix} cached tokens")
    print("| forward | median ms | fastest ms | median / target | fastest / target |")
    print("|---|---:|---:|---:|---:|")
    for name in runners:
        print(f"| {name} | {med[name]:.2f} | {low[name]:.2f} | {med[name] / med[base]:.3f} | "
              f"{low[name] / low[base]:.3f} |")


if __name__ == "__main__":
    main()
