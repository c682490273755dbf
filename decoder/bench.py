"""`redraft bench`: Spec-Bench, side by side with Hugging Face's own generate.

Every method runs in one process, interleaved per question (the order rotates from question
to question), so machine noise hits all methods alike. Speed-ups are ratios to `hf-greedy`
measured in the same run. Multi-turn questions run turn by turn through the chat template,
each method continuing its own conversation, as Spec-Bench does.

Each turn's tokens are compared with `hf-greedy`'s. Where they differ, the target's top-two
logit gap at the first differing position is reported: a tree forward and a one-token
forward round differently in the last bits, so a tiny gap is a numerical near-tie and
anything larger is a bug.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from redraft.datastore.errors import RedraftError

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
    draft_seconds: float = 0.0
    accepted: dict[str, int] = field(default_factory=dict)
    tried: dict[str, int] = field(default_factory=dict)


def load_questions(path: str | Path, per_category: int | None) -> list[Question]:
    """Spec-Bench questions grouped into its six categories; `per_category` spread evenly."""
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
                cat = rec["category"]
                q = Question(int(rec["question_id"]), MULTI_TURN if cat in MT_BENCH
                             else CATEGORY_NAMES.get(cat, cat), [str(t) for t in rec["turns"]])
            except (ValueError, KeyError, TypeError) as exc:
                raise BenchError(f"{path}:{n}: not a Spec-Bench question ({exc})") from None
            grouped[q.category].append(q)
    if not grouped:
        raise BenchError(f"{path}: no questions")
    out: list[Question] = []
    for cat in [*CATEGORIES, *sorted(set(grouped) - set(CATEGORIES))]:
        qs = grouped.get(cat, [])
        if per_category and len(qs) > per_category:
            # Evenly spaced, so the 8 MT-Bench sub-categories all appear in "multi-turn".
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
        self._forwards = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, *_args) -> None:
        self._forwards += 1

    def run(self, messages: list[dict], max_new_tokens: int) -> TurnResult:
        ids = chat_ids(self.tokenizer, messages)
        input_ids = torch.tensor([ids], device=self.model.device)
        eos = self.model.generation_config.eos_token_id
        self._forwards = 0
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, eos_token_id=eos,
                pad_token_id=self.tokenizer.pad_token_id or eos, **self.kwargs,
            )
        seconds = time.perf_counter() - t0
        tokens = out[0, len(ids):].tolist()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        # HF's prefill forward already yields the first new token, so every forward counts.
        return TurnResult(tokens, text, self._forwards, seconds)


class RedraftMethod(Method):
    """redraft's Generator with one drafter configuration (None = plain decoding)."""

    def __init__(self, name: str, generator) -> None:
        self.name = name
        self.generator = generator

    def run(self, messages: list[dict], max_new_tokens: int) -> TurnResult:
        t0 = time.perf_counter()
        res = self.generator.generate(messages, max_new_tokens=max_new_tokens)
        seconds = time.perf_counter() - t0
        s = res.stats
        return TurnResult(res.tokens, res.text, s.steps, seconds, s.draft_seconds,
                          dict(s.accepted), dict(s.tried))


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


def warm_up(methods: Sequence[Method]) -> None:
    """One short answer per method before timing: first-call costs (allocations, the cost
    curve a Generator measures once per device) must not land on the first question."""
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
) -> list[Record]:
    """Run every method on every question, interleaved per question; hf-greedy is the reference."""
    names = [m.name for m in methods]
    if "hf-greedy" not in names:
        raise BenchError("the methods must include hf-greedy, the reference every ratio divides by")
    records: list[Record] = []
    for qi, q in enumerate(questions):
        order = list(methods[qi % len(methods):]) + list(methods[: qi % len(methods)])
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
                                      identical, pos, gap, res.tokens, res.draft_seconds,
                                      res.accepted, res.tried))
    return records


def summarize(records: Sequence[Record]) -> dict:
    """Per method × category (and overall): tokens/forward, tokens/s, speed-up, identity,
    drafting time per step, and each draft source's acceptance (accepted / verified nodes
    whose parent was accepted)."""
    by: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        by[(r.method, r.category)].append(r)
        by[(r.method, "overall")].append(r)
    base = {cat: _tps(rs) for (m, cat), rs in by.items() if m == "hf-greedy"}
    rows = []
    for (method, cat), rs in sorted(by.items()):
        tps = _tps(rs)
        diffs = [r for r in rs if r.identical is False]
        rows.append({
            "method": method, "category": cat, "turns": len(rs),
            "tokens_per_forward": round(
                sum(r.new_tokens for r in rs) / max(1, sum(r.steps for r in rs)), 3
            ),
            "tokens_per_second": round(tps, 2),
            "speedup": round(tps / base[cat], 3) if base.get(cat) else None,
            "identical": f"{len(rs) - len(diffs)}/{len(rs)}",
            "max_gap_at_diff": max((r.logit_gap or 0.0 for r in diffs), default=None),
            "median_seconds_per_turn": round(statistics.median(r.seconds for r in rs), 3),
            "draft_ms_per_step": round(
                1000 * sum(r.draft_seconds for r in rs) / max(1, sum(r.steps for r in rs)), 2
            ),
            "acceptance": _acceptance(rs),
        })
    return {"rows": rows}


def _acceptance(rs: Sequence[Record]) -> dict[str, float]:
    tried: dict[str, int] = defaultdict(int)
    accepted: dict[str, int] = defaultdict(int)
    for r in rs:
        for src, n in r.tried.items():
            tried[src] += n
            accepted[src] += r.accepted.get(src, 0)
    return {src: round(accepted[src] / n, 3) for src, n in sorted(tried.items()) if n}


def _tps(rs: Sequence[Record]) -> float:
    secs = sum(r.seconds for r in rs)
    return sum(r.new_tokens for r in rs) / secs if secs else 0.0


def markdown_table(summary: dict, methods: Sequence[str]) -> str:
    lines = [
        "| category | method | tokens/forward | tokens/s | speed-up vs hf-greedy | draft ms/step "
        "| identical |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    cats = [c for c in [*CATEGORIES, "overall"] if any(r["category"] == c for r in summary["rows"])]
    index = {(r["method"], r["category"]): r for r in summary["rows"]}
    for cat in cats:
        for m in methods:
            r = index.get((m, cat))
            if r:
                sp = f"{r['speedup']:.2f}×" if r["speedup"] is not None else "–"
                dr = f"{r['draft_ms_per_step']:.1f}" if m.startswith("redraft-") else "–"
                lines.append(f"| {cat} | {m} | {r['tokens_per_forward']:.2f} | "
                             f"{r['tokens_per_second']:.1f} | {sp} | {dr} | {r['identical']} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, methods: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [c for c in [*CATEGORIES, "overall"] if any(r["category"] == c for r in summary["rows"])]
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


def write_outputs(out: Path, records: Sequence[Record], summary: dict, methods: Sequence[str],
                  meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "records.jsonl").open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    (out / "summary.json").write_text(json.dumps({**meta, **summary}, indent=2) + "\n")
    (out / "summary.md").write_text(markdown_table(summary, methods))
    plot(summary, methods, out / "speedup.png")


# -- command line ----------------------------------------------------------------------------

HF_METHODS = ("hf-greedy", "hf-pld")
# Named variants: a drafter with some of its options set (they win over the command line's).
VARIANTS: dict[str, tuple[str, dict]] = {
    "redraft-draft-model-int8": ("draft-model", {"draft_model": "int8"}),
    "redraft-draft-model-skip24": ("draft-model", {"draft_model": "skip:24"}),
}


def redraft_methods() -> dict[str, str]:
    """Method name -> drafter names for build_drafter: `redraft-NAME` for every registered
    drafter, plus plain decoding, PLD + retrieval, and the default drafters. Any other
    combination is `redraft-` + names joined by `+` (e.g. `redraft-pld+medusa`)."""
    from redraft.decoder.registry import NONE, REGISTRY, default_drafters

    out = {f"redraft-{NONE}": NONE}
    out.update({f"redraft-{name}": name for name in REGISTRY})
    out["redraft-pld-rest"] = "pld,rest"
    out["redraft-default"] = default_drafters(True)
    out.update({name: drafters for name, (drafters, _) in VARIANTS.items()})
    return out


def method_drafters(method: str) -> str | None:
    """The drafter names of a redraft method, None for an unknown method."""
    known = redraft_methods()
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
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated, from {', '.join([*HF_METHODS, *redraft_methods()])}"
                   ", or redraft-A+B for any combination of drafters")
    rest = p.add_mutually_exclusive_group()
    rest.add_argument("--datastore", metavar="DIR", help="datastore for the rest drafters")
    rest.add_argument("--draft-service", metavar="ADDR", help="draft service for rest drafters")
    p.add_argument("--out", default="bench-out/spec_bench", help="output directory")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--stock-kernels", action="store_true",
                   help="redraft's methods on PyTorch's stock CPU kernels, like Hugging Face's")
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
    from redraft.decoder.generate import Generator
    from redraft.decoder.models import load_model
    from redraft.decoder.registry import build_drafter, options_from_args
    from tqdm import tqdm

    if args.max_new_tokens <= 0:
        raise BenchError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.per_category < 0:
        raise BenchError(f"--per-category must be >= 0, got {args.per_category}")
    names = parse_methods(args.methods, bool(args.datastore or args.draft_service))
    questions = load_questions(args.questions, args.per_category or None)
    if args.threads:
        torch.set_num_threads(args.threads)
    from redraft.decoder.kernels import packed_linears

    model, tokenizer = load_model(args.model)
    methods: list[Method] = []
    drafters = []
    for name in names:
        if name in HF_METHODS:
            methods.append(HFMethod(name, model, tokenizer,
                                    10 if name == "hf-pld" else None))
            continue
        options = {**options_from_args(args), **VARIANTS.get(name, ("", {}))[1]}
        drafter = build_drafter(method_drafters(name), model=model, tokenizer=tokenizer,
                                model_name=args.model or "smollm2-135m",
                                datastore=args.datastore, draft_service=args.draft_service,
                                options=options)
        drafters.append(drafter)
        methods.append(RedraftMethod(name, Generator(
            model, tokenizer, drafter, model_name=args.model or "smollm2-135m",
            packed_kernels=not args.stock_kernels)))
    warm_up(methods)
    total = len(questions) * len(methods)
    try:
        with tqdm(total=total, desc="spec-bench", unit="answer", file=sys.stderr) as bar:
            records = run_bench(questions, methods, model, tokenizer, args.max_new_tokens,
                                progress=bar.update)
    finally:
        for d in drafters:
            if d is not None and hasattr(d, "close"):
                d.close()
    summary = summarize(records)
    meta = {"model": args.model or "smollm2-135m", "questions": len(questions),
            "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
            "methods": names, "datastore": args.datastore, "draft_service": args.draft_service,
            "torch_threads": torch.get_num_threads(), "device": str(model.device),
            # redraft's forwards run on packed oneDNN weights on a CPU; HF's on stock kernels
            "redraft_kernels": "packed" if not args.stock_kernels
            and packed_linears(model) is not None else "stock"}
    out = Path(args.out)
    write_outputs(out, records, summary, names, meta)
    print(markdown_table(summary, names))
    print(f"results in {out}/ (records.jsonl, summary.json, summary.md, speedup.png)")
    return 0
