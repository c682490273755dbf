"""Repeated sampling (`redraft bench --samples N`), with and without learned drafts.

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

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from redraft.decoder.bench.methods import NOLEARN, split_learning


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
