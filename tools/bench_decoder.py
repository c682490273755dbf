"""Decoder benchmark: plain vs PLD vs retrieval vs token recycling and their combinations,
and Hugging Face's own greedy and prompt-lookup generate, on code-writing prompts with the
default model.

Every method runs on every prompt in one process. redraft's methods run in lock-step: one
decoding step of each in turn (rotating order), each timed on its own, so a burst of load
from other jobs on a shared machine hits all of them alike; Hugging Face's methods cannot be
stepped from outside and are interleaved per prompt instead (noisier). Reports mean tokens
per target forward, the median per-prompt wall-clock speed-up over plain decoding, and
whether the tokens are identical to plain greedy decoding. An empty-datastore run measures
the overhead when drafts never hit.

    python -m tools.bench_decoder --max-new-tokens 128 --out bench-out/decoder
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tools import harness

HERE = Path(__file__).resolve().parent


def load_prompts(path: Path, limit: int | None) -> list[str]:
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts


class CountForwards:
    """Counts the target's top-level forward calls (how HF generate's steps are measured)."""

    def __init__(self, model) -> None:
        self.calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *_args) -> None:
        self.calls += 1


def lockstep(gens: dict, prompt: str, max_new_tokens: int) -> dict[str, dict]:
    """Run several Generators on one prompt one step each in turn; time each step alone."""
    runs = {n: g.iter_steps(prompt, max_new_tokens=max_new_tokens) for n, g in gens.items()}
    seconds = dict.fromkeys(runs, 0.0)
    results = {}
    active = list(runs)
    turn = 0
    while active:
        k = turn % len(active)
        for name in active[k:] + active[:k]:
            t0 = time.perf_counter()
            try:
                next(runs[name])
            except StopIteration as done:
                results[name] = done.value
            seconds[name] += time.perf_counter() - t0
        active = [n for n in active if n not in results]
        turn += 1
    out = {}
    for name, r in results.items():
        # the first step's timing included prefill, which is the same work for every method
        out[name] = {"tokens": r.tokens, "steps": r.stats.steps, "accepted": r.stats.accepted,
                     "seconds": seconds[name] - r.stats.prefill_seconds}
    return out


def empty_datastore(tokenizer_name: str, directory: str) -> str:
    """A datastore whose one document shares nothing with code: retrieval never hits."""
    from redraft.datastore import build_datastore

    src = Path(directory) / "empty.txt"
    src.write_text("zq " * 8)
    out = str(Path(directory) / "empty-ds")
    build_datastore([str(src)], out, tokenizer=tokenizer_name, corpus="empty")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--datastore", default="data/stdlib", help="retrieval datastore (stdlib)")
    ap.add_argument("--prompts", default=str(HERE / "code_prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 is steadiest on a shared machine)")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face methods")
    ap.add_argument("--out", default=None, help="folder for results.json and table.md")
    args = ap.parse_args(argv)
    run = harness.Run()

    from redraft.decoder.drafters.registry import build_drafter
    from redraft.decoder.generate import Generator
    from redraft.decoder.models.loading import load_model
    from redraft.proto.models import DEFAULT_MODEL

    torch.set_num_threads(args.threads)
    name = args.model or DEFAULT_MODEL
    model, tok = load_model(args.model, device="cpu", dtype="float32")
    counter = CountForwards(model)
    tmp = tempfile.mkdtemp(prefix="redraft-bench-")
    empty = empty_datastore(name, tmp)

    def gen(drafters: str, datastore: str | None = None) -> Generator:
        d = build_drafter(drafters, tokenizer=tok, datastore=datastore)
        return Generator(model, tok, d, model_name=name)

    methods: dict[str, Generator | str] = {
        "plain": gen("none"),
        "pld": gen("pld"),
        "rest": gen("rest", args.datastore),
        "pld+rest": gen("pld,rest", args.datastore),
        "recycle": gen("recycle"),
        "pld+rest+recycle": gen("pld,rest,recycle", args.datastore),
        "rest (empty datastore)": gen("rest", empty),
    }
    if not args.no_hf:
        methods["hf-greedy"] = "hf-greedy"
        methods["hf-pld (10)"] = "hf-pld"
    # Measure the cost curve (cached per device) and warm every path before timing anything.
    warm = "Write a Python function that adds two numbers."
    for m in methods.values():
        if isinstance(m, Generator):
            m.cost  # noqa: B018 - triggers the one-time measurement
            m.generate(warm, max_new_tokens=8)
    eos = sorted(Generator(model, tok).eos_ids)

    prompts = load_prompts(Path(args.prompts), args.limit)
    names = list(methods)
    records = []
    ours = {n: m for n, m in methods.items() if isinstance(m, Generator)}
    units = ["redraft"] + [n for n in names if n not in ours]  # rotated per prompt
    for i, prompt in enumerate(prompts):
        per: dict[str, dict] = {}
        for unit in units[i % len(units):] + units[: i % len(units)]:
            if unit == "redraft":  # all of redraft's methods at once, in lock-step
                per.update(lockstep(ours, prompt, args.max_new_tokens))
                continue
            ids = Generator(model, tok).encode(prompt)
            kw = {"prompt_lookup_num_tokens": 10} if methods[unit] == "hf-pld" else {}
            x = torch.tensor([ids])
            counter.calls = 0
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                                     pad_token_id=eos[0], **kw)
                seconds = time.perf_counter() - t0
            # prefill is one of the forwards; redraft's `steps` exclude it (HF's seconds
            # include it: a bias against HF of about one forward per prompt)
            per[unit] = {"tokens": out[0, len(ids):].tolist(), "steps": counter.calls - 1,
                         "seconds": seconds, "accepted": {}}
        base = per["plain"]
        for mname in names:
            rec = per[mname]
            rec.update(method=mname, prompt=i, new_tokens=len(rec["tokens"]),
                       identical=rec["tokens"] == base["tokens"],
                       speedup=base["seconds"] / rec["seconds"])
            records.append(rec)
        line = "  ".join(f"{n}: {per[n]['speedup'] if 'speedup' in per[n] else 0:.2f}x"
                         for n in names)
        print(f"[{i + 1}/{len(prompts)}] {line}", file=sys.stderr, flush=True)

    rows = []
    for mname in names:
        rs = [r for r in records if r["method"] == mname]
        tpf = sum(r["new_tokens"] for r in rs) / max(1, sum(r["steps"] for r in rs))
        rows.append({
            "method": mname,
            "tokens_per_forward": round(tpf, 3),
            "median_speedup": round(statistics.median(r["speedup"] for r in rs), 3),
            "total_speedup": round(sum(r["seconds"] for r in records if r["method"] == "plain")
                                   / sum(r["seconds"] for r in rs), 3),
            "tokens_per_second": round(sum(r["new_tokens"] for r in rs)
                                       / sum(r["seconds"] for r in rs), 2),
            "identical": f"{sum(r['identical'] for r in rs)}/{len(rs)}",
        })
    table = ["| method | tokens / forward | median speed-up | total speed-up | tokens/s | "
             "identical to plain |", "|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['method']} | {r['tokens_per_forward']:.2f} | "
                     f"{r['median_speedup']:.2f}x | {r['total_speedup']:.2f}x | "
                     f"{r['tokens_per_second']:.1f} | {r['identical']} |")
    print("\n".join(table))
    cost = methods["pld"].cost
    curve = ", ".join(f"{n}: {cost.relative(n):.2f}" for n in cost.sizes)
    print(f"\nmeasured forward cost relative to one token (threads={args.threads}): {curve}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        run.write(out / "results.json", {"args": vars(args), "summary": rows,
                                         "records": records, "cost_curve": cost.to_json()})
        (out / "table.md").write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
