"""`redraft bench --samples N`: repeated sampling, with and without learned drafts.

Best-of-N, self-consistency and reinforcement-learning rollouts answer one prompt many times
with sampling. Learned drafts (the `rest` drafter's outputs learned from earlier generations)
are meant for exactly this, so the workload answers each question N times at a temperature,
every method in turn (the order rotates from sample to sample), and reports tokens per
forward on the first sample and on samples 2..N separately: the first shows the cold start,
the rest what learning adds. A method named `X-nolearn` runs X's drafters with learning off,
its baseline.

Nothing learned in one run counts in another: each run builds its drafters afresh (learned
outputs live in their memory), and through a draft service each method of each run is its
own tenant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

NOLEARN = "-nolearn"
# Spec-Bench categories answered by the workload: its math questions (GSM8K test) and
# MT-Bench's coding questions.
SAMPLING_CATEGORIES = {"math_reasoning": "mathematical reasoning", "coding": "coding"}
DEFAULT_SAMPLING_METHODS = "redraft-default,redraft-default-nolearn"


def split_learning(method: str) -> tuple[str, bool]:
    """(the method without a `-nolearn` suffix, whether it learns)."""
    if method.endswith(NOLEARN):
        return method[: -len(NOLEARN)], False
    return method, True


def drafter_options(method: str, given: dict, run_id: str) -> dict:
    """A method's drafter options: learning off for `-nolearn`, and a tenant of its own per
    run (so a draft service's learned outputs never cross methods or runs)."""
    options = dict(given)
    if not split_learning(method)[1]:
        options["learn"] = "off"
    if not options.get("tenant"):
        options["tenant"] = f"bench-{run_id}-{method}"
    return options


@dataclass
class SampleRecord:
    question_id: int
    category: str
    method: str
    sample: int  # 0-based: sample 0 is the cold start
    turn: int
    new_tokens: int
    steps: int
    seconds: float
    accepted: dict[str, int] = field(default_factory=dict)  # accepted draft tokens by source


def load_sampling_questions(path: str | Path, per_category: int | None):
    """Spec-Bench's math and coding questions, `per_category` of each, evenly spaced."""
    from redraft.decoder.bench import BenchError, pick_evenly, read_questions

    grouped = read_questions(path, SAMPLING_CATEGORIES.get)
    if not grouped:
        raise BenchError(f"{path}: no math or coding questions")
    return pick_evenly(grouped, list(SAMPLING_CATEGORIES.values()), per_category)


def run_samples(questions, generators: dict, samples: int, temperature: float,
                max_new_tokens: int, progress=None) -> list[SampleRecord]:
    """Every question `samples` times per method, methods interleaved sample by sample."""
    names = list(generators)
    records: list[SampleRecord] = []
    turn_no = 0
    for q in questions:
        for k in range(samples):
            turn_no += 1
            shift = turn_no % len(names)
            for name in names[shift:] + names[:shift]:
                messages: list[dict] = []
                for t, turn in enumerate(q.turns):
                    messages.append({"role": "user", "content": turn})
                    t0 = time.perf_counter()
                    r = generators[name].generate(list(messages), max_new_tokens=max_new_tokens,
                                                  temperature=temperature,
                                                  seed=1000 * q.question_id + k)
                    records.append(SampleRecord(q.question_id, q.category, name, k, t,
                                                r.stats.new_tokens, r.stats.steps,
                                                time.perf_counter() - t0,
                                                dict(r.stats.accepted)))
                    messages.append({"role": "assistant", "content": r.text})
                if progress:
                    progress(1)
    return records


def summarize_samples(records: Sequence[SampleRecord]) -> dict:
    """Per method x category (and overall): tokens per forward and tokens/s on the first
    sample and on the later ones, the share of learned tokens, and each learning method's
    ratio to its `-nolearn` baseline on the later samples."""
    groups: dict[tuple[str, str], list[SampleRecord]] = defaultdict(list)
    for r in records:
        groups[(r.method, r.category)].append(r)
        groups[(r.method, "overall")].append(r)
    rows = []
    for (method, cat), rs in sorted(groups.items()):
        first = [r for r in rs if r.sample == 0]
        later = [r for r in rs if r.sample > 0]
        learned = sum(v for r in later for k, v in r.accepted.items() if "learned" in k)
        rows.append({
            "method": method, "category": cat, "answers": len(rs),
            "tokens_per_forward_first": _per_forward(first),
            "tokens_per_forward_later": _per_forward(later),
            "tokens_per_second_later": round(sum(r.new_tokens for r in later)
                                             / max(1e-9, sum(r.seconds for r in later)), 2),
            "learned_share_later": round(learned / max(1, sum(r.new_tokens for r in later)), 3),
        })
    index = {(r["method"], r["category"]): r for r in rows}
    for row in rows:
        base, learns = split_learning(row["method"])
        other = index.get((base + NOLEARN, row["category"])) if learns else None
        if other and other["tokens_per_forward_later"]:
            row["later_vs_nolearn"] = round(row["tokens_per_forward_later"]
                                            / other["tokens_per_forward_later"], 3)
    return {"rows": rows}


def _per_forward(rs: Sequence[SampleRecord]) -> float:
    return round(sum(r.new_tokens for r in rs) / max(1, sum(r.steps for r in rs)), 3)


def markdown_samples(summary: dict, samples: int) -> str:
    later = f"samples 2..{samples}"
    lines = [f"| category | method | tokens/forward, sample 1 | tokens/forward, {later} | "
             f"vs -nolearn, {later} | tokens/s, {later} | learned share |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        ratio = f"{r['later_vs_nolearn']:.2f}×" if "later_vs_nolearn" in r else "–"
        lines.append(f"| {r['category']} | {r['method']} | {r['tokens_per_forward_first']:.2f} | "
                     f"{r['tokens_per_forward_later']:.2f} | {ratio} | "
                     f"{r['tokens_per_second_later']:.1f} | {r['learned_share_later']:.0%} |")
    return "\n".join(lines) + "\n"


def run_command(args: argparse.Namespace) -> int:
    """`redraft bench --samples N` (N > 1)."""
    import torch
    from redraft.decoder.bench import BenchError, method_drafters, warm_up
    from redraft.decoder.bench import RedraftMethod as _Method
    from redraft.decoder.budget import CostModel
    from redraft.decoder.generate import Generator
    from redraft.decoder.kernels import packed_linears
    from redraft.decoder.models import load_model
    from redraft.decoder.registry import build_drafter, options_from_args
    from tqdm import tqdm

    if not args.temperature > 0:
        raise BenchError(f"--samples needs a --temperature above 0, got {args.temperature}")
    if args.max_new_tokens <= 0 or args.per_category < 0:
        raise BenchError("--max-new-tokens must be positive and --per-category >= 0")
    methods = [m.strip() for m in (args.methods or DEFAULT_SAMPLING_METHODS).split(",")
               if m.strip()]
    for m in methods:
        if method_drafters(split_learning(m)[0]) is None:
            raise BenchError(f"--samples runs redraft methods only; unknown method {m!r}")
    questions = load_sampling_questions(args.questions, args.per_category or None)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    name = args.model or "smollm2-135m"
    kernels = None if args.stock_kernels else packed_linears(model)
    cost = (CostModel.flat(args.tree_nodes) if args.tree_nodes  # one for all
            else CostModel.for_model(model, name, packed_kernels=kernels is not None))
    run_id = uuid.uuid4().hex[:12]
    generators, drafters = {}, []
    try:
        for m in methods:
            drafter = build_drafter(method_drafters(split_learning(m)[0], args.model),
                                    model=model, tokenizer=tokenizer, model_name=name,
                                    datastore=args.datastore, draft_service=args.draft_service,
                                    options=drafter_options(m, options_from_args(args), run_id))
            drafters.append(drafter)
            generators[m] = Generator(model, tokenizer, drafter, model_name=name, cost=cost,
                                      packed_kernels=not args.stock_kernels)
        warm_up([_Method(m, g) for m, g in generators.items()])
        total = len(questions) * args.samples * len(methods)
        with tqdm(total=total, desc="samples", unit="answer", file=sys.stderr) as bar:
            records = run_samples(questions, generators, args.samples, args.temperature,
                                  args.max_new_tokens, progress=bar.update)
    finally:
        for d in drafters:
            if d is not None:
                d.close()
    summary = summarize_samples(records)
    meta = {"model": name, "questions": len(questions), "samples": args.samples,
            "temperature": args.temperature, "per_category": args.per_category,
            "max_new_tokens": args.max_new_tokens, "methods": methods,
            "datastore": args.datastore, "draft_service": args.draft_service,
            "torch_threads": torch.get_num_threads(), "run_id": run_id}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "records.jsonl").open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    (out / "summary.json").write_text(json.dumps({**meta, **summary}, indent=2) + "\n")
    table = markdown_samples(summary, args.samples)
    (out / "summary.md").write_text(table)
    print(table)
    print(f"results in {out}/ (records.jsonl, summary.json, summary.md)")
    return 0
