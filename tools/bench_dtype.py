"""redraft's default drafters in float32 against bfloat16 on a CPU, interleaved per prompt:
which precision should be the CPU default (`redraft.decoder.models.loading.default_cpu_dtype`).

Each Spec-Bench question's first turn runs once per dtype, the order alternating from
question to question, on one model per dtype loaded side by side (cost curves measured at
start, as `redraft generate` would). Reported per dtype: tokens/s on the wall clock (prompt
included) and per CPU second (steadier on a shared machine), tokens per forward.

    REDRAFT_CACHE=$(mktemp -d) python -m tools.bench_dtype \
        --questions SPEC_BENCH/question.jsonl --per-category 2 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
from redraft.decoder import Generator, build_drafter, load_model
from redraft.decoder.bench.questions import load_questions
from redraft.decoder.budget import CostModel
from redraft.decoder.text import chat_ids
from redraft.proto.models import DEFAULT_MODEL

from tools import harness

DTYPES = ("float32", "bfloat16")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", required=True, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gens = {}
    for dtype in DTYPES:
        model, tok = load_model(None, device="cpu", dtype=dtype)
        drafter = build_drafter(None, model=model, tokenizer=tok, model_name=DEFAULT_MODEL)
        cost = CostModel.for_model(model, DEFAULT_MODEL)
        gens[dtype] = Generator(model, tok, drafter, model_name=DEFAULT_MODEL, cost=cost)
    questions = load_questions(args.questions, args.per_category)
    totals = {d: {"tokens": 0, "steps": 0, "seconds": 0.0, "cpu": 0.0} for d in DTYPES}
    run = harness.Run()  # load at the start; its end when printed
    for i, q in enumerate(questions):
        for dtype in DTYPES[i % 2:] + DTYPES[: i % 2]:
            gen = gens[dtype]
            ids = chat_ids(gen.tokenizer, [{"role": "user", "content": q.turns[0]}])
            t0, c0 = time.perf_counter(), time.process_time()
            r = gen.generate(ids, max_new_tokens=args.max_new_tokens)
            t = totals[dtype]
            t["seconds"] += time.perf_counter() - t0
            t["cpu"] += time.process_time() - c0
            t["tokens"] += r.stats.new_tokens
            t["steps"] += r.stats.steps
    out = {"questions": len(questions), "threads": args.threads,
           "verifier": {d: gens[d].verifier.kind for d in DTYPES}}
    for dtype, t in totals.items():
        out[dtype] = {"tokens_per_second": round(t["tokens"] / t["seconds"], 2),
                      "tokens_per_cpu_second": round(t["tokens"] / t["cpu"], 2),
                      "tokens_per_forward": round(t["tokens"] / max(1, t["steps"]), 3),
                      "new_tokens": t["tokens"]}
    run.print(out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
