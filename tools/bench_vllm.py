"""vLLM side by side: plain, vLLM's `ngram` and `suffix` and redraft's `RedraftProposer`.

Run under vLLM's Python (`make vllm-env`), with a `redraft serve` for redraft's drafts:

    .venv/bin/redraft serve --datastore data/stdlib --port 50051 &
    LD_PRELOAD=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}') \\
    .venv-vllm/bin/python -m tools.bench_vllm --service 127.0.0.1:50051 \\
        --questions SPEC_BENCH --workload spec-bench,agent,repeated --concurrency 1,4,16 \\
        --out bench-out/vllm

Every method is one engine, all alive at once; each round runs every (workload, concurrency,
method) triple in a rotated order, so the methods share the machine's state. Workloads:

- `spec-bench`: first turns of Spec-Bench questions (categories interleaved), fresh ones at
  every round and concurrency (no method has seen them; redraft drafts from its datastore);
- `agent`: tasks of `agent_workload.py` (a long shared tool preamble, JSON tool calls, tool
  results fed back), `--turns` turns each, every turn's prompt holding the earlier turns
  (the model's own outputs included); fresh tasks at every round and concurrency;
- `repeated`: the same Spec-Bench prompts at every round and concurrency (served before:
  learned drafts after the first pass).

Not run unless asked for: `no-drafts`, a proposer that never drafts (the engine's own cost of
speculating, under every method's speed), and `redraft-local`, redraft drafting from
`--datastore` opened in the engine's own process (no service, no round trip per step).

A pass at concurrency c serves `--batches` groups of c requests at once (two at c = 1). The
method `redraft-peer` is a second redraft engine on the same service that always runs right
after `redraft`, on the prompts `redraft` just served: it must draft what the first engine
learned, and the bench exits 1 (after writing its tables) if it accepted no learned draft.

Reported per workload, concurrency and method: output tokens per second (median over
rounds), its ratio to plain vLLM and to `ngram` in the same rounds, draft acceptance (drafted
tokens accepted) and per position (the share of drafted steps whose i-th draft was accepted),
rows drafted per engine step, output tokens per engine step (what drafting bought per
forward, whatever a forward cost), the engine's mean step time (and for redraft the part of
it spent in `propose`), and whether every output of every round was plain vLLM's greedy
output token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools import agent_workload, harness

METHODS = ("plain", "no-drafts", "ngram", "suffix", "redraft", "redraft-peer", "redraft-local")
OPT_IN = ("no-drafts", "redraft-local")  # run only when --methods names them
WORKLOADS = ("spec-bench", "agent", "repeated")
KV_CACHE_BYTES = 3 << 29  # 1.5 GiB per engine: five engines fit beside other jobs


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
    if method in ("redraft", "redraft-peer", "redraft-local"):
        return {"method": "custom_class", "num_speculative_tokens": k,
                "model": "redraft.decoder.engines.vllm.RedraftProposer"}
    if method == "no-drafts":
        return {"method": "custom_class", "num_speculative_tokens": k,
                "model": "tools.bench_vllm.NoDrafts"}
    raise SystemExit(f"bench_vllm: unknown method {method!r} (known: {', '.join(METHODS)})")


class NoDrafts:
    """A custom proposer that never drafts (`no-drafts`): what the engine's speculative path
    costs by itself, the floor under any proposer's speed."""

    def __init__(self, vllm_config) -> None:
        pass

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


@dataclass
class StepCounts:
    """What one engine's scheduler reported, step by step (vLLM's own stats)."""

    steps: int = 0
    drafts: int = 0  # request-steps that had drafts
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def copy(self) -> StepCounts:
        return StepCounts(self.steps, self.drafts, self.draft_tokens, self.accepted,
                          list(self.per_pos))

    def minus(self, before: StepCounts) -> StepCounts:
        pos = [a - (before.per_pos[i] if i < len(before.per_pos) else 0)
               for i, a in enumerate(self.per_pos)]
        return StepCounts(self.steps - before.steps, self.drafts - before.drafts,
                          self.draft_tokens - before.draft_tokens,
                          self.accepted - before.accepted, pos)


def counting_engines() -> dict:
    """Make every `LLM` built next record its scheduler's stats into `slot["counts"]`."""
    from vllm.entrypoints import llm as llm_module
    from vllm.v1.metrics.loggers import StatLoggerBase

    slot: dict = {"counts": None}

    def logger_for(counts: StepCounts) -> type:
        class Counter(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is None:
                    return
                counts.steps += 1
                spec = scheduler_stats.spec_decoding_stats
                if spec is not None:
                    counts.drafts += spec.num_drafts
                    counts.draft_tokens += spec.num_draft_tokens
                    counts.accepted += spec.num_accepted_tokens
                    for i, n in enumerate(spec.num_accepted_tokens_per_pos):
                        if i >= len(counts.per_pos):
                            counts.per_pos.append(0)
                        counts.per_pos[i] += n

            def log_engine_initialized(self) -> None:
                pass

        return Counter

    engine_class = llm_module.LLMEngine
    original = engine_class.from_engine_args.__func__

    def from_engine_args(cls, engine_args, *args, **kwargs):
        kwargs["stat_loggers"] = [*(kwargs.get("stat_loggers") or []),
                                  logger_for(slot["counts"])]
        return original(cls, engine_args, *args, **kwargs)

    engine_class.from_engine_args = classmethod(from_engine_args)
    return slot


def spec_bench_prompts(path: str) -> list[str]:
    """First turns of Spec-Bench's questions, categories interleaved (any slice is mixed)."""
    by_cat: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        q = json.loads(line)
        by_cat.setdefault(q.get("category", ""), []).append(q["turns"][0])
    out, i = [], 0
    while any(i < len(v) for v in by_cat.values()):
        out += [v[i] for v in by_cat.values() if i < len(v)]
        i += 1
    return out


@dataclass
class Pass:
    """The requests one method serves at one (workload, round, concurrency)."""

    workload: str
    concurrency: int
    jobs: list  # question strings, or agent_workload.Task
    turns: int = 1


def plan(workload: str, r: int, level: int, c: int, n: int, stride: int, levels: int,
         questions: list[str], turns: int, seed: int) -> Pass:
    """The pass's requests; fresh ones (`stride` apart: the most a pass takes) at every
    (round, concurrency) but for `repeated`, whose prompts are the first slice."""
    if workload == "repeated":
        return Pass(workload, c, questions[:n])
    if workload == "spec-bench":
        at = (1 + r * levels + level) * stride
        if at + n > len(questions):
            raise SystemExit(f"bench_vllm: Spec-Bench has {len(questions)} prompts, too few "
                             f"for fresh ones at every pass")
        return Pass(workload, c, questions[at:at + n])
    return Pass(workload, c, agent_workload.tasks(seed + 1000 * r + level, n), turns)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".venv-vllm/models/smollm2-135m")
    p.add_argument("--service", help="HOST:PORT of redraft serve (for the redraft methods)")
    p.add_argument("--datastore", help="the datastore redraft-local opens in the engine")
    p.add_argument("--questions", required=True, help="Spec-Bench's question.jsonl")
    p.add_argument("--workload", default=",".join(WORKLOADS),
                   help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--batches", type=int, default=1,
                   help="groups of c requests per pass (at least two at c = 1)")
    p.add_argument("--turns", type=int, default=2, help="turns per agent task")
    p.add_argument("--seed", type=int, default=0, help="the agent tasks' seed")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--methods", default=",".join(m for m in METHODS if m not in OPT_IN),
                   help=f"comma-separated: {', '.join(METHODS)}")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="bench-out/vllm")
    args = p.parse_args()
    run = harness.Run()
    methods = args.methods.split(",")
    workloads = args.workload.split(",")
    for name in methods:
        speculative_config(name, args.k)
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"bench_vllm: unknown workload {w!r} (known: "
                             f"{', '.join(WORKLOADS)})")
    if "redraft-peer" in methods and "redraft" not in methods:
        raise SystemExit("bench_vllm: redraft-peer runs after redraft: add redraft")
    if any(m in ("redraft", "redraft-peer") for m in methods) and not args.service:
        raise SystemExit("bench_vllm: --service is required for redraft and redraft-peer")
    if "redraft-local" in methods and not args.datastore:
        raise SystemExit("bench_vllm: --datastore is required for redraft-local")
    if args.service:
        os.environ["REDRAFT_SERVICE"] = args.service
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the proposer's counters
    from vllm import LLM, SamplingParams  # vLLM's environment only

    slot = counting_engines()
    engines, counts = {}, {}
    for m in methods:
        counts[m] = slot["counts"] = StepCounts()
        engines[m] = LLM(model=args.model, dtype="float32", max_model_len=4096,
                         enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES, seed=0,
                         disable_log_stats=False,
                         speculative_config=speculative_config(m, args.k),
                         # "service": "" overrides the REDRAFT_SERVICE the other engines use
                         **({"additional_config": {"redraft": {
                             "service": "", "datastore": args.datastore}}}
                            if m == "redraft-local" else {}))
    tokenizer = engines[methods[0]].get_tokenizer()

    def encode(chat: list[dict]) -> dict:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    questions = spec_bench_prompts(args.questions)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[tuple, dict] = {}  # (workload, c, method, round) -> measures
    served: dict[tuple, list[list[int]]] = {}

    def serve(m: str, ps: Pass) -> tuple[list[list[int]], float, int]:
        llm, ids, made = engines[m], [], 0
        start = time.perf_counter()
        for i in range(0, len(ps.jobs), ps.concurrency):  # c requests in flight at once
            group = ps.jobs[i:i + ps.concurrency]
            outputs: list[list[str]] = [[] for _ in group]
            for _ in range(ps.turns):
                if ps.workload == "agent":
                    chats = [agent_workload.messages(t, o) for t, o in zip(group, outputs)]
                else:
                    chats = [[{"role": "user", "content": q}] for q in group]
                got = llm.generate([encode(c) for c in chats], params, use_tqdm=False)
                for o, g in zip(outputs, got):
                    o.append(g.outputs[0].text)
                    ids.append(list(g.outputs[0].token_ids))
                    made += len(g.outputs[0].token_ids)
        return ids, time.perf_counter() - start, made

    for r in range(args.rounds):
        for w in workloads:
            for level, c in enumerate(levels):
                n = c * args.batches if c > 1 else max(2, args.batches)
                stride = max(max(levels) * args.batches, 2)
                ps = plan(w, r, level, c, n, stride, len(levels), questions, args.turns,
                          args.seed)
                base = [m for m in methods if m != "redraft-peer"]
                order = base[r % len(base):] + base[:r % len(base)]
                if "redraft-peer" in methods:
                    order.insert(order.index("redraft") + 1, "redraft-peer")
                for m in order:
                    before = counts[m].copy()
                    totals_before = proposer_totals(engines[m]) if m.startswith("redraft") \
                        else None
                    ids, seconds, made = serve(m, ps)
                    step = counts[m].minus(before)
                    res = {"rate": made / seconds, "seconds": seconds, "made": made,
                           "counts": step}
                    if totals_before is not None:
                        totals = proposer_totals(engines[m]).minus(totals_before)
                        res["propose_s"], res["propose_steps"] = totals.seconds, totals.steps
                        if m == "redraft-peer":
                            res["learned"] = totals.learned_accepted
                    results[(w, c, m, r)] = res
                    served[(w, c, m, r)] = ids
                    print(f"round {r} {w} concurrency {c} {m}: {res['rate']:.1f} tokens/s, "
                          f"acceptance {acceptance(step)}, step {step_ms(res)} ms"
                          + (f", learned drafts accepted {res['learned']}"
                             if "learned" in res else ""), flush=True)
    summary, failures = report(args, methods, workloads, levels, results, served)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary += run_line(run.record())
    (out / "summary.md").write_text(summary)
    rows = [{"workload": w, "concurrency": c, "method": m, "round": r,
             "tokens_per_s": v["rate"], "seconds": v["seconds"], "steps": v["counts"].steps,
             "drafts": v["counts"].drafts, "draft_tokens": v["counts"].draft_tokens,
             "accepted": v["counts"].accepted, "accepted_per_pos": v["counts"].per_pos,
             "made": v["made"], "learned_accepted": v.get("learned"),
             "propose_seconds": v.get("propose_s"), "propose_steps": v.get("propose_steps")}
            for (w, c, m, r), v in results.items()]
    run.write(out / "results.json", rows)
    print(summary)
    for line in failures:
        print(f"bench_vllm: FAILED: {line}", file=sys.stderr)
    if failures:
        raise SystemExit(1)


def run_line(record: dict) -> str:
    """The run's record (`harness.Run`) as the summary's last line."""
    changed = " (tracked files changed)" if record["dirty"] else ""
    start = " ".join(map(str, record["load_average"]))
    return (f"\nCommit {record['commit']}{changed}, {record['cores_usable']} cores, load "
            f"average {start} at the start; `{record['command']}`\n")


def proposer_counters(worker) -> dict | None:
    """Run in vLLM's worker (collective_rpc): the RedraftProposer's counters."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    stats = getattr(drafter, "stats", None)
    return dict(stats) if isinstance(stats, dict) else None


@dataclass
class ProposerTotals:
    """RedraftProposer's counters summed over the engine's workers, so far."""

    seconds: float = 0.0  # spent in `propose`
    steps: int = 0  # engine steps it was called on
    learned_accepted: int = 0  # drafted tokens from learned outputs the engine accepted

    def minus(self, before: ProposerTotals) -> ProposerTotals:
        return ProposerTotals(self.seconds - before.seconds, self.steps - before.steps,
                              self.learned_accepted - before.learned_accepted)


def proposer_totals(llm) -> ProposerTotals:
    totals = ProposerTotals()
    for stats in llm.collective_rpc(proposer_counters):
        stats = stats or {}
        totals.seconds += stats.get("seconds", 0.0)
        totals.steps += stats.get("steps", 0)
        for source, n in (stats.get("accepted_by_source") or {}).items():
            if "learned" in source.split("+"):
                totals.learned_accepted += n
    return totals


def acceptance(c: StepCounts) -> str:
    return f"{c.accepted / c.draft_tokens:.0%}" if c.draft_tokens else "-"


def step_ms(res: dict) -> str:
    steps = res["counts"].steps
    return f"{res['seconds'] * 1e3 / steps:.1f}" if steps else "-"


def proposing_ms(passes: list[dict]) -> str:
    """redraft's time in `propose` per engine step over `passes` (other methods: not known)."""
    steps = sum(p.get("propose_steps", 0) for p in passes)
    return f"{sum(p['propose_s'] for p in passes) * 1e3 / steps:.1f}" if steps else "-"


def report(args, methods, workloads, levels, results, served) -> tuple[str, list[str]]:
    rounds = range(args.rounds)
    parts, failures = [], []
    for w in workloads:
        rows = [f"### {w}", "",
                "| concurrency | method | tokens/s (median) | vs plain | vs ngram | acceptance "
                "| accepted per position | rows drafted per step | tokens per step | step ms "
                "| of it proposing | identical to plain |",
                "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
        for c in levels:
            med = {m: statistics.median(results[(w, c, m, r)]["rate"] for r in rounds)
                   for m in methods}
            for m in methods:
                total = StepCounts()
                for r in rounds:
                    total = add(total, results[(w, c, m, r)]["counts"])
                seconds = sum(results[(w, c, m, r)]["seconds"] for r in rounds)
                vs = [f"{med[m] / med[b]:.2f}x" if b in med else "-" for b in ("plain", "ngram")]
                pos = (" / ".join(f"{n / total.drafts:.2f}" for n in total.per_pos)
                       if total.drafts else "-")
                same = ("yes" if all(served[(w, c, m, r)] == served[(w, c, "plain", r)]
                                     for r in rounds) else "**no**") if "plain" in med else "-"
                if same == "**no**":
                    failures.append(f"{w} concurrency {c} {m}: output differs from plain")
                step = f"{seconds * 1e3 / total.steps:.1f}" if total.steps else "-"
                proposing = proposing_ms([results[(w, c, m, r)] for r in rounds])
                made = sum(results[(w, c, m, r)]["made"] for r in rounds)
                # what drafting bought per forward, whatever a forward cost
                share = f"{total.drafts / total.steps:.2f}" if total.steps else "-"
                per_step = f"{made / total.steps:.2f}" if total.steps else "-"
                rows.append(f"| {c} | {m} | {med[m]:.1f} | {vs[0]} | {vs[1]} | "
                            f"{acceptance(total)} | {pos} | {share} | {per_step} | {step} | "
                            f"{proposing} | {same} |")
            if "redraft-peer" in methods:
                learned = sum(results[(w, c, "redraft-peer", r)]["learned"] for r in rounds)
                if not learned:
                    failures.append(f"{w} concurrency {c}: redraft-peer accepted no draft "
                                    f"learned from redraft's outputs")
        parts.append("\n".join(rows))
    load = os.getloadavg()
    n_note = (f"{args.batches} group(s) of c requests per pass (2 at c = 1), {args.turns} turns "
              f"per agent task, {args.max_tokens} new tokens at most, k={args.k}, "
              f"{args.rounds} rounds; load average at the end "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return "\n\n".join(parts) + f"\n\n{n_note}\n", failures


def add(a: StepCounts, b: StepCounts) -> StepCounts:
    pos = [(a.per_pos[i] if i < len(a.per_pos) else 0) + (b.per_pos[i] if i < len(b.per_pos)
                                                            else 0)
           for i in range(max(len(a.per_pos), len(b.per_pos)))]
    return StepCounts(a.steps + b.steps, a.drafts + b.drafts, a.draft_tokens + b.draft_tokens,
                      a.accepted + b.accepted, pos)


if __name__ == "__main__":  # vLLM starts its engine cores with spawn
    main()
