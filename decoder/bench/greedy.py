"""Greedy Spec-Bench, side by side with Hugging Face's own generate.

Every method runs in one process, interleaved per question (the order rotates from question
to question), so machine noise hits all methods alike. Speed-ups are ratios to `hf-greedy`
measured in the same run. Multi-turn questions run turn by turn through the chat template,
each method continuing its own conversation, as Spec-Bench does.

Each turn's tokens are compared with `hf-greedy`'s. Where they differ, the target's top-two
logit gap at the first differing position is reported: a tree forward and a one-token
forward round differently in the last bits, so a gap within the model precision's near-tie
rule (`redraft.decoder.near_tie`) is a numerical near-tie, and anything larger is a bug.

A CPU speed-up depends on the machine's state, so the summary records what decides it: the
kernels each method's forwards really ran on, the packing time, where the forward-cost curve
came from (cached, or measured at start and how long that took), the thread count and the
load average at start and end. `--repeat N` runs every question N times, interleaved, and
reports each ratio's median and range over the repetitions: a claim comes with its noise.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from redraft.decoder.bench.methods import LLAMA_CPP, Method, TurnResult
from redraft.decoder.bench.questions import CATEGORIES, BenchError, Question
from redraft.decoder.bench.results import write_results
from redraft.decoder.near_tie import is_near_tie
from redraft.decoder.text import chat_ids


@dataclass
class Record:
    question_id: int
    category: str
    method: str
    turn: int
    new_tokens: int
    steps: int
    seconds: float
    identical: bool | None = None  # to hf-greedy's tokens for the same turn
    first_diff: int | None = None
    logit_gap: float | None = None
    tokens: list[int] = field(default_factory=list)
    repeat: int = 0
    prompt_tokens: int = 0
    forwards: int = 0
    packed_forwards: int = 0
    cpu_seconds: float = 0.0
    draft_seconds: float = 0.0
    accepted: dict[str, int] = field(default_factory=dict)
    tried: dict[str, int] = field(default_factory=dict)
    near_tie: bool | None = None  # the first difference is within the near-tie rule


def top2_gap(model, ids: Sequence[int]) -> tuple[float, bool]:
    """The target's top-two logit gap for the token after `ids` (a plain forward), and
    whether it is a near-tie at the model's precision."""
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)], device=model.device)).logits[0, -1]
    tie, gap = is_near_tie(logits, next(model.parameters()).dtype)
    return gap, tie


def compare(
    model, prompt: list[int], ref: list[int], got: list[int]
) -> tuple[bool, int | None, float | None, bool | None]:
    """(identical, first differing position, top-two logit gap there, near-tie there)."""
    if got == ref:
        return True, None, None, None
    pos = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    if pos >= len(ref):
        return False, pos, None, None
    gap, tie = top2_gap(model, prompt + ref[:pos])
    return False, pos, gap, tie


def run_bench(
    questions: Sequence[Question],
    methods: Sequence[Method],
    model,
    tokenizer,
    max_new_tokens: int,
    progress: Callable[[int], None] | None = None,
    repeat: int = 1,
) -> list[Record]:
    """Run every method on every question, interleaved per question; hf-greedy is the reference.

    With `repeat` > 1 each question runs that many times in a row, every method once per
    repetition, the order rotating from run to run."""
    names = [m.name for m in methods]
    if "hf-greedy" not in names:
        raise BenchError("the methods must include hf-greedy, the reference every ratio divides by")
    records: list[Record] = []
    for qi, rep in ((qi, rep) for qi in range(len(questions)) for rep in range(repeat)):
        q, k = questions[qi], (qi * repeat + rep) % len(methods)
        order = list(methods[k:]) + list(methods[:k])
        turns: dict[str, list[tuple[list[int], TurnResult]]] = {}
        for method in order:
            messages: list[dict] = []
            done = []
            for turn in q.turns:
                messages.append({"role": "user", "content": turn})
                prompt = chat_ids(tokenizer, messages)
                result = method.run(list(messages), max_new_tokens)
                done.append((prompt, result))
                messages.append({"role": "assistant", "content": result.text})
            turns[method.name] = done
            if progress:
                progress(1)
        reference = turns["hf-greedy"]
        for method in methods:
            for t, (prompt, res) in enumerate(turns[method.name]):
                ref_prompt, ref = reference[t]
                same_prompt = prompt == ref_prompt
                # A conversation whose earlier turn differed has a different prompt here.
                identical, pos, gap, tie = (
                    (None, None, None, None) if not method.compared else
                    compare(model, prompt, ref.tokens, res.tokens)
                    if same_prompt else (False, 0, None, None)
                )
                records.append(Record(q.question_id, q.category, method.name, t,
                                      len(res.tokens), res.steps, res.seconds,
                                      identical, pos, gap, res.tokens, rep, len(prompt),
                                      res.forwards, res.packed_forwards, res.cpu_seconds,
                                      res.draft_seconds, res.accepted, res.tried, tie))
    return records


def summarize(records: Sequence[Record]) -> dict:
    """Per method × category (and overall): tokens/forward, tokens/s, speed-up, identity, the
    kernels the forwards ran on, the speed-up's median and range over repetitions, drafting
    time per step, and each draft source's acceptance (accepted / verified nodes whose parent
    was accepted)."""
    by: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        by[(r.method, r.category)].append(r)
        by[(r.method, "overall")].append(r)
    base = {cat: _tps(rs) for (m, cat), rs in by.items() if m == "hf-greedy"}
    base_cpu = {cat: _tps(rs, cpu=True) for (m, cat), rs in by.items() if m == "hf-greedy"}
    rows = []
    for (method, cat), rs in sorted(by.items()):
        tps, cpu_tps = _tps(rs), _tps(rs, cpu=True)
        diffs = [r for r in rs if r.identical is False]
        row = {
            "method": method, "category": cat, "turns": len(rs),
            "tokens_per_forward": round(
                sum(r.new_tokens for r in rs) / max(1, sum(r.steps for r in rs)), 3
            ),
            "tokens_per_second": round(tps, 2),
            "speedup": round(tps / base[cat], 3) if base.get(cat) else None,
            "tokens_per_cpu_second": round(cpu_tps, 2),
            "cpu_speedup": round(cpu_tps / base_cpu[cat], 3) if base_cpu.get(cat) else None,
            # llama-cpp runs another (quantized) model: its tokens are not compared
            "identical": "n/a" if method == LLAMA_CPP else f"{len(rs) - len(diffs)}/{len(rs)}",
            "max_gap_at_diff": max((r.logit_gap or 0.0 for r in diffs), default=None),
            # first differences at a near-tie (see `near_tie`), and the others: bugs, unless
            # an earlier turn of the conversation already differed
            "near_ties": sum(r.near_tie is True for r in diffs),
            "beyond_near_tie": sum(r.near_tie is False for r in diffs),
            "median_seconds_per_turn": round(statistics.median(r.seconds for r in rs), 3),
            "mean_prompt_tokens": round(statistics.fmean(r.prompt_tokens for r in rs), 1),
            "forwards": sum(r.forwards for r in rs),
            "packed_forwards": sum(r.packed_forwards for r in rs),
            "draft_ms_per_step": round(
                1000 * sum(r.draft_seconds for r in rs) / max(1, sum(r.steps for r in rs)), 2
            ),
            "acceptance": _acceptance(rs),
        }
        row.update(_spread(rs, by[("hf-greedy", cat)]))
        rows.append(row)
    return {"rows": rows, "repeats": len({r.repeat for r in records})}


def _spread(rs: Sequence[Record], reference: Sequence[Record]) -> dict:
    """Tokens/s and speed-up per repetition (each over its own hf-greedy): median and range,
    by the wall clock (`speedup_*`) and by CPU time (`cpu_speedup_*`)."""
    def per_repeat(records: Sequence[Record], cpu: bool) -> dict[int, float]:
        groups: dict[int, list[Record]] = defaultdict(list)
        for r in records:
            groups[r.repeat].append(r)
        return {k: _tps(v, cpu) for k, v in groups.items()}

    out: dict = {}
    for prefix, cpu in (("", False), ("cpu_", True)):
        tps, ref = per_repeat(rs, cpu), per_repeat(reference, cpu)
        if not cpu:
            out["tokens_per_second_runs"] = [round(v, 2) for _, v in sorted(tps.items())]
        ratios = [tps[k] / ref[k] for k in sorted(tps) if ref.get(k)]
        if ratios:
            out.update({f"{prefix}speedup_runs": [round(x, 3) for x in ratios],
                        f"{prefix}speedup_median": round(statistics.median(ratios), 3),
                        f"{prefix}speedup_min": round(min(ratios), 3),
                        f"{prefix}speedup_max": round(max(ratios), 3)})
    return out


def _acceptance(rs: Sequence[Record]) -> dict[str, float]:
    tried: dict[str, int] = defaultdict(int)
    accepted: dict[str, int] = defaultdict(int)
    for r in rs:
        for src, n in r.tried.items():
            tried[src] += n
            accepted[src] += r.accepted.get(src, 0)
    return {src: round(accepted[src] / n, 3) for src, n in sorted(tried.items()) if n}


def _tps(rs: Sequence[Record], cpu: bool = False) -> float:
    """Tokens per second of the records, by the wall clock or by this process's CPU time."""
    secs = sum(r.cpu_seconds if cpu else r.seconds for r in rs)
    return sum(r.new_tokens for r in rs) / secs if secs else 0.0


def markdown_table(summary: dict, methods: Sequence[str]) -> str:
    """The results table; with repetitions, a column for the speed-up's median (min–max)."""
    runs = summary.get("repeats", 1)
    spread = f" median (min–max) of {runs} runs |" if runs > 1 else ""
    lines = [
        "| category | method | tokens/forward | tokens/s | speed-up vs hf-greedy |"
        f"{spread} in CPU time | draft ms/step | identical |",
        "|---|---|---:|---:|---:|" + ("---:|" if runs > 1 else "") + "---:|---:|---:|",
    ]
    rows = summary["rows"]
    cats = _categories(rows)
    index = {(r["method"], r["category"]): r for r in rows}
    for cat in cats:
        for m in methods:
            r = index.get((m, cat))
            if r:
                sp = f"{r['speedup']:.2f}×" if r["speedup"] is not None else "–"
                if runs > 1:
                    sp += (f" | {r['speedup_median']:.2f}× ({r['speedup_min']:.2f}–"
                           f"{r['speedup_max']:.2f})" if "speedup_median" in r else " | –")
                cpu = r.get("cpu_speedup")
                sp += f" | {cpu:.2f}×" if cpu is not None else " | –"
                dr = f"{r['draft_ms_per_step']:.1f}" if m.startswith("redraft-") else "–"
                lines.append(f"| {cat} | {m} | {r['tokens_per_forward']:.2f} | "
                             f"{r['tokens_per_second']:.1f} | {sp} | {dr} | {r['identical']} |")
    return "\n".join(lines) + "\n"


def _categories(rows: Sequence[dict]) -> list[str]:
    """Spec-Bench's categories in their order, then any others (own question files), then
    overall."""
    present = {r["category"] for r in rows}
    known = [c for c in CATEGORIES if c in present]
    return [*known, *sorted(present - set(known) - {"overall"}), "overall"]


def conditions_note(meta: dict) -> str:
    """One paragraph under the table: the state of the machine the ratios were measured in."""
    start, end = meta.get("machine_start", {}), meta.get("machine_end", {})
    kernels, curve = meta.get("kernels", {}), meta.get("cost_curve") or {}
    parts = [f"{meta['dtype']}, redraft's forward: {kernels.get('redraft')}"] \
        if meta.get("dtype") else []
    parts += [f"torch threads {start.get('torch_threads')}",
             f"{start.get('cpus_allowed')} of {start.get('cpus')} CPUs allowed",
             f"load average {start.get('load_average', [None])[0]} at start, "
             f"{end.get('load_average', [None])[0]} at end"]
    forwards = kernels.get("forwards", {})
    if forwards:
        parts.append("packed forwards: " + ", ".join(
            f"{m} {v['packed']}/{v['forwards']}" for m, v in forwards.items()))
    if "pack_seconds" in kernels:
        parts.append(f"packing {kernels['pack_seconds']:.2f} s (before any answer)")
    if curve.get("source") == "flat":
        parts.append(f"a fixed tree of {curve['sizes'][-1] - 1} nodes every step (--tree-nodes): "
                     "tokens per forward as on a GPU, wall clock as here")
    elif curve:
        how = (f"measured at start in {curve['measure_seconds']:.1f} s"
               if curve["source"] == "measured" else curve["source"])
        parts.append(f"cost curve {how}, corrected {curve['corrections']} times by timed forwards")
    return "Conditions: " + "; ".join(parts) + ".\n"


def plot(summary: dict, methods: Sequence[str], path: Path) -> None:
    cats = _categories(summary["rows"])
    index = {(r["method"], r["category"]): r for r in summary["rows"]}
    shown = [m for m in methods if m != "hf-greedy"]
    width = 0.8 / max(1, len(shown))
    # A Figure of its own, not pyplot's: no backend to choose, no global state to clean up.
    from matplotlib.figure import Figure  # lazy: ~0.4 s at every `redraft` start otherwise

    fig = Figure(figsize=(max(8, 1.6 * len(cats)), 4.5))
    ax = fig.subplots()
    for i, m in enumerate(shown):
        values = [(index.get((m, c)) or {}).get("speedup") or 0.0 for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], values, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(cats))])
    ax.set_xticklabels(cats, rotation=20, ha="right")
    ax.set_ylabel("speed-up over hf-greedy")
    ax.set_title("Spec-Bench speed-up per category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def kernel_report(records: Sequence[Record], kernels, verifier: str | None = None,
                  choose: bool = True) -> dict:
    """Per method, how many target forwards really ran on packed weights; packing's cost and
    (with the per-size choice) which kind each forward size prefers by the end; `verifier`:
    how redraft's methods ran the target (`TreeVerifier.kind`)."""
    forwards: dict[str, dict[str, int]] = {}
    for r in records:
        f = forwards.setdefault(r.method, {"forwards": 0, "packed": 0})
        f["forwards"] += r.forwards
        f["packed"] += r.packed_forwards
    kind = "stock" if kernels is None else "chosen per size" if choose else "packed"
    out = {"redraft": verifier or kind, "forwards": forwards}
    if kernels is not None:
        out.update(pack_seconds=round(kernels.pack_seconds, 3), repacked=kernels.repacked,
                   packed_layers=len(kernels.forwards))
        if choose and kernels.choice is not None:  # the lean forward is packed at every size
            out["preferred"] = kernels.choice.summary()
    return out


def write_outputs(out: Path, records: Sequence[Record], summary: dict, methods: Sequence[str],
                  meta: dict) -> None:
    write_results(out, records, summary, meta,
                  markdown_table(summary, methods) + "\n" + conditions_note(meta))
    plot(summary, methods, out / "speedup.png")
