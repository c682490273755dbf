"""llama-cpp-python with redraft's drafts (`RedraftDraft`) against plain llama-cpp-python and
its own prompt lookup (`LlamaPromptLookupDecoding`), greedy, on Spec-Bench and code prompts.

Every turn runs each method once, in a rotating order (so machine load is shared evenly); each
method answers multi-turn questions from its own earlier answers. Reported per method: whether
every turn's tokens equal plain decoding's, tokens per forward (new tokens / decoding
forwards, the prompt's forward left out), tokens/s (new tokens / wall clock of the turn,
prompt included) and the speed-up over plain. Beside it, llama.cpp's own cost curve: the time
of an n-token forward (the fastest of several interleaved rounds) relative to a 1-token one.

    python -m tools.bench_llama_cpp --questions SPEC_BENCH/question.jsonl --per-category 3 \
        --code-prompts tools/demo_prompts.jsonl --datastore data/default --threads 1

`--service HOST:PORT` drafts from a running `redraft serve` instead of `--datastore`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
from redraft.decoder.bench.llama_cpp_method import greedy_tokens
from redraft.decoder.bench.questions import load_questions
from redraft.decoder.engines.llama_cpp import Llama, RedraftDraft, model_path
from redraft.decoder.text import chat_ids
from redraft.proto.models import load_tokenizer

from tools import harness

SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class Turn:
    key: str  # question id and turn, or code prompt number
    category: str
    method: str
    new_tokens: int
    forwards: int  # decoding forwards (the prompt's excluded)
    seconds: float
    # this process's CPU time for the turn: with one thread it leaves out the time other
    # processes held the core, so it is the steadier clock on a shared machine
    cpu_seconds: float = 0.0
    identical: bool | None = None
    tokens: list[int] = field(default_factory=list)


class Runner:
    """One method: a `llama_cpp.Llama` whose forwards are counted."""

    def __init__(self, name: str, llm, draft=None) -> None:
        self.name, self.llm, self.draft = name, llm, draft
        self.evals = 0
        evaluate = llm.eval

        def counted(tokens):
            self.evals += 1
            return evaluate(tokens)

        llm.eval = counted  # Llama.generate calls self.eval once per forward

    def run(self, prompt: list[int], max_new_tokens: int
            ) -> tuple[list[int], int, float, float]:
        llm = self.llm
        llm.reset()  # every method evaluates the whole prompt, the same way
        self.evals = 0
        t0, c0 = time.perf_counter(), time.process_time()
        out = greedy_tokens(llm, prompt, max_new_tokens)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        return out, max(self.evals - 1, 0), seconds, cpu


def cost_curve(path: str, threads: int, prompt: list[int], rounds: int) -> dict:
    """Milliseconds of an n-token forward after `prompt`, the fastest of `rounds` interleaved
    rounds (wall clock and this process's CPU time), with logits for every row (as drafting
    needs) and, for n=1, for the last row only (as plain decoding runs)."""
    out = {}
    for logits_all in (True, False):
        llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=threads,
                              n_threads_batch=threads, flash_attn=True, logits_all=logits_all,
                              verbose=False)
        llm.eval(prompt)
        base = llm.n_tokens
        sizes = SIZES if logits_all else (1,)
        wall = {n: float("inf") for n in sizes}
        cpu = dict(wall)
        for _ in range(rounds):
            for n in sizes:
                llm.n_tokens = base  # eval drops the cache past n_tokens first
                t0, c0 = time.perf_counter(), time.process_time()
                llm.eval(prompt[:n])
                wall[n] = min(wall[n], time.perf_counter() - t0)
                cpu[n] = min(cpu[n], time.process_time() - c0)
        key = "logits_all" if logits_all else "last_row_only"
        out[key] = {"wall": {str(n): round(wall[n] * 1000, 3) for n in sizes},
                    "cpu": {str(n): round(cpu[n] * 1000, 3) for n in sizes}}
        llm.close()
    for clock in ("wall", "cpu"):
        ms = out["logits_all"][clock]
        out[f"relative_{clock}"] = {n: round(v / ms["1"], 2) for n, v in ms.items()}
    return out


def prompts(args, tokenizer) -> list[tuple[str, str, list[list[str]]]]:
    """(key, category, turns) for every Spec-Bench question and code prompt."""
    out = []
    if args.questions:
        for q in load_questions(args.questions, args.per_category):
            out.append((f"q{q.question_id}", q.category, q.turns))
    if args.code_prompts:
        with open(args.code_prompts, encoding="utf-8") as f:
            for i, line in enumerate(x for x in f if x.strip()):
                out.append((f"code{i}", "code", [json.loads(line)["prompt"]]))
    return out


def summarize(turns: list[Turn], methods: list[str]) -> dict:
    def rate(rs: list[Turn], clock: str) -> float:
        return sum(t.new_tokens for t in rs) / sum(getattr(t, clock) for t in rs)

    plain = [t for t in turns if t.method == "plain"]
    out = {}
    for m in methods:
        rs = [t for t in turns if t.method == m]
        tokens = sum(t.new_tokens for t in rs)
        out[m] = {"turns": len(rs), "identical": all(t.identical is not False for t in rs),
                  "different_turns": [t.key for t in rs if t.identical is False],
                  "new_tokens": tokens,
                  "tokens_per_forward": round(tokens / max(1, sum(t.forwards for t in rs)), 3),
                  "tokens_per_second": round(rate(rs, "seconds"), 2),
                  "speedup": round(rate(rs, "seconds") / rate(plain, "seconds"), 3),
                  "tokens_per_cpu_second": round(rate(rs, "cpu_seconds"), 2),
                  "cpu_speedup": round(rate(rs, "cpu_seconds") / rate(plain, "cpu_seconds"), 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", help="Spec-Bench question.jsonl")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--code-prompts", help="a .jsonl of {\"prompt\": ...} records")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--datastore", help="datastore directory for RedraftDraft (in process)")
    src.add_argument("--service", help="HOST:PORT of `redraft serve` for RedraftDraft")
    ap.add_argument("--model", default=None, help=".gguf file or model name (default model)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--pld-tokens", type=int, default=10,
                    help="LlamaPromptLookupDecoding's num_pred_tokens (its default 10)")
    ap.add_argument("--fixed", action="store_true",
                    help="also run RedraftDraft(adaptive=False): the whole best path every call")
    ap.add_argument("--cost-rounds", type=int, default=20)
    ap.add_argument("--out", default="bench-out/llama_cpp")
    args = ap.parse_args(argv)
    run = harness.Run()
    if not args.questions and not args.code_prompts:
        ap.error("give --questions and/or --code-prompts")

    path = model_path(args.model)
    tokenizer = load_tokenizer(args.model or "smollm2-135m")
    common = dict(n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                  verbose=False, seed=0)
    where = {"datastore": args.datastore} if args.datastore else {"service": args.service}
    runners = [
        Runner("plain", llama_cpp.Llama(model_path=path, flash_attn=True, **common)),
        Runner("llama-pld", llama_cpp.Llama(
            model_path=path, flash_attn=True, logits_all=True, **common,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.pld_tokens))),
    ]
    draft = RedraftDraft(**where)
    runners.append(Runner("redraft", Llama(path, draft_model=draft, **common), draft))
    if args.fixed:
        fixed = RedraftDraft(**where, adaptive=False)
        runners.append(Runner("redraft-fixed", Llama(path, draft_model=fixed, **common), fixed))
    methods = [r.name for r in runners]

    work = prompts(args, tokenizer)
    turns: list[Turn] = []
    histories: dict[tuple[str, str], list[dict]] = {}
    n = 0
    for key, category, qturns in work:
        for ti, text in enumerate(qturns):
            order = runners[n % len(runners):] + runners[: n % len(runners)]
            n += 1
            reference = None
            results = {}
            for r in order:
                messages = histories.get((key, r.name), []) + [{"role": "user", "content": text}]
                ids = chat_ids(tokenizer, messages)
                tokens, forwards, seconds, cpu = r.run(ids, args.max_new_tokens)
                results[r.name] = Turn(f"{key}.{ti}", category, r.name, len(tokens), forwards,
                                       seconds, cpu, tokens=tokens)
                histories[(key, r.name)] = messages + [
                    {"role": "assistant", "content": tokenizer.decode(tokens)}]
            reference = results["plain"].tokens
            for t in results.values():
                t.identical = t.tokens == reference
                turns.append(t)
            line = "  ".join(f"{m} {results[m].new_tokens}/{results[m].forwards} "
                             f"{results[m].seconds:.2f}s {results[m].cpu_seconds:.2f}cpu"
                             f"{'' if results[m].identical else ' DIFF'}" for m in methods)
            print(f"{key}.{ti} [{category}] {line}", flush=True)

    curve_prompt = chat_ids(tokenizer, [{"role": "user", "content": work[0][2][0]}])
    curve_prompt = (curve_prompt * (1 + 256 // len(curve_prompt)))[:256]
    curve = cost_curve(path, args.threads, curve_prompt, args.cost_rounds)
    summary = {"methods": summarize(turns, methods), "cost_curve_ms": curve,
               "redraft_stats": {r.name: r.draft.stats for r in runners if r.draft},
               "settings": {"model": path, "threads": args.threads,
                            "max_new_tokens": args.max_new_tokens, **where,
                            "llama_cpp_python": llama_cpp.__version__,
                            "per_category": args.per_category, "turns": len(turns)
                            // len(methods)}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run.write(out / "summary.json", summary)
    with open(out / "turns.jsonl", "w") as f:
        for t in turns:
            f.write(json.dumps(asdict(t)) + "\n")
    print(json.dumps(summary, indent=1))
    for r in runners:
        if r.draft is not None:
            r.draft.close()
    return 0 if all(v["identical"] for v in summary["methods"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
