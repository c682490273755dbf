"""Benchmark of the Python around the compiled core in a batched call, in-process (no gRPC,
no second process): the server's `BatchDrafting.run` against the core's step it calls
(`step_flat`), and the client's building of the request and reading of the reply.

    python -m tools.bench_batch_server --datastore data/stdlib --batch 64

Each call carries --batch sequences replaying held-out code (this project's own sources): a
128-token prompt, then 1-4 accepted tokens per step; a finished document opens a new
sequence in its place. Opens go as entries, steps packed (`--entries`: every step an entry of
its own, the older form). The request and the reply go through their wire bytes, as over gRPC.
Times are the medians of wall-clock times in this process (learning on, journaled, as
`redraft serve` has it); on a shared machine they also count the time others held the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import sys
import time

import redraft.datastore.service.batch_rpc as batch_rpc
from redraft.datastore import Reader
from redraft.datastore.service.config import ServiceConfig
from redraft.datastore.service.handlers import DrafterService
from redraft.datastore.service.stats import ServiceStats
from redraft.datastore.service.wire import (
    DraftParams,
    PackedSteps,
    SequenceOpen,
    SequenceStep,
    add_entry,
    batch_results,
)
from redraft.proto import draft_pb2

from tools import harness
from tools.bench_service import held_out_tokens

ROOT = str(harness.ROOT)
PROMPT_TOKENS = 128


async def measure(service: DrafterService, docs: list[list[int]], n: int, steps: int,
                  params: DraftParams, seed: int, packed: bool = True) -> dict:
    rng = random.Random(seed)
    cursors: list[list] = [[] for _ in range(n)]  # [document, position] per sequence
    fp = service.checks.fingerprint

    def opening(i: int) -> SequenceOpen:
        doc = docs[rng.randrange(len(docs))]
        start = rng.randrange(0, len(doc) - 300)
        cursors[i] = [doc, start + PROMPT_TOKENS]
        return SequenceOpen(str(i), doc[start:start + PROMPT_TOKENS], params)

    core: list[float] = []
    step_flat = batch_rpc.step_flat

    def timed_step_flat(*args):
        t = time.perf_counter()
        out = step_flat(*args)
        core.append(time.perf_counter() - t)
        return out

    batch_rpc.step_flat = timed_step_flat
    run: list[float] = []
    pack: list[float] = []
    parse: list[float] = []
    entries = [opening(i) for i in range(n)]
    try:
        for _ in range(steps):
            t = time.perf_counter()
            req = draft_pb2.BatchRequest(client="bench", tokenizer_fingerprint=fp)
            packing = None
            if packed:
                stepping = [e for e in entries if e.__class__ is SequenceStep]
                entries = [e for e in entries if e.__class__ is not SequenceStep]
                packing = PackedSteps([e.sequence for e in stepping],
                                      [e.accepted for e in stepping])
                packing.to_proto(req.steps)
            for e in entries:
                add_entry(req.entries.add, e)
            wire = req.SerializeToString()
            pack.append(time.perf_counter() - t)
            req = draft_pb2.BatchRequest.FromString(wire)
            t = time.perf_counter()
            reply = await service.batch_rpc.run(req, "")
            run.append(time.perf_counter() - t)
            wire = reply.SerializeToString()
            t = time.perf_counter()
            results = batch_results(draft_pb2.BatchReply.FromString(wire), "in-process",
                                     packing)
            parse.append(time.perf_counter() - t)
            if any(results.errors):
                raise SystemExit(f"a sequence failed: {next(e for e in results.errors if e)}")
            entries = []
            for i, (doc, pos) in enumerate(cursors):
                if pos >= len(doc) - 4:
                    entries.append(opening(i))
                    continue
                k = rng.choice((1, 1, 2, 2, 3, 4))
                entries.append(SequenceStep(str(i), doc[pos:pos + k]))
                cursors[i][1] = pos + k
    finally:
        batch_rpc.step_flat = step_flat
    warm = slice(min(50, steps // 10), None)

    def ms(values: list[float]) -> float:
        return round(statistics.median(values[warm]) * 1e3, 4)

    return {"sequences": n, "calls": len(run[warm]), "run_p50_ms": ms(run),
            "steps_packed": packed, "step_flat_p50_ms": ms(core),
            "around_core_p50_ms": ms([a - b for a, b in zip(run, core)]),
            "client_pack_p50_ms": ms(pack), "client_parse_p50_ms": ms(parse)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datastore", default=os.path.join(ROOT, "data", "stdlib"))
    ap.add_argument("--batch", type=int, default=64, help="sequences per call")
    ap.add_argument("--steps", type=int, default=1000, help="calls")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--entries", action="store_true",
                    help="every step an entry of its own (the older form) instead of packed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    run = harness.Run()
    reader = Reader(args.datastore)
    docs = held_out_tokens(reader.tokenizer_name)
    # one caller, the only tenant: every slot its own (by default a tenant alone gets 7/8)
    config = ServiceConfig(max_sessions=max(ServiceConfig.max_sessions, args.batch))
    config.tenant_sessions = config.max_sessions
    service = DrafterService(reader, config, ServiceStats(tenants=config.tenant_slots()))
    gc.collect()
    gc.freeze()  # the loaded documents are not the calls' garbage
    report = asyncio.run(measure(service, docs, args.batch, args.steps,
                                 DraftParams(budget=args.budget, max_depth=args.depth),
                                 args.seed, not args.entries))
    reader.close()
    if args.json:
        run.print(report, indent=None)
    else:
        print(f"{report['sequences']} sequences per call, {report['calls']} calls (load "
              f"{run.header['load_average'][0]}): run p50 {report['run_p50_ms']:.3f} ms, of "
              f"which step_flat {report['step_flat_p50_ms']:.3f} ms, the rest "
              f"{report['around_core_p50_ms']:.3f} ms; client builds the request in "
              f"{report['client_pack_p50_ms']:.3f} ms, reads the reply in "
              f"{report['client_parse_p50_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
