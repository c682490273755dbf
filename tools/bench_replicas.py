"""Benchmark of draft-service replicas: steps/s and step latency with 1, 2 and 4 serving
processes under the same session load, and how long an output learned on one process takes
to draft on another.

Each configuration starts N `redraft serve` processes on one datastore (separate ports:
replicas; or `--layout workers`: one server with `--workers N`), then client processes
replay held-out code as decoders would (as `tools.bench_service` does), their sessions
spread over the replicas by the client's round_robin policy. While that load runs, the
main process measures sharing: a session on one process accepts a new output; a session
of the same tenant on another process steps (every 5 ms) until it drafts the output's
continuation from learned outputs; the delay is from the writer's step returning.

    python -m tools.bench_replicas --datastore data/stdlib --processes 1,2,4 --sessions 64

Learning is on (`--learn tenant`, never persisted here: logs are still shared).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time

from redraft.datastore import Reader
from redraft.datastore.service.client import DraftClient, DraftParams

from tools import harness
from tools.bench_service import held_out_tokens, pct
from tools.harness import free_port

ROOT = str(harness.ROOT)


def start_servers(stack: contextlib.ExitStack, args, n: int
                  ) -> tuple[list[harness.ServeProcess], list[str], str]:
    """N replicas (or one server of N workers), stopped when `stack` closes whatever
    happens; their processes, addresses, client target."""
    common = ["--datastore", args.datastore, "--learn", "tenant", "--learn-max-tokens",
              str(args.learn_max_tokens), "--learn-persist-seconds", "0",
              "--max-sessions", str(args.sessions + 64), "--max-budget", "1024"]
    replicas, workers = (1, n) if args.layout == "workers" else (n, 1)
    procs, addresses = [], []
    for _ in range(replicas):
        port = free_port()
        procs.append(stack.enter_context(harness.serving(
            args.datastore, *common[2:], "--port", str(port), "--workers", str(workers))))
        addresses.append(f"127.0.0.1:{port}")
    return procs, addresses, ",".join(addresses)


def client_proc(job: tuple) -> dict:
    """One client process: `len(seeds)` sessions on threads, replaying until `until`."""
    target, own, docs, fp, params, seeds, until = job
    shared = None if own else DraftClient(target, timeout=10)
    lat: list[float] = []
    lock = threading.Lock()

    def one(seed: int) -> None:
        rng = random.Random(seed)
        client = DraftClient(target, timeout=10, own_connection=True) if own else shared
        mine = []
        try:
            while time.monotonic() < until:
                doc = docs[rng.randrange(len(docs))]
                start = rng.randrange(0, len(doc) - 300)
                pos = start + 128
                with client.session(doc[start:pos], params, fp, tenant=f"s{seed}") as s:
                    while pos < len(doc) - 4 and time.monotonic() < until:
                        k = rng.choice((1, 1, 2, 2, 3, 4))
                        t0 = time.perf_counter()
                        s.step(doc[pos:pos + k])
                        mine.append(time.perf_counter() - t0)
                        pos += k
        finally:
            if own:
                client.close()
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=one, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if shared is not None:
        shared.close()
    return {"lat": lat}


def sharing_delays(addresses: list[str], fp: str, vocab: int, trials: int, until: float,
                   pids: list[int] | None = None) -> list[float]:
    """Seconds from one process learning an output to another drafting it, per trial."""
    rng = random.Random(7)
    learned_only = DraftParams(budget=16, max_depth=8, sources=("learned",))
    clients = [DraftClient(a, timeout=10, own_connection=True) for a in addresses]
    if pids is not None:  # one server of N workers: one client per worker process
        by_pid: dict[int, DraftClient] = {}
        for _ in range(200):
            c = DraftClient(addresses[0], timeout=10, own_connection=True)
            pid = c.stats()["pid"]
            if pid in by_pid:
                c.close()
            else:
                by_pid[pid] = c
            if len(by_pid) == len(pids):
                break
        clients = list(by_pid.values())
    delays = []
    try:
        for trial in range(trials):
            if time.monotonic() > until or len(clients) < 2:
                break
            writer, reader = rng.sample(clients, 2)
            prompt = [rng.randrange(1, vocab) for _ in range(24)]
            text = [rng.randrange(1, vocab) for _ in range(40)]
            tenant = f"sharing-{trial}"
            with reader.session(prompt, learned_only, fp, tenant=tenant) as watch:
                watch.step(text[:8])
                with writer.session(prompt, DraftParams(budget=1), fp, tenant=tenant) as s:
                    s.step(text)
                    t0 = time.monotonic()
                while True:
                    if watch.step([]).tokens[:4] == text[8:12]:
                        delays.append(time.monotonic() - t0)
                        break
                    if time.monotonic() - t0 > 30:
                        delays.append(float("inf"))
                        break
                    time.sleep(0.005)
    finally:
        for c in clients:
            c.close()
    return delays


def run_config(args, n: int, docs, fp: str, vocab: int) -> dict:
    with contextlib.ExitStack() as stack:
        procs, addresses, target = start_servers(stack, args, n)
        own = args.layout == "workers"
        params = DraftParams(budget=args.budget, max_depth=args.depth,
                             sources=("rest", "pld", "learned"))
        # warm-up: every process maps its datastore pages before the timed phase
        warm = time.monotonic() + 3
        client_proc((target, own, docs, fp, params, list(range(4)), warm))
        until = time.monotonic() + args.seconds
        per = [list(range(100 + i, 100 + args.sessions, args.client_procs))
               for i in range(args.client_procs)]
        delays: list[float] = []
        ctx = mp.get_context("spawn")
        with ctx.Pool(args.client_procs) as pool:
            job = pool.map_async(client_proc, [(target, own, docs, fp, params, seeds, until)
                                               for seeds in per])
            if n > 1:
                delays = sharing_delays(addresses, fp, vocab, args.trials, until,
                                        pids=list(range(n)) if own else None)
            results = job.get()
        load = harness.load_average()
        lat_ms = [x * 1e3 for r in results for x in r["lat"]]
        row = {"processes": n, "layout": args.layout, "sessions": args.sessions,
               "seconds": args.seconds, "steps": len(lat_ms),
               "steps_per_s": len(lat_ms) / args.seconds,
               "p50_ms": statistics.median(lat_ms), "p99_ms": pct(lat_ms, 0.99),
               "loadavg_after": " ".join(f"{x:.2f}" for x in load)}
        if delays:
            row.update(sharing_trials=len(delays), sharing_p50_ms=statistics.median(delays) * 1e3,
                       sharing_max_ms=max(delays) * 1e3)
        for p in procs:  # stopped as before: SIGTERM, each given a minute
            p.proc.terminate()
        for p in procs:
            p.proc.wait(60)
        return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datastore", default=os.path.join(ROOT, "data", "stdlib"))
    ap.add_argument("--processes", default="1,2,4", help="serving processes per run")
    ap.add_argument("--layout", choices=("replicas", "workers"), default="replicas",
                    help="separate `redraft serve` replicas, or one server's --workers")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0, help="load phase per run")
    ap.add_argument("--trials", type=int, default=40, help="sharing-delay trials per run")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--learn-max-tokens", type=int, default=100_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    run = harness.Run()
    with Reader(args.datastore) as r:
        name, fp, vocab = r.tokenizer_name, r.tokenizer_fingerprint, r.vocab_size
        n_tokens = r.n_tokens
    docs = held_out_tokens(name)
    rows = [run_config(args, int(n), docs, fp, vocab) for n in args.processes.split(",")]
    if args.json:
        run.print(rows)
        return 0
    print(f"datastore {n_tokens:,} tokens; {args.sessions} sessions from {args.client_procs} "
          f"client processes, {args.seconds:g} s per run; layout {args.layout}")
    print("| processes | steps/s | p50 ms | p99 ms | learned output drafts on another "
          "process after (p50 / max, trials) | load avg after |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        sharing = (f"{r['sharing_p50_ms']:.0f} ms / {r['sharing_max_ms']:.0f} ms "
                   f"({r['sharing_trials']})" if "sharing_trials" in r else "-")
        print(f"| {r['processes']} | {r['steps_per_s']:,.0f} | {r['p50_ms']:.2f} | "
              f"{r['p99_ms']:.2f} | {sharing} | {r['loadavg_after']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
