"""Benchmark of the draft service over loopback: one-session step latency, then many
concurrent sessions (throughput, p99, health answering, server memory).

The server is a real `redraft serve` subprocess; clients replay held-out code (this
project's own sources, which are not in the standard-library datastore) as a decoder
would: open a session with a prompt, then send 1-4 "accepted" tokens per step.

    python -m tools.bench_service --datastore data/stdlib

Learning is on as `redraft serve` has it (every session's accepted tokens are learned and
drafted back, source `learned`), bounded by --learn-max-tokens and never persisted here.
`--baseline` also starts a server with learning off and alternates the one-session phase's
steps between the two, so the latency ratio is measured under the same load.
`--metrics-baseline` does the same with a second server that differs only in serving
`--metrics-port` (what counting for Prometheus costs a step; server time per step from that
server's own `redraft:session_step_seconds` histogram).

`--batch 1,8,64` measures the batched RPC instead (`tools.bench_batch_replay`): per batch
size, the server's time per call (`batch_step_p50_ms`, `batch_step_p99_ms`, from the reply's
`server_us`), per sequence-step (`per_sequence_p50_us`), the call over loopback
(`loopback_p50_ms`; `empty_call_p50_ms`: a call carrying nothing, what gRPC alone costs) and
sequence-steps per second, with one engine per server worker (steps packed, as engines'
SequenceBatch sends them; `--batch-entries`: one entry per step, the older form); then
the same replay on a compiled-core server and a Python-reference server (learning off, so
neither learns from the other's logs), whose accepted tokens per step must be equal.

    python -m tools.bench_service --datastore data/stdlib --batch 1,8,64 --json

`--batch 8,64 --metrics-baseline`: what counting for Prometheus costs a Batch call instead.
Two servers that differ only in `--metrics-port` are given the same replay (one engine
each, steps packed), call by call in turn (which of the two goes first alternating), and
the server time of each call (the reply's `server_us`, which includes the counting) is
compared: medians, and the median of the per-pair differences. `--in-process`: two
services in this process instead (`BatchDrafting.run` timed; no gRPC, no second process, so
that nothing but the counting differs); `--metrics-control`: neither counts (the noise
floor of the comparison).

The report starts with the run's record (`tools.harness`: machine, load, commit, command).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
import urllib.request

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from redraft.datastore.service.client import (
    DraftClient,
    DraftParams,
    PackedSteps,
    SequenceEnd,
    SequenceOpen,
)

from tools import harness
from tools.bench_batch_replay import (
    PROMPT_TOKENS,
    Replay,
    batch_report,
    empty_call_ms,
    matched,
    same_replay,
)
from tools.harness import free_port

ROOT = str(harness.ROOT)


def held_out_tokens(tokenizer_name: str) -> list[list[int]]:
    """Token ids of this repository's Python sources (code the datastore has never seen)."""
    from redraft.proto.models import load_tokenizer

    tok = load_tokenizer(tokenizer_name)
    files = sorted(glob.glob(os.path.join(ROOT, "datastore", "*.py"))
                   + glob.glob(os.path.join(ROOT, "decoder", "*.py")))
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            ids = tok(f.read(), add_special_tokens=False)["input_ids"]
        if len(ids) > 400:
            out.append(ids)
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def run_session(address: str, docs: list[list[int]], fp: str, params: DraftParams, seed: int,
                until: float, max_steps: int, own: bool = False) -> dict:
    """Replay documents as one decoder would; returns step latencies (s) and tree sizes."""
    return run_sessions([address], docs, fp, [params], seed, until, max_steps, own)[0]


def run_sessions(addresses: list[str], docs: list[list[int]], fp: str,
                 params: list[DraftParams], seed: int, until: float, max_steps: int,
                 own: bool = False) -> list[dict]:
    """The same replay on several servers at once, one step on each in turn (so they share
    whatever load the machine has); per server: step latencies (s), tree sizes, hits."""
    rng = random.Random(seed)
    out = [{"lat": [], "nodes": 0, "hits": 0} for _ in addresses]
    clients = [DraftClient(a, timeout=10, own_connection=own) for a in addresses]
    try:
        while time.monotonic() < until and len(out[0]["lat"]) < max_steps:
            doc = docs[rng.randrange(len(docs))]
            start = rng.randrange(0, len(doc) - 300)
            pos = start + 128
            sessions = [c.session(doc[start:pos], p, fp).__enter__()
                        for c, p in zip(clients, params)]
            while (pos < len(doc) - 4 and time.monotonic() < until
                   and len(out[0]["lat"]) < max_steps):
                k = rng.choice((1, 1, 2, 2, 3, 4))
                for s, o in zip(sessions, out):
                    t0 = time.perf_counter()
                    d = s.step(doc[pos : pos + k])
                    o["lat"].append(time.perf_counter() - t0)
                    o["nodes"] += len(d)
                    o["hits"] += len(d) > 0
                pos += k
            for s in sessions:
                s.close()
    finally:
        for c in clients:
            c.close()
    return out


def _client_proc(args: tuple) -> dict:
    address, docs, fp, params, seeds, until = args
    results: list[dict] = []

    def one(seed: int) -> None:
        results.append(run_session(address, docs, fp, params, seed, until, 10**9, own=True))

    threads = [threading.Thread(target=one, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = [x for r in results for x in r["lat"]]
    return {"lat": lat, "nodes": sum(r["nodes"] for r in results)}


def rss_mib(proc: psutil.Process) -> float:
    """Server memory that is not file-backed: RSS minus shared pages.

    The datastore is memory-mapped, so plain RSS also grows as lookups touch more of the
    suffix array (page cache, reclaimable); that is not the server holding on to memory.
    """
    procs = [proc] + proc.children(recursive=True)
    total = 0
    for p in procs:
        if p.is_running():
            m = p.memory_info()
            total += m.rss - getattr(m, "shared", 0)
    return total / 2**20


def quarters(samples: list) -> list:
    """The samples at the end of each quarter of the run."""
    n = len(samples)
    return [samples[min(n - 1, q * n // 4)] for q in range(1, 5)] if n else []


def start_server(stack: contextlib.ExitStack, args, learn: str, *extra: str
                 ) -> tuple[harness.ServeProcess, str]:
    """`redraft serve` on a free port (learned outputs stay in memory: never persisted),
    stopped when `stack` closes whatever happens."""
    port = free_port()
    serve = stack.enter_context(harness.serving(
        args.datastore, "--port", str(port), "--workers", str(args.workers), "--max-budget",
        str(max(1024, args.budget)), "--learn", learn, "--learn-max-tokens",
        str(args.learn_max_tokens), "--learn-persist-seconds", "0", *extra,
        *(args.serve_arg or [])))
    return serve, f"127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datastore", default=os.path.join(ROOT, "data", "stdlib"))
    ap.add_argument("--workers", type=int, default=1, help="server processes")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3000, help="steps of the one-session phase")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15.0, help="concurrent phase length")
    ap.add_argument("--learn", choices=("tenant", "global", "off"), default="tenant",
                    help="the server's learning (sessions ask for learned drafts unless off)")
    ap.add_argument("--learn-max-tokens", type=int, default=100_000,
                    help="the learned-output bound (small enough to be reached in the run)")
    ap.add_argument("--metrics-baseline", action="store_true",
                    help="also a server with --metrics-port, steps alternated with this one's")
    ap.add_argument("--baseline", action="store_true",
                    help="also serve with learning off; the one-session phase alternates")
    ap.add_argument("--batch", metavar="N,N,...",
                    help="measure the batched RPC at these batch sizes instead of sessions")
    ap.add_argument("--batch-seconds", type=float, default=8.0,
                    help="time per batch size (--batch)")
    ap.add_argument("--batch-entries", action="store_true",
                    help="send every step as an entry of its own (the older form) instead of "
                    "packed (--batch)")
    ap.add_argument("--reference-calls", type=int, default=40,
                    help="calls of the core-against-reference replay (--batch; 0 = skip)")
    ap.add_argument("--metrics-control", action="store_true",
                    help="--batch with --metrics-baseline: the second server without metrics "
                    "too (the noise floor of the comparison)")
    ap.add_argument("--in-process", action="store_true",
                    help="--batch with --metrics-baseline: two services in this process "
                    "(no gRPC, no second process) instead of two servers")
    ap.add_argument("--serve-arg", action="append", metavar="ARG",
                    help="one more argument for `redraft serve` (repeat: --serve-arg=--x "
                    "--serve-arg=1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    run = harness.Run()
    if args.batch and args.metrics_baseline:
        return batch_metrics_main(args, run)
    if args.batch:
        return batch_main(args, run)

    with contextlib.ExitStack() as stack:
        servers = [start_server(stack, args, args.learn)]
        if args.metrics_baseline:
            servers.append(start_server(stack, args, args.learn, "--metrics-port", "0"))
        elif args.baseline:
            servers.append(start_server(stack, args, "off"))
        report = sessions_report(args, servers)
        code = max((serve.stop() for serve, _ in servers), key=abs)
    report["server_exit_code"] = code
    if args.json:
        run.print(report)
    else:
        o, c = report["one_session"], report["concurrent"]
        print(f"datastore {report['datastore_tokens']:,} tokens, server workers "
              f"{args.workers}, budget {args.budget}, depth {args.depth}")
        print(f"one session (learn {args.learn}): {o['steps']} steps, median "
              f"{o['median_ms']:.3f} ms, p90 {o['p90_ms']:.3f} ms, p99 {o['p99_ms']:.3f} ms, "
              f"{o['mean_nodes']:.1f} nodes/tree, hit rate {o['hit_rate']:.2f}")
        mb = report.get("one_session_metrics")
        if mb:
            print(f"  interleaved with --metrics-port: median {mb['median_ms']:.3f} ms, p99 "
                  f"{mb['p99_ms']:.3f} ms; median ratio {mb['median_ms'] / o['median_ms']:.3f}"
                  f", server time per step {mb['server_step_mean_us']:.0f} us (mean); "
                  f"server CPU per step {mb['server_cpu_per_step_us']:.1f} us against "
                  f"{o['server_cpu_per_step_us']:.1f} us without")
        b = report.get("one_session_learning_off")
        if b:
            print(f"  interleaved with learning off: median {b['median_ms']:.3f} ms, p99 "
                  f"{b['p99_ms']:.3f} ms, {b['mean_nodes']:.1f} nodes/tree; median ratio "
                  f"{o['median_ms'] / b['median_ms']:.3f}")
        print(f"{c['sessions']} sessions: {c['steps_per_s']:.0f} steps/s, median "
              f"{c['median_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms; health {c['health_checks']} "
              f"checks, {c['health_failures']} failed, max {c['health_max_ms']:.1f} ms")
        mib = " / ".join(f"{x:.0f}" for x in c["server_private_mib_quarters"])
        print(f"server private memory {c['server_private_mib_before']:.0f} MiB before, {mib} "
              f"MiB at each quarter of the run, {c['server_private_mib_after']:.0f} MiB after")
        learned = " / ".join(f"{x:,}" for x in c["learned_tokens_quarters"])
        print(f"learned tokens at each quarter: {learned} (bound {args.learn_max_tokens:,})")
        print(f"server-side drafting: p50 {report['server_stats']['latency_p50_us']:.0f} us, "
              f"p99 {report['server_stats']['latency_p99_us']:.0f} us; exit {code}")
    return 0


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a server process and its workers so far."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def step_seconds(metrics_url: str | None) -> tuple[float, float]:
    """Session steps counted so far and their server time (s), from a server's /metrics."""
    if metrics_url is None:
        return 0.0, 0.0
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.name.startswith("redraft:session_step_seconds_")}
    return got["redraft:session_step_seconds_count"], got["redraft:session_step_seconds_sum"]


def sessions_report(args, servers: list[tuple[harness.ServeProcess, str]]) -> dict:
    """The sessions phases (module docstring) on running servers."""
    server, address = servers[0]
    client = DraftClient(address)
    info = client.info()
    docs = held_out_tokens(info.tokenizer_name)
    sources = ("rest", "pld") if args.learn == "off" else ("rest", "pld", "learned")
    params = DraftParams(budget=args.budget, max_depth=args.depth, sources=sources)
    ps = psutil.Process(server.pid)
    report: dict = {"datastore_tokens": info.n_tokens, "workers": args.workers,
                    "budget": args.budget, "depth": args.depth, "learn": args.learn,
                    "learn_max_tokens": args.learn_max_tokens,
                    "held_out_tokens": sum(map(len, docs))}

    # warm-up, then one session stepping as fast as it can (on each server in turn)
    addresses = [a for _, a in servers]
    metrics_url = servers[1][0].metrics_url if len(servers) > 1 else None
    second = params if metrics_url else DraftParams(budget=args.budget, max_depth=args.depth)
    all_params = [params, second]
    run_sessions(addresses, docs, info.tokenizer_fingerprint, all_params, 0,
                 time.monotonic() + 2, 300)
    before = step_seconds(metrics_url)
    cpu_before = [cpu_seconds(serve.pid) for serve, _ in servers]
    results = run_sessions(addresses, docs, info.tokenizer_fingerprint, all_params, 1,
                           time.monotonic() + 240, args.steps)
    cpu = [cpu_seconds(serve.pid) - c for (serve, _), c in zip(servers, cpu_before)]
    names = ("one_session", "one_session_metrics" if metrics_url else "one_session_learning_off")
    for name, one in zip(names, results):
        lat_ms = [x * 1e3 for x in one["lat"]]
        report[name] = {
            "steps": len(lat_ms), "median_ms": statistics.median(lat_ms),
            "p90_ms": pct(lat_ms, 0.9), "p99_ms": pct(lat_ms, 0.99),
            "mean_nodes": one["nodes"] / len(lat_ms), "hit_rate": one["hits"] / len(lat_ms),
        }
    for name, seconds in zip(names, cpu):  # CPU: what load on the machine changes least
        report[name]["server_cpu_per_step_us"] = seconds / report[name]["steps"] * 1e6
    if metrics_url:
        after = step_seconds(metrics_url)
        report["one_session_metrics"]["server_step_mean_us"] = (
            (after[1] - before[1]) / max(1.0, after[0] - before[0]) * 1e6)

    # many sessions from several client processes; health probed meanwhile
    rss_before = rss_mib(ps)
    until = time.monotonic() + args.seconds
    per = [list(range(100 + i, 100 + args.sessions, args.client_procs))
           for i in range(args.client_procs)]
    health_ms: list[float] = []
    health_fail = 0
    rss_samples: list[float] = []
    learned_samples: list[int] = []
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.client_procs) as pool:
        job = pool.map_async(_client_proc, [
            (address, docs, info.tokenizer_fingerprint, params, seeds, until) for seeds in per
        ])
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not job.ready():
                t0 = time.perf_counter()
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    health_fail += r.status != health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    health_fail += 1
                health_ms.append((time.perf_counter() - t0) * 1e3)
                rss_samples.append(rss_mib(ps))
                learned_samples.append(client.stats().get("learned_tokens", 0))
                time.sleep(0.2)
        results = job.get()
    lat_ms = [x * 1e3 for r in results for x in r["lat"]]
    st = client.stats()
    report["concurrent"] = {
        "sessions": args.sessions, "seconds": args.seconds, "steps": len(lat_ms),
        "steps_per_s": len(lat_ms) / args.seconds, "median_ms": statistics.median(lat_ms),
        "p99_ms": pct(lat_ms, 0.99),
        "health_checks": len(health_ms), "health_failures": health_fail,
        "health_max_ms": max(health_ms) if health_ms else None,
        "server_private_mib_before": rss_before,
        "server_private_mib_max": max(rss_samples) if rss_samples else None,
        "server_private_mib_after": rss_mib(ps),
        # RSS at each quarter of the run: flat once every session is open
        "server_private_mib_quarters": quarters(rss_samples),
        "learned_tokens_quarters": quarters(learned_samples),
    }
    report["server_stats"] = {k: st.get(k) for k in (
        "requests", "hit_rate", "mean_nodes", "latency_p50_us", "latency_p99_us", "errors",
        "learned_hits", "learned_tokens")}
    client.close()
    return report


def batch_main(args, run: harness.Run) -> int:
    """The batched RPC (module docstring): one server, each batch size in turn."""
    sizes = [int(x) for x in args.batch.split(",")]
    room = str(max(sizes) * args.workers * 2 + 64)  # sequences open at once, with margin
    with contextlib.ExitStack() as stack:
        serve, address = start_server(stack, args, args.learn, "--max-sessions", room)
        with DraftClient(address) as client:
            info = client.info()
        docs = [d for d in held_out_tokens(info.tokenizer_name) if len(d) > 400]
        fp = info.tokenizer_fingerprint
        sources = ("rest", "pld") if args.learn == "off" else ("rest", "pld", "learned")
        params = DraftParams(budget=args.budget, max_depth=args.depth, sources=sources)
        report: dict = {"datastore_tokens": info.n_tokens, "workers": args.workers,
                        "budget": args.budget, "depth": args.depth, "learn": args.learn,
                        "empty_call_p50_ms": empty_call_ms(address),
                        "batches": [batch_report(address, docs, fp, params, n,
                                                 args.batch_seconds, args.workers,
                                                 not args.batch_entries)
                                    for n in sizes]}
        report["server_exit_code"] = serve.stop()
    if args.reference_calls:
        plain = DraftParams(budget=args.budget, max_depth=args.depth)
        with contextlib.ExitStack() as stack:
            servers = [start_server(stack, args, "off", "--drafting", kind, "--max-sessions",
                                    room) for kind in ("native", "python")]
            core, ref = same_replay([a for _, a in servers], docs, fp, plain, max(sizes),
                                    args.reference_calls)
        report["replay"] = {"batch": max(sizes), "calls": args.reference_calls,
                            "accepted_per_step_core": core, "accepted_per_step_python": ref}
    if args.json:
        run.print(report)
        return 0
    print(f"datastore {report['datastore_tokens']:,} tokens, server workers {args.workers}, "
          f"budget {args.budget}, depth {args.depth}, learn {args.learn}; a call carrying "
          f"nothing takes {report['empty_call_p50_ms']:.3f} ms over loopback")
    for b in report["batches"]:
        print(f"batch {b['batch']:>3} x {b['clients']} engine(s): server p50 "
              f"{b['batch_step_p50_ms']:.3f} ms, p99 {b['batch_step_p99_ms']:.3f} ms, "
              f"{b['per_sequence_p50_us']:.1f} us/sequence; loopback p50 "
              f"{b['loopback_p50_ms']:.3f} ms; {b['steps_per_s']:,.0f} steps/s; "
              f"{b['accepted_per_step']:.3f} accepted/step")
    r = report.get("replay")
    if r:
        print(f"same replay, accepted per step: core {r['accepted_per_step_core']:.4f}, "
              f"python reference {r['accepted_per_step_python']:.4f}")
    return 0


class BatchEngine:
    """One engine's replay of `n` sequences (tools.bench_batch_replay's), a call at a time:
    so that two servers can be given the same calls in turn. `send(entries, steps)` makes a
    call: its results (as `DraftClient.batch` gives them) and its server time (s)."""

    def __init__(self, send, docs: list[list[int]], n: int, seed: int) -> None:
        self.send, self.n = send, n
        self.replay = Replay(docs, n, seed)
        self.ids = [str(i) for i in range(n)]
        self.entries, self.steps = self.replay.opens(), PackedSteps([], [])
        self.where = list(range(n))

    def call(self) -> float:
        """The next call; its server time (s)."""
        r, seconds = self.send(self.entries, self.steps)
        bad = [e for e in r.errors if e is not None]
        if bad:
            raise SystemExit(f"bench: a batch entry failed: {bad[0]}")
        replay, ids = self.replay, self.ids
        ends, opens, stepping, steps = [], [], [], PackedSteps([], [])
        for i in range(self.n):
            doc, pos = replay.cursor[i]
            a, b = int(r.offsets[self.where[i]]), int(r.offsets[self.where[i] + 1])
            end = pos + matched(r.tokens[a:b], r.parents[a:b], doc[pos:pos + 64]) + 1
            if end + 8 >= len(doc):  # the generation ends; another one starts
                ends.append(SequenceEnd(ids[i], doc[pos:end]))
                ids[i] = str(replay.next_id)
                replay.next_id += 1
                replay.cursor[i] = replay._new_doc()
                self.where[i] = len(opens)
                opens.append(SequenceOpen(ids[i], replay.cursor[i][0][:PROMPT_TOKENS]))
                continue
            stepping.append(i)
            steps.sequences.append(ids[i])
            steps.accepted.append(doc[pos:end])
            replay.cursor[i] = (doc, end)
        self.entries, self.steps = ends + opens, steps
        for i in range(self.n):
            self.where[i] += len(ends)
        for j, i in enumerate(stepping):
            self.where[i] = len(self.entries) + j
        return seconds

    def close(self) -> None:
        self.send([SequenceEnd(s) for s in self.ids], PackedSteps([], []))


def grpc_sender(client: DraftClient, fp: str, params: DraftParams):
    """Calls over gRPC; the server time is the reply's `server_us`."""
    def send(entries, steps):
        r = client.batch(entries, params, fp, client_id="bench", steps=steps)
        return r, r.server_us * 1e-6
    return send


def in_process_sender(service, fp: str, params: DraftParams):
    """Calls to `service.batch_rpc.run` in this process, through the wire bytes; the server
    time is the call's wall-clock time, then this thread's CPU time in it (what the counting
    adds, all of it on the event loop's thread, without the time others held the CPU: the
    drafting on the core's threads is not in it)."""
    import asyncio

    from redraft.datastore.service.wire import add_entry, batch_results, params_message
    from redraft.proto import draft_pb2

    loop = asyncio.new_event_loop()

    def send(entries, steps):
        req = draft_pb2.BatchRequest(client="bench", tokenizer_fingerprint=fp,
                                     params=params_message(params))
        steps.to_proto(req.steps)
        for e in entries:
            add_entry(req.entries.add, e)
        req = draft_pb2.BatchRequest.FromString(req.SerializeToString())
        t0, c0 = time.perf_counter(), time.thread_time()
        reply = loop.run_until_complete(service.batch_rpc.run(req, ""))
        seconds = (time.perf_counter() - t0, time.thread_time() - c0)
        reply = draft_pb2.BatchReply.FromString(reply.SerializeToString())
        return batch_results(reply, "in-process", steps), seconds
    return send


def interleaved(senders: list, docs: list[list[int]], n: int, seconds: float) -> dict:
    """The same replay through each of two senders, call by call in turn (which goes first
    alternating), for `seconds` after a second of warm-up: the server times compared."""
    engines = [BatchEngine(send, docs, n, seed=n) for send in senders]
    times: list[list[float]] = [[], []]
    warm = time.monotonic() + 1.0
    until = warm + seconds
    k = 0
    while time.monotonic() < until:
        for j in ((0, 1) if k % 2 == 0 else (1, 0)):
            spent = engines[j].call()
            if time.monotonic() > warm:
                times[j].append(spent)
        k += 1
    for e in engines:
        e.close()
    pairs = min(map(len, times))
    cpu = isinstance(times[0][0], tuple)  # (wall, this thread's CPU) per call
    off, on = ([(x[0] if cpu else x) * 1e3 for x in t[:pairs]] for t in times)
    diff = statistics.median(b - a for a, b in zip(off, on))
    out = {"batch": n, "calls": pairs, "off_p50_ms": statistics.median(off),
           "on_p50_ms": statistics.median(on), "paired_diff_p50_us": diff * 1e3,
           "ratio_p50": statistics.median(on) / statistics.median(off),
           "paired_diff_share": diff / statistics.median(off)}
    if cpu:
        off_cpu, on_cpu = ([x[1] * 1e3 for x in t[:pairs]] for t in times)
        diff = statistics.median(b - a for a, b in zip(off_cpu, on_cpu))
        out.update({"off_cpu_p50_ms": statistics.median(off_cpu),
                    "on_cpu_p50_ms": statistics.median(on_cpu),
                    "paired_cpu_diff_p50_us": diff * 1e3,
                    # what counting adds, against the server time of a call without it
                    "cpu_diff_share": diff / statistics.median(off)})
    return out


def batch_metrics_main(args, run: harness.Run) -> int:
    """`--batch ... --metrics-baseline` (module docstring): per batch size, the same calls
    to a server without and one with `--metrics-port`, in turn; `--in-process`: to two
    services in this process, the second counting for /metrics."""
    sizes = [int(x) for x in args.batch.split(",")]
    room = max(sizes) * 2 + 64
    report: dict = {"workers": args.workers, "budget": args.budget, "depth": args.depth,
                    "learn": args.learn, "in_process": args.in_process,
                    "control": args.metrics_control, "batches": []}
    sources = ("rest", "pld") if args.learn == "off" else ("rest", "pld", "learned")
    params = DraftParams(budget=args.budget, max_depth=args.depth, sources=sources)
    if args.in_process:
        import gc

        from redraft.datastore import Reader
        from redraft.datastore.service.config import ServiceConfig
        from redraft.datastore.service.handlers import DrafterService
        from redraft.datastore.service.stats import ServiceStats

        reader = Reader(args.datastore)
        docs = [d for d in held_out_tokens(reader.tokenizer_name) if len(d) > 400]
        config = ServiceConfig(max_sessions=room, tenant_sessions=room,
                               learn=args.learn, learn_max_tokens=args.learn_max_tokens)
        services = [DrafterService(reader, config, ServiceStats(tenants=config.tenant_slots()))
                    for _ in range(2)]
        services[1].stats.metrics.enabled = not args.metrics_control
        fp = services[0].checks.fingerprint
        report["datastore_tokens"] = int(reader.n_tokens)
        gc.collect()
        gc.freeze()
        for n in sizes:
            report["batches"].append(interleaved(
                [in_process_sender(s, fp, params) for s in services], docs, n,
                args.batch_seconds))
        reader.close()
    else:
        with contextlib.ExitStack() as stack:
            servers = [start_server(stack, args, args.learn, "--max-sessions", str(room),
                                    *extra) for extra in ((), () if args.metrics_control
                                                          else ("--metrics-port", "0"))]
            clients = [stack.enter_context(DraftClient(a, timeout=30, own_connection=True))
                       for _, a in servers]
            info = clients[0].info()
            docs = [d for d in held_out_tokens(info.tokenizer_name) if len(d) > 400]
            fp = info.tokenizer_fingerprint
            report["datastore_tokens"] = info.n_tokens
            for n in sizes:
                cpu = [cpu_seconds(serve.pid) for serve, _ in servers]
                b = interleaved([grpc_sender(c, fp, params) for c in clients], docs, n,
                                args.batch_seconds)
                # each server's whole CPU per call (gRPC, the warm-up and publishing included)
                off_cpu, on_cpu = ((cpu_seconds(serve.pid) - c) / b["calls"] * 1e3
                                   for (serve, _), c in zip(servers, cpu))
                b.update({"off_server_cpu_per_call_ms": off_cpu,
                          "on_server_cpu_per_call_ms": on_cpu})
                report["batches"].append(b)
            report["server_exit_code"] = max((s.stop() for s, _ in servers), key=abs)
    report["load_average_end"] = os.getloadavg()
    if args.json:
        run.print(report)
        return 0
    print(f"datastore {report['datastore_tokens']:,} tokens, budget {args.budget}, depth "
          f"{args.depth}, learn {args.learn}, {'in process' if args.in_process else 'gRPC'}"
          f"{', control: neither counts' if args.metrics_control else ''}; "
          f"load average at the start {' '.join(map(str, run.header['load_average']))}, at "
          f"the end {' '.join(f'{x:.2f}' for x in report['load_average_end'])}")
    for b in report["batches"]:
        print(f"batch {b['batch']:>3}, {b['calls']} calls each: server p50 "
              f"{b['off_p50_ms']:.3f} ms without metrics, {b['on_p50_ms']:.3f} ms with "
              f"(ratio {b['ratio_p50']:.3f}); per-pair difference p50 "
              f"{b['paired_diff_p50_us']:+.1f} us ({b['paired_diff_share']:+.1%})")
        if "off_server_cpu_per_call_ms" in b:
            print(f"    server CPU per call (gRPC included): {b['off_server_cpu_per_call_ms']:.3f}"
                  f" ms without, {b['on_server_cpu_per_call_ms']:.3f} ms with")
        if "paired_cpu_diff_p50_us" in b:
            print(f"    the event loop thread's CPU per call: p50 {b['off_cpu_p50_ms']:.3f} ms "
                  f"without, {b['on_cpu_p50_ms']:.3f} ms with; per-pair difference p50 "
                  f"{b['paired_cpu_diff_p50_us']:+.1f} us ({b['cpu_diff_share']:+.1%} of the "
                  "server time without)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
