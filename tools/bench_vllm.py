"""vLLM side by side: plain, vLLM's own `ngram` and redraft's `RedraftProposer`, interleaved.

Run under vLLM's Python (`make vllm-env`), with a `redraft serve` for redraft's drafts:

    .venv/bin/redraft serve --datastore data/stdlib --port 50051 &
    LD_PRELOAD=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}') \\
    .venv-vllm/bin/python tools/bench_vllm.py --service 127.0.0.1:50051 \\
        --questions SPEC_BENCH --per-category 2 --concurrency 1,4,16 --out bench-out/vllm

Every method is one engine, all alive at once; each round runs every (concurrency, method)
pair in a rotated order, so the methods share the machine's state. Reported per concurrency
and method: output tokens per second (median over rounds), its ratio to plain vLLM in the
same rounds, and whether every output of every round was plain vLLM's greedy output token
for token. The same prompts are served in every round and at every concurrency: from the
first pass on, redraft's service drafts them from what it learned (repeated requests);
a method's first round at the first concurrency is the only cold one (printed per round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

METHODS = ("plain", "ngram", "suffix", "redraft")


def speculative_config(method: str, k: int) -> dict | None:
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
    if method == "suffix":
        # SuffixDecoding (arctic-inference, `make vllm-env`): vLLM's own defaults for its
        # trees (depth 24, 10000 cached requests, spec factor 1, min token prob 0.1), capped
        # at the same k tokens per step as the other methods
        return {"method": "suffix", "num_speculative_tokens": k}
    if method == "redraft":
        return {"method": "custom_class", "num_speculative_tokens": k,
                "model": "redraft.decoder.engines.vllm.RedraftProposer"}
    raise SystemExit(f"bench_vllm: unknown method {method!r} (known: {', '.join(METHODS)})")


def load_prompts(path: str, per_category: int) -> list[str]:
    """First turns of Spec-Bench's questions, `per_category` of each category."""
    taken: dict[str, int] = {}
    prompts = []
    for line in Path(path).read_text().splitlines():
        q = json.loads(line)
        cat = q.get("category", "")
        if taken.get(cat, 0) < per_category:
            taken[cat] = taken.get(cat, 0) + 1
            prompts.append(q["turns"][0])
    return prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".venv-vllm/models/smollm2-135m")
    p.add_argument("--service", help="HOST:PORT of redraft serve (for the redraft method)")
    p.add_argument("--questions", required=True, help="Spec-Bench's question.jsonl")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench-out/vllm")
    args = p.parse_args()
    methods = args.methods.split(",")
    if "redraft" in methods:
        if not args.service:
            raise SystemExit("bench_vllm: --service is required for the redraft method")
        os.environ["REDRAFT_SERVICE"] = args.service
    from vllm import LLM, SamplingParams  # vLLM's environment only

    engines = {m: LLM(model=args.model, dtype="float32", max_model_len=2048,
                      enforce_eager=True, gpu_memory_utilization=0.2, seed=0,
                      speculative_config=speculative_config(m, args.k)) for m in methods}
    tokenizer = engines[methods[0]].get_tokenizer()
    questions = load_prompts(args.questions, args.per_category)
    prompts = [{"prompt_token_ids": tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)} for q in questions]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    levels = [int(c) for c in args.concurrency.split(",")]
    rates: dict[tuple[int, str], list[float]] = {}
    outputs: dict[tuple[int, str, int], list[list[int]]] = {}  # every round's, compared
    for r in range(args.rounds):
        for c in levels:
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for m in order:
                start = time.perf_counter()
                ids: list[list[int]] = []
                for i in range(0, len(prompts), c):  # c requests in flight at once
                    got = engines[m].generate(prompts[i:i + c], params, use_tqdm=False)
                    ids += [list(g.outputs[0].token_ids) for g in got]
                seconds = time.perf_counter() - start
                rates.setdefault((c, m), []).append(sum(map(len, ids)) / seconds)
                outputs[(c, m, r)] = ids
                print(f"round {r} concurrency {c} {m}: {rates[(c, m)][-1]:.1f} tokens/s",
                      flush=True)
    rows = ["| concurrency | method | tokens/s (median) | vs plain | identical to plain |",
            "|---:|---|---:|---:|---|"]
    for c in levels:
        base = statistics.median(rates[(c, "plain")]) if "plain" in methods else None
        for m in methods:
            med = statistics.median(rates[(c, m)])
            ratio = f"{med / base:.2f}x" if base else "-"
            same = ("yes" if all(outputs[(c, m, r)] == outputs[(c, "plain", r)]
                                 for r in range(args.rounds)) else "**no**") if base else "-"
            rows.append(f"| {c} | {m} | {med:.1f} | {ratio} | {same} |")
    table = "\n".join(rows)
    load = os.getloadavg()
    summary = (f"{table}\n\n{len(prompts)} prompts, {args.max_tokens} new tokens at most, "
               f"k={args.k}, {args.rounds} rounds; load average at the end "
               f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(summary)
    (out / "rates.json").write_text(json.dumps({f"{c} {m}": v for (c, m), v in rates.items()}))
    print(summary)


if __name__ == "__main__":  # vLLM starts its engine cores with spawn
    main()
