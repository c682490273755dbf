"""Benchmark of the compiled drafting core against the Python session drafter (the reference):
the time of a session step, one sequence at a time and 64 at once, and whether the trees are
identical.

Sessions replay held-out code (this project's own sources, which are not in the standard-library
datastore) as a decoder would: a 128-token prompt, then 1-4 accepted tokens per step. Learning
is on as `redraft serve` has it (every sequence's accepted tokens are learned at once and
drafted back), bounded by --learn-max-tokens.

    python -m tools.bench_drafting_core --datastore data/stdlib

Phase 1 steps one sequence at a time through both drafters in lockstep (Draft objects out,
as the Python path returns them) and compares every tree. Phase 2 steps --batch sequences in
one call (`step_batch` on --threads threads, flat arrays out: every sequence is extended,
then all draft) and compares each of its trees with the reference's after the same steps.
Times are wall-clock, in this process, without gRPC; the CPU time of the drafting thread is
given beside them (on a shared machine the wall clock also counts the time other processes
held the CPU).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

from redraft.datastore import Reader
from redraft.datastore.drafting import (
    SOURCES,
    DraftSettings,
    LearnedIndex,
    SessionDrafter,
    step_batch,
)
from redraft.datastore.drafting.native import NativeLearnedIndex, NativeSessionDrafter
from redraft.datastore.drafting.session_drafter import DEFAULT_PARAMS

from tools import harness
from tools.bench_service import held_out_tokens, pct

ROOT = str(harness.ROOT)


def same(a, b) -> bool:
    """Node for node, probabilities to the bit, and the match lengths."""
    return (a.tokens == b.tokens and a.parents == b.parents and a.probs == b.probs
            and a.sources == b.sources and a.match_len == b.match_len)


class Sequence:
    """One replayed generation through both drafters (the reference's made on demand)."""

    def __init__(self, rng: random.Random, docs: list[list[int]], settings: DraftSettings,
                 reader, learned: tuple, with_ref: bool = True) -> None:
        self.rng = rng
        self.doc = doc = docs[rng.randrange(len(docs))]
        start = rng.randrange(0, len(doc) - 300)
        self.pos = start + 128
        self.prompt = doc[start:self.pos]
        self.args = (settings, reader, learned[0])
        self.ref = SessionDrafter(self.prompt, *self.args) if with_ref else None
        self.native = NativeSessionDrafter(self.prompt, settings, reader, learned[1])

    def open_ref(self) -> SessionDrafter:
        self.ref = SessionDrafter(self.prompt, *self.args)
        return self.ref

    def done(self) -> bool:
        return self.pos >= len(self.doc) - 4

    def accepted(self) -> list[int]:
        k = self.rng.choice((1, 1, 2, 2, 3, 4))
        out = self.doc[self.pos:self.pos + k]
        self.pos += k
        return out

    def close(self) -> None:
        self.native.close()
        if self.ref is not None:
            self.ref.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datastore", default=os.path.join(ROOT, "data", "stdlib"))
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3000, help="steps of the one-at-a-time phase")
    ap.add_argument("--batch", type=int, default=64, help="sequences per batched step")
    ap.add_argument("--batch-steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1, help="threads of the batched step")
    ap.add_argument("--learn-max-tokens", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    run = harness.Run()

    reader = Reader(args.datastore)
    docs = held_out_tokens(reader.tokenizer_name)
    settings = DraftSettings(DEFAULT_PARAMS.replace(budget=args.budget, max_depth=args.depth,
                                                    sources=frozenset(SOURCES)))
    learned = (LearnedIndex(args.learn_max_tokens), NativeLearnedIndex(args.learn_max_tokens))
    rng = random.Random(args.seed)
    gc.collect()
    gc.freeze()  # the loaded documents are not the drafters' garbage
    checked = mismatches = 0

    # ---- phase 1: one sequence at a time, both drafters in lockstep -----------------------
    ref_us: list[float] = []
    native_us: list[float] = []
    native_cpu_us: list[float] = []
    nodes = 0
    seq = Sequence(rng, docs, settings, reader, learned)
    for step in range(args.steps + 200):  # the first 200 warm up
        if seq.done():
            seq.close()
            seq = Sequence(rng, docs, settings, reader, learned)
        accepted = seq.accepted()
        t0 = time.perf_counter()
        seq.ref.extend(accepted)
        want = seq.ref.propose()
        t1 = time.perf_counter()
        c1 = time.thread_time()
        got = seq.native.step(accepted)
        c2 = time.thread_time()
        t2 = time.perf_counter()
        checked += 1
        mismatches += not same(want, got)
        if step >= 200:
            ref_us.append((t1 - t0) * 1e6)
            native_us.append((t2 - t1) * 1e6)
            native_cpu_us.append((c2 - c1) * 1e6)
            nodes += len(got)
    seq.close()

    # ---- phase 2: --batch sequences per call (compared with the reference afterwards, so
    # that its steps do not run between the timed calls) ---------------------------------------
    seqs = [Sequence(rng, docs, settings, reader, learned, False) for _ in range(args.batch)]
    batch_ms: list[float] = []
    batch_cpu_ms: list[float] = []
    log = []  # per step: the sequences (opened anew where one ended), accepted tokens, trees
    for step in range(args.batch_steps + 20):
        for i, s in enumerate(seqs):
            if s.done():
                s.native.close()
                seqs[i] = Sequence(rng, docs, settings, reader, learned, False)
        accepted = [s.accepted() for s in seqs]
        drafters = [s.native for s in seqs]
        t0 = time.perf_counter()
        c0 = time.thread_time()
        out = step_batch(drafters, accepted, threads=args.threads)
        c1 = time.thread_time()
        t1 = time.perf_counter()
        if step >= 20:
            batch_ms.append((t1 - t0) * 1e3)
            batch_cpu_ms.append((c1 - c0) * 1e3)
        log.append((list(seqs), accepted, out))  # its trees are made into Drafts later
    for s in seqs:
        s.native.close()
    refs: dict[int, SessionDrafter] = {}
    for step_seqs, accepted, out in log:  # the same steps: every sequence learns, all draft
        for i, s in enumerate(step_seqs):
            ref = refs.get(i)
            if ref is None or ref is not s.ref:
                if ref is not None:
                    ref.close()
                refs[i] = ref = s.open_ref()
            ref.extend(accepted[i])
        for i in range(len(step_seqs)):
            checked += 1
            mismatches += i in out.errors or not same(refs[i].propose(), out.tree(i))
    for ref in refs.values():
        ref.close()

    report = {
        "datastore_tokens": reader.n_tokens, "budget": args.budget, "depth": args.depth,
        "learn_max_tokens": args.learn_max_tokens,
        "one_sequence": {
            "steps": len(native_us), "mean_nodes": nodes / max(1, len(native_us)),
            "python_p50_us": statistics.median(ref_us), "python_p99_us": pct(ref_us, 0.99),
            "native_p50_us": statistics.median(native_us), "native_p99_us": pct(native_us, 0.99),
            "native_cpu_p50_us": statistics.median(native_cpu_us),
            "native_cpu_p99_us": pct(native_cpu_us, 0.99),
            "speedup_p50": statistics.median(ref_us) / statistics.median(native_us),
        },
        "batch": {
            "sequences": args.batch, "threads": args.threads, "steps": len(batch_ms),
            "batch_step_p50_ms": statistics.median(batch_ms),
            "batch_step_p99_ms": pct(batch_ms, 0.99),
            "per_sequence_p50_us": statistics.median(batch_ms) * 1e3 / args.batch,
            "batch_step_cpu_p50_ms": statistics.median(batch_cpu_ms),
            "batch_step_cpu_p99_ms": pct(batch_cpu_ms, 0.99),
        },
        "trees_checked": checked, "trees_different": mismatches,
    }
    reader.close()
    if args.json:
        run.print(report)
    else:
        o, b = report["one_sequence"], report["batch"]
        rec = run.record()
        print(f"datastore {report['datastore_tokens']:,} tokens, budget {args.budget}, depth "
              f"{args.depth}, learning bound {args.learn_max_tokens:,} tokens; load average "
              f"{rec['load_average'][0]} before, {rec['load_average_end'][0]} after")
        print(f"one sequence: {o['steps']} steps, {o['mean_nodes']:.1f} nodes/tree; Python p50 "
              f"{o['python_p50_us']:.0f} us, p99 {o['python_p99_us']:.0f} us; native p50 "
              f"{o['native_p50_us']:.1f} us, p99 {o['native_p99_us']:.1f} us "
              f"({o['speedup_p50']:.0f}x; CPU p50 {o['native_cpu_p50_us']:.1f} us, p99 "
              f"{o['native_cpu_p99_us']:.1f} us)")
        print(f"{b['sequences']} sequences per call: {b['steps']} steps, p50 "
              f"{b['batch_step_p50_ms']:.3f} ms, p99 {b['batch_step_p99_ms']:.3f} ms, "
              f"{b['per_sequence_p50_us']:.1f} us per sequence (CPU p50 "
              f"{b['batch_step_cpu_p50_ms']:.3f} ms, p99 {b['batch_step_cpu_p99_ms']:.3f} ms)")
        print(f"trees compared with the Python drafter: {checked}, different: {mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
