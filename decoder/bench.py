"""`redraft bench`: Spec-Bench, side by side with Hugging Face's own generate.

Every method runs in one process, interleaved per question (the order rotates from question
to question), so machine noise hits all methods alike. Speed-ups are ratios to `hf-greedy`
measured in the same run. Multi-turn questions run turn by turn through the chat template,
each method continuing its own conversation, as Spec-Bench does.

Each turn's tokens are compared with `hf-greedy`'s. Where they differ, the target's top-two
logit gap at the first differing position is reported: a tree forward and a one-token
forward round differently in the last bits, so a tiny gap is a numerical near-tie and
anything larger is a bug.

A CPU speed-up depends on the machine's state, so the summary records what decides it: the
kernels each method's forwards really ran on, the packing time, where the forward-cost curve
came from (cached, or measured at start and how long that took), the thread count and the
load average at start and end. `--repeat N` runs every question N times, interleaved, and
reports each ratio's median and range over the repetitions: a claim comes with its noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from redraft.decoder.kernels import packed_calls
from redraft.proto.errors import RedraftError

MT_BENCH = {
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
}
CATEGORY_NAMES = {
    "translation": "translation",
    "summarization": "summarization",
    "qa": "question answering",
    "math_reasoning": "mathematical reasoning",
    "rag": "retrieval-augmented generation",
}
MULTI_TURN = "multi-turn conversation"
CATEGORIES = [MULTI_TURN, *CATEGORY_NAMES.values()]
NEAR_TIE = 1e-3  # logit gap under which a difference is a rounding near-tie, not a bug


class BenchError(RedraftError):
    """Bad benchmark input: missing question file, unknown method, bad counts."""


@dataclass
class Question:
    question_id: int
    category: str  # one of CATEGORIES
    turns: list[str]


@dataclass
class TurnResult:
    tokens: list[int]
    text: str
    steps: int  # target forwards that produced new tokens
    seconds: float  # wall clock of the whole call, prefill included, for every method alike
    forwards: int = 0  # every target forward, prefill included
    packed_forwards: int = 0  # of those, the ones whose linear layers really ran packed
    # this process's CPU time for the call: with one torch thread it leaves out the time other
    # processes held the core, so it is the steadier clock on a shared machine
    cpu_seconds: float = 0.0
    draft_seconds: float = 0.0  # of which inside the drafter (redraft's methods)
    accepted: dict[str, int] = field(default_factory=dict)  # draft tokens accepted per source
    tried: dict[str, int] = field(default_factory=dict)  # verified with their parent accepted


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


def load_questions(path: str | Path, per_category: int | None) -> list[Question]:
    """Spec-Bench questions grouped into its six categories; `per_category` spread evenly."""
    grouped = read_questions(
        path, lambda cat: MULTI_TURN if cat in MT_BENCH else CATEGORY_NAMES.get(cat, cat))
    if not grouped:
        raise BenchError(f"{path}: no questions")
    return pick_evenly(grouped, [*CATEGORIES, *sorted(set(grouped) - set(CATEGORIES))],
                       per_category)


def read_questions(path: str | Path, category: Callable[[str], str | None]
                   ) -> dict[str, list[Question]]:
    """A question file's records by `category(record's category)`; None leaves a record out."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"question file not found: {path}")
    grouped: dict[str, list[Question]] = defaultdict(list)
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                cat = category(rec["category"])
                if cat is not None:
                    grouped[cat].append(Question(int(rec["question_id"]), cat,
                                                 [str(t) for t in rec["turns"]]))
            except (ValueError, KeyError, TypeError) as exc:
                raise BenchError(f"{path}:{n}: not a Spec-Bench question ({exc})") from None
    return grouped


def pick_evenly(grouped: dict[str, list[Question]], order: Sequence[str],
                per_category: int | None) -> list[Question]:
    """`per_category` questions of each category in `order`, evenly spaced (so the 8 MT-Bench
    sub-categories all appear in "multi-turn")."""
    out: list[Question] = []
    for cat in order:
        qs = grouped.get(cat, [])
        if per_category and len(qs) > per_category:
            qs = [qs[i * len(qs) // per_category] for i in range(per_category)]
        out.extend(qs)
    return out


# -- methods ---------------------------------------------------------------------------------


class Method:
    """One way of generating a turn's answer from chat messages."""

    name = "method"

    def run(self, messages: list[dict], max_new_tokens: int) -> TurnResult:
        raise NotImplementedError


class HFMethod(Method):
    """Hugging Face's own `generate`: greedy, or greedy with its prompt lookup."""

    def __init__(self, name: str, model, tokenizer, prompt_lookup_num_tokens: int | None = None):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.kwargs = {}
        if prompt_lookup_num_tokens:
            self.kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
        self._forwards = self._packed = self._calls_before = 0
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def _before(self, *_args) -> None:
        self._forwards += 1
        self._calls_before = packed_calls()

    def _after(self, *_args) -> None:
        self._packed += packed_calls() > self._calls_before  # never, unless a bug packs them

    def run(self, messages: list[dict], max_new_tokens: int) -> TurnResult:
        ids = chat_ids(self.tokenizer, messages)
        input_ids = torch.tensor([ids], device=self.model.device)
        eos = self.model.generation_config.eos_token_id
        self._forwards = self._packed = 0
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, eos_token_id=eos,
                pad_token_id=self.tokenizer.pad_token_id or eos, **self.kwargs,
            )
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = out[0, len(ids):].tolist()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        # HF's prefill forward already yields the first new token, so every forward counts.
        return TurnResult(tokens, text, self._forwards, seconds, self._forwards, self._packed,
                          cpu)


class RedraftMethod(Method):
    """redraft's Generator with one drafter configuration (None = plain decoding)."""

    def __init__(self, name: str, generator) -> None:
        self.name = name
        self.generator = generator

    def run(self, messages: list[dict], max_new_tokens: int) -> TurnResult:
        ids = chat_ids(self.generator.tokenizer, messages)  # outside the clock, as for HF
        verifier = self.generator.verifier
        forwards, packed = verifier.forwards, verifier.packed_forwards
        t0, c0 = time.perf_counter(), time.process_time()
        res = self.generator.generate(ids, max_new_tokens=max_new_tokens)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = res.stats
        return TurnResult(res.tokens, res.text, s.steps, seconds,
                          verifier.forwards - forwards, verifier.packed_forwards - packed, cpu,
                          s.draft_seconds, dict(s.accepted), dict(s.tried))


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


# -- running ---------------------------------------------------------------------------------


def top2_gap(model, ids: Sequence[int]) -> float:
    """The target's top-two logit gap for the token after `ids` (a plain forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare(
    model, prompt: list[int], ref: list[int], got: list[int]
) -> tuple[bool, int | None, float | None]:
    """(identical, first differing position, top-two logit gap there)."""
    if got == ref:
        return True, None, None
    pos = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    gap = top2_gap(model, prompt + ref[:pos]) if pos < len(ref) else None
    return False, pos, gap


def machine_state() -> dict:
    """What a CPU timing depends on besides the code: threads, usable cores, load."""
    cpus = os.cpu_count()
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    return {"torch_threads": torch.get_num_threads(), "cpus": cpus, "cpus_allowed": allowed,
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def warm_up(methods: Sequence[Method]) -> None:
    """One short answer per method before timing: first-call costs (allocations, oneDNN
    primitives, the kernel choice trying both kinds) must not land on the first question."""
    for method in methods:
        method.run([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                   max_new_tokens=8)


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
                identical, pos, gap = (
                    compare(model, prompt, ref.tokens, res.tokens)
                    if same_prompt else (False, 0, None)
                )
                records.append(Record(q.question_id, q.category, method.name, t,
                                      len(res.tokens), res.steps, res.seconds,
                                      identical, pos, gap, res.tokens, rep, len(prompt),
                                      res.forwards, res.packed_forwards, res.cpu_seconds,
                                      res.draft_seconds, res.accepted, res.tried))
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
            "identical": f"{len(rs) - len(diffs)}/{len(rs)}",
            "max_gap_at_diff": max((r.logit_gap or 0.0 for r in diffs), default=None),
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
    parts = [f"torch threads {start.get('torch_threads')}",
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = _categories(summary["rows"])
    index = {(r["method"], r["category"]): r for r in summary["rows"]}
    shown = [m for m in methods if m != "hf-greedy"]
    width = 0.8 / max(1, len(shown))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cats)), 4.5))
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
    plt.close(fig)


def kernel_report(records: Sequence[Record], kernels, choose: bool = True) -> dict:
    """Per method, how many target forwards really ran on packed weights; packing's cost and
    (with the per-size choice) which kind each forward size prefers by the end."""
    forwards: dict[str, dict[str, int]] = {}
    for r in records:
        f = forwards.setdefault(r.method, {"forwards": 0, "packed": 0})
        f["forwards"] += r.forwards
        f["packed"] += r.packed_forwards
    kind = "stock" if kernels is None else "chosen per size" if choose else "packed"
    out = {"redraft": kind, "forwards": forwards}
    if kernels is not None:
        out.update(pack_seconds=round(kernels.pack_seconds, 3), repacked=kernels.repacked,
                   packed_layers=len(kernels.forwards))
        if choose:
            out["preferred"] = kernels.choice.summary()
    return out


def write_outputs(out: Path, records: Sequence[Record], summary: dict, methods: Sequence[str],
                  meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "records.jsonl").open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    (out / "summary.json").write_text(json.dumps({**meta, **summary}, indent=2) + "\n")
    (out / "summary.md").write_text(markdown_table(summary, methods) + "\n"
                                    + conditions_note(meta))
    plot(summary, methods, out / "speedup.png")


# -- command line ----------------------------------------------------------------------------

HF_METHODS = ("hf-greedy", "hf-pld")
# Named variants: a drafter with some of its options set (they win over the command line's).
VARIANTS: dict[str, tuple[str, dict]] = {
    "redraft-draft-model-int8": ("draft-model", {"draft_model": "int8"}),
    "redraft-draft-model-skip24": ("draft-model", {"draft_model": "skip:24"}),
}


def redraft_methods(model_name: str | None = None) -> dict[str, str]:
    """Method name -> drafter names for build_drafter: `redraft-NAME` for every registered
    drafter, plus plain decoding, PLD + retrieval, and the default drafters (of `model_name`:
    `hybrid` only where it has heads). Any other combination is `redraft-` + names joined by
    `+` (e.g. `redraft-pld+medusa`)."""
    from redraft.decoder.registry import NONE, REGISTRY, default_drafters

    out = {f"redraft-{NONE}": NONE}
    out.update({f"redraft-{name}": name for name in REGISTRY})
    out["redraft-pld-rest"] = "pld,rest"
    out["redraft-default"] = default_drafters(True, model_name)
    out.update({name: drafters for name, (drafters, _) in VARIANTS.items()})
    return out


def method_drafters(method: str, model_name: str | None = None) -> str | None:
    """The drafter names of a redraft method for a model, None for an unknown method
    (`X-nolearn` is X with learned drafts off)."""
    from redraft.decoder.bench_samples import split_learning

    method = split_learning(method)[0]
    known = redraft_methods(model_name)
    if method in known:
        return known[method]
    if method.startswith("redraft-") and "+" in method:
        return method[len("redraft-"):].replace("+", ",")
    return None


DEFAULT_METHODS = ("hf-greedy,hf-pld,redraft-pld,redraft-rest,redraft-recycle,redraft-pld-rest,"
                   "redraft-default")


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` to the `redraft` parser."""
    p = sub.add_parser(
        "bench",
        help="Spec-Bench, side by side with Hugging Face generate and prompt lookup",
        description="Run Spec-Bench questions with every method interleaved per question; "
        "report tokens per forward, tokens/s, speed-up over hf-greedy and token identity.",
    )
    p.add_argument("--model", default=None, help="model name (default: smollm2-135m)")
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
    rest.add_argument("--draft-service", metavar="ADDR", help="draft service for rest drafters")
    p.add_argument("--out", default="bench-out/spec_bench", help="output directory")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
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
    from redraft.decoder.registry import add_options

    add_options(p)
    p.set_defaults(func=run_command)


def parse_methods(spec: str, has_retrieval: bool) -> list[str]:
    from redraft.decoder.registry import REGISTRY, parse_names

    names = [m.strip() for m in spec.split(",") if m.strip()]
    for m in names:
        if m in HF_METHODS:
            continue
        drafters = method_drafters(m)
        if drafters is None:
            known = ", ".join([*HF_METHODS, *redraft_methods()])
            raise BenchError(f"unknown method {m!r} (known: {known}, or redraft-A+B)")
        needs = [n for n in parse_names(drafters) if n in REGISTRY
                 and REGISTRY[n].needs_retrieval]
        if needs and not has_retrieval:
            raise BenchError(f"{m} needs --datastore DIR or --draft-service ADDR")
    if "hf-greedy" not in names:
        names.insert(0, "hf-greedy")
    return list(dict.fromkeys(names))


def run_command(args: argparse.Namespace) -> int:
    from redraft.decoder.bench_samples import drafter_options
    from redraft.decoder.budget import MAX_TREE_NODES, CostModel
    from redraft.decoder.generate import Generator
    from redraft.decoder.models import load_model
    from redraft.decoder.registry import build_drafter, options_from_args
    from tqdm import tqdm

    if args.samples < 1:
        raise BenchError(f"--samples must be at least 1, got {args.samples}")
    if args.tree_nodes is not None and not 1 <= args.tree_nodes <= MAX_TREE_NODES:
        raise BenchError(f"--tree-nodes must be in 1..{MAX_TREE_NODES}, got {args.tree_nodes}")
    if args.samples > 1:
        from redraft.decoder import bench_samples

        return bench_samples.run_command(args)
    if args.max_new_tokens <= 0:
        raise BenchError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.per_category < 0:
        raise BenchError(f"--per-category must be >= 0, got {args.per_category}")
    if args.repeat < 1:
        raise BenchError(f"--repeat must be >= 1, got {args.repeat}")
    names = parse_methods(args.methods or DEFAULT_METHODS,
                          bool(args.datastore or args.draft_service))
    questions = load_questions(args.questions, args.per_category or None)
    if args.threads:
        torch.set_num_threads(args.threads)
    from redraft.decoder.kernels import packed_linears

    machine_start = machine_state()
    model_name = args.model or "smollm2-135m"
    model, tokenizer = load_model(args.model)
    kernels = None if args.stock_kernels else packed_linears(model)  # packs once, timed
    # One forward-cost curve for every drafting method, loaded (or, on a cold cache, measured)
    # before any answer is timed; the methods' timed forwards keep correcting it.
    cost = None
    if args.tree_nodes:
        cost = CostModel.flat(args.tree_nodes)
    elif any(method_drafters(n) not in (None, "none") for n in names):
        cost = CostModel.for_model(model, model_name, packed_kernels=kernels is not None,
                                   choose_kernels=not args.always_packed)
    methods: list[Method] = []
    drafters = []
    run_id = uuid.uuid4().hex[:12]
    for name in names:
        if name in HF_METHODS:
            methods.append(HFMethod(name, model, tokenizer,
                                    10 if name == "hf-pld" else None))
            continue
        options = {**options_from_args(args), **VARIANTS.get(name, ("", {}))[1]}
        drafter = build_drafter(method_drafters(name, args.model), model=model, tokenizer=tokenizer,
                                model_name=model_name,
                                datastore=args.datastore, draft_service=args.draft_service,
                                options=drafter_options(name, options, run_id))
        drafters.append(drafter)
        methods.append(RedraftMethod(name, Generator(
            model, tokenizer, drafter, model_name=model_name, cost=cost,
            packed_kernels=not args.stock_kernels, choose_kernels=not args.always_packed)))
    warm_up(methods)
    total = len(questions) * len(methods) * args.repeat
    try:
        with tqdm(total=total, desc="spec-bench", unit="answer", file=sys.stderr) as bar:
            records = run_bench(questions, methods, model, tokenizer, args.max_new_tokens,
                                progress=bar.update, repeat=args.repeat)
    finally:
        for d in drafters:
            if d is not None and hasattr(d, "close"):
                d.close()
    summary = summarize(records)
    meta = {"model": model_name, "questions": len(questions),
            "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
            "repeat": args.repeat, "methods": names, "datastore": args.datastore,
            "draft_service": args.draft_service, "device": str(model.device),
            "machine_start": machine_start, "machine_end": machine_state(),
            # redraft's forwards run on packed oneDNN weights on a CPU; HF's on stock kernels
            "kernels": kernel_report(records, kernels, not args.always_packed),
            "cost_curve": cost.describe() if cost is not None else None}
    out = Path(args.out)
    write_outputs(out, records, summary, names, meta)
    print(markdown_table(summary, names))
    print(conditions_note(meta))
    print(f"results in {out}/ (records.jsonl, summary.json, summary.md, speedup.png)")
    return 0
