"""What vLLM's custom proposer `RedraftProposer` adds to every engine step, at an engine's batch.

The proposer is driven as vLLM's GPU model runner drives a custom proposer (the calls the
adapter's tests mimic, tests/decoder/engines/test_vllm.py): a persistent batch laid out as
vLLM's InputBatch (int32 `token_ids_cpu` of shape (max_num_reqs, max_model_len) and
`num_tokens_no_spec`, changed in place), one `propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=None)` per step for every row. Each row replays held-out code
(this repository's own sources, which the datastore never saw) as greedy verification would:
the tokens a row accepts at a step are the longest prefix of its chain that matches its text,
plus the one token the target adds. A row that has produced `--new-tokens` leaves (the last
row moves into its hole, as vLLM's `condense` does) and a new document joins at the end.
The draft service is a real `redraft serve` on loopback.

Reported per batch size: `propose` p50/p99 in ms per engine step (the whole adapter: matching
rows to sequences, the batched call, the chains), per row in us, the server's own time per
sequence-step (its Stats), accepted tokens per row and step, Batch calls seen by the server,
and the steps that fell back to prompt lookup.

    python -m tools.bench_vllm_proposer --datastore data/stdlib --batch 1,8,64 --steps 300
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from types import SimpleNamespace

import numpy as np

from tools import harness
from tools.bench_batch_replay import pct
from tools.bench_service import held_out_tokens, start_server

PROMPT_TOKENS = 128
MAX_MODEL_LEN = 4096


class ReplayBatch:
    """vLLM's persistent batch (the part a custom proposer sees), each row replaying a text."""

    def __init__(self, docs: list[list[int]], n: int, new_tokens: int, seed: int) -> None:
        self.docs, self.new_tokens = docs, new_tokens
        self.rng = random.Random(seed)
        self.token_ids_cpu = np.zeros((n, MAX_MODEL_LEN), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(n, dtype=np.int32)
        self.rows: list[list] = []  # [text, tokens made] per row, in row order
        for _ in range(n):
            self._add()

    def _add(self) -> None:
        doc = self.docs[self.rng.randrange(len(self.docs))]
        start = self.rng.randrange(0, len(doc) - PROMPT_TOKENS - self.new_tokens)
        text = doc[start:start + PROMPT_TOKENS + self.new_tokens]
        i = len(self.rows)
        self.token_ids_cpu[i, :PROMPT_TOKENS] = text[:PROMPT_TOKENS]
        self.num_tokens_no_spec[i] = PROMPT_TOKENS
        self.rows.append([text, PROMPT_TOKENS])

    def book(self, drafts: list[list[int]] | None) -> tuple[list[list[int]], int]:
        """This step's sampled tokens per row, written into the batch as vLLM's bookkeeping
        does (the matched prefix of each row's chain plus one token); rows that are done
        leave and new ones join first. Returns (sampled lists, drafted tokens accepted)."""
        done = [i for i, (text, made) in enumerate(self.rows) if made >= len(text)]
        for i in reversed(done):  # condense: the last row moves into the hole
            last = len(self.rows) - 1
            if i != last:
                n = int(self.num_tokens_no_spec[last])
                self.token_ids_cpu[i, :n] = self.token_ids_cpu[last, :n]
                self.num_tokens_no_spec[i] = n
                self.rows[i] = self.rows[last]
                if drafts is not None:
                    drafts[i] = drafts[last]
            self.rows.pop()
            if drafts is not None:
                drafts.pop()
        while len(self.rows) < len(self.num_tokens_no_spec):
            self._add()
        sampled, accepted = [], 0
        for i, (text, made) in enumerate(self.rows):
            chain = drafts[i] if drafts is not None and i < len(drafts) else []
            a = 0
            while a < len(chain) and made + a < len(text) and chain[a] == text[made + a]:
                a += 1
            tokens = text[made:made + a + 1]
            self.token_ids_cpu[i, made:made + len(tokens)] = tokens
            self.num_tokens_no_spec[i] = made + len(tokens)
            self.rows[i][1] = made + len(tokens)
            sampled.append(tokens)
            accepted += a
        return sampled, accepted


def run_batch(address: str, docs: list[list[int]], n: int, args) -> dict:
    from redraft.datastore.service.client import DraftClient
    from redraft.decoder.engines.vllm import RedraftProposer

    os.environ["REDRAFT_SERVICE"] = address
    os.environ["REDRAFT_LEARN"] = "1" if args.learn != "off" else "0"
    spec = SimpleNamespace(method="custom_class", num_speculative_tokens=args.k,
                           model="redraft.decoder.engines.vllm.RedraftProposer")
    config = SimpleNamespace(speculative_config=spec, additional_config={},
                             model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN))
    proposer = RedraftProposer(config)
    proposer.load_model(None)
    batch = ReplayBatch(docs, n, args.new_tokens, seed=n)
    with DraftClient(address, timeout=10) as client:
        before = client.stats()
        times, rows_made, accepted, drafts = [], 0, 0, None
        for step in range(args.warmup + args.steps):
            sampled, a = batch.book(drafts)
            t0 = time.perf_counter()
            drafts = proposer.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu,
                                      slot_mappings=None)
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times.append(dt)
                rows_made += sum(len(s) for s in sampled)
                accepted += a
        after = client.stats()
    proposer.close()
    steps = len(times)
    return {
        "batch": n, "steps": steps, "k": args.k,
        "propose_p50_ms": round(pct(times, 0.5) * 1e3, 3),
        "propose_p99_ms": round(pct(times, 0.99) * 1e3, 3),
        "per_row_p50_us": round(pct(times, 0.5) * 1e6 / n, 1),
        "server_per_sequence_p50_us": round(after.get("latency_p50_us", 0.0), 1),
        "tokens_per_row_step": round(rows_made / (steps * n), 3),
        "accepted_drafts_per_row_step": round(accepted / (steps * n), 3),
        "server_batch_calls": after.get("batch_calls", 0) - before.get("batch_calls", 0),
        "fallback_steps": proposer.drafts.local_steps,
        "errors": proposer.stats["errors"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datastore", default=os.path.join("data", "stdlib"))
    ap.add_argument("--batch", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=300, help="timed engine steps per size")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens a row produces")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--learn", choices=("tenant", "global", "off"), default="off")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.batch.split(",") if s.strip()]
    server_args = SimpleNamespace(datastore=args.datastore, workers=1, budget=args.budget,
                                  learn_max_tokens=100_000, serve_arg=None)
    run = harness.Run()
    results, docs = [], None
    for n in sizes:  # a fresh server per size: its Stats are this size's alone
        with contextlib.ExitStack() as stack:
            # finished rows' sequences are held for a few steps after they leave: room for them
            _, address = start_server(stack, server_args, args.learn, "--max-sessions",
                                      str(2 * n + 16))
            if docs is None:
                from redraft.datastore.service.client import DraftClient

                with DraftClient(address, timeout=10) as client:
                    info = client.info()
                docs = [d for d in held_out_tokens(info.tokenizer_name)
                        if len(d) > PROMPT_TOKENS + args.new_tokens + 1]
            results.append(run_batch(address, docs, n, args))
    report = {"datastore": args.datastore, "learn": args.learn, "results": results}
    if args.json:
        run.print(report, indent=1)
    else:
        keys = list(results[0])
        print("| " + " | ".join(keys) + " |")
        print("|" + " --- |" * len(keys))
        for r in results:
            print("| " + " | ".join(str(r[k]) for k in keys) + " |")
        print(json.dumps(run.record()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
