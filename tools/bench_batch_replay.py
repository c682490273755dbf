"""The batched-RPC phase of `tools.bench_service`: engines' sequences replayed through
`Drafter.Batch`, N sequences per call.

Each sequence replays held-out code as a greedy decoder verifying the service's trees would:
the tokens accepted at a step are the longest path of the tree that matches the text, plus
the one token the target model adds; a finished document closes its sequence and a new one
opens in the same call. So the accepted tokens per step measure the trees, and two servers
given the same replay (the compiled core, the Python reference) must agree on them exactly.
"""

from __future__ import annotations

import random
import statistics
import threading
import time

import numpy as np
from redraft.datastore.service.client import (
    DraftClient,
    DraftParams,
    PackedSteps,
    SequenceEnd,
    SequenceOpen,
    SequenceStep,
)

PROMPT_TOKENS = 128


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def matched(tokens: np.ndarray, parents: np.ndarray, text: list[int]) -> int:
    """How many tokens of `text` the tree drafts along one path (greedy verification)."""
    child: dict[tuple[int, int], int] = {}
    for i, edge in enumerate(zip(parents.tolist(), tokens.tolist())):
        child.setdefault(edge, i)
    node, depth = -1, 0
    while depth < len(text):
        nxt = child.get((node, text[depth]))
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


class Replay:
    """N sequences of one engine, each replaying a document from a cursor."""

    def __init__(self, docs: list[list[int]], n: int, seed: int) -> None:
        self.docs = docs
        self.rng = random.Random(seed)
        self.cursor: list[tuple[list[int], int]] = [self._new_doc() for _ in range(n)]
        self.next_id = n

    def _new_doc(self) -> tuple[list[int], int]:
        doc = self.docs[self.rng.randrange(len(self.docs))]
        start = self.rng.randrange(0, len(doc) - PROMPT_TOKENS - 64)
        return doc[start:], PROMPT_TOKENS

    def opens(self) -> list:
        return [SequenceOpen(str(i), doc[:pos]) for i, (doc, pos) in enumerate(self.cursor)]


def run_batches(address: str, docs: list[list[int]], fp: str, params: DraftParams, n: int,
                seed: int, until: float, max_calls: int, packed: bool = True) -> dict:
    """Replay `n` sequences until `until` or `max_calls` calls: per call its wall time and
    the server's (s); per sequence-step the tokens accepted. Each call carries the ends and
    opens as entries, then the steps (packed, as engines' SequenceBatch sends them, or as
    entries with `packed` False)."""
    replay = Replay(docs, n, seed)
    ids = [str(i) for i in range(n)]
    wall: list[float] = []
    server: list[float] = []
    accepted: list[int] = []
    with DraftClient(address, timeout=30, own_connection=True) as client:
        entries, steps = replay.opens(), PackedSteps([], [])
        where = list(range(n))  # each sequence's result in the call
        while time.monotonic() < until and len(wall) < max_calls:
            t0 = time.perf_counter()
            if packed:
                r = client.batch(entries, params, fp, client_id=f"bench-{seed}", steps=steps)
            else:
                r = client.batch(entries + [SequenceStep(s, a) for s, a in zip(
                    steps.sequences, steps.accepted)], params, fp, client_id=f"bench-{seed}",
                    packed=False)
            wall.append(time.perf_counter() - t0)
            server.append(r.server_us * 1e-6)
            bad = [e for e in r.errors if e is not None]
            if bad:
                raise SystemExit(f"bench: a batch entry failed: {bad[0]}")
            ends, opens, steps = [], [], PackedSteps([], [])
            stepping = []
            for i in range(n):
                doc, pos = replay.cursor[i]
                a, b = int(r.offsets[where[i]]), int(r.offsets[where[i] + 1])
                k = matched(r.tokens[a:b], r.parents[a:b], doc[pos:pos + 64]) + 1
                accepted.append(k)
                pos += k
                if pos + 8 >= len(doc):  # the generation ends; another one starts
                    ends.append(SequenceEnd(ids[i], doc[replay.cursor[i][1]:pos]))
                    ids[i] = str(replay.next_id)
                    replay.next_id += 1
                    replay.cursor[i] = replay._new_doc()
                    where[i] = len(opens)
                    opens.append(SequenceOpen(ids[i], replay.cursor[i][0][:PROMPT_TOKENS]))
                    continue
                stepping.append(i)
                steps.sequences.append(ids[i])
                steps.accepted.append(doc[replay.cursor[i][1]:pos])
                replay.cursor[i] = (doc, pos)
            entries = ends + opens  # ends first: their results come without a tree
            for i in range(n):
                where[i] += len(ends)
            for j, i in enumerate(stepping):
                where[i] = len(entries) + j
        client.batch([SequenceEnd(s) for s in ids], client_id=f"bench-{seed}")
    return {"wall": wall, "server": server, "accepted": accepted}


def batch_report(address: str, docs: list[list[int]], fp: str, params: DraftParams, n: int,
                 seconds: float, clients: int = 1, packed: bool = True) -> dict:
    """`clients` engines (threads, a connection each: one per server worker) of `n`
    sequences each, for `seconds` after a short warm-up."""
    run_batches(address, docs, fp, params, n, 999, time.monotonic() + 1.0, 10**9, packed)
    until = time.monotonic() + seconds
    results: list[dict] = [{}] * clients

    def one(j: int) -> None:
        results[j] = run_batches(address, docs, fp, params, n, j, until, 10**9, packed)

    threads = [threading.Thread(target=one, args=(j,)) for j in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    wall = [x * 1e3 for r in results for x in r["wall"]]
    server = [x * 1e3 for r in results for x in r["server"]]
    calls = len(wall)
    return {
        "batch": n, "clients": clients, "calls": calls, "steps_packed": packed,
        "batch_step_p50_ms": statistics.median(server), "batch_step_p99_ms": pct(server, 0.99),
        "per_sequence_p50_us": statistics.median(server) * 1e3 / n,
        "loopback_p50_ms": statistics.median(wall), "loopback_p99_ms": pct(wall, 0.99),
        # sequence-steps per second of the whole run, replay bookkeeping included
        "steps_per_s": calls * n / elapsed,
        "accepted_per_step": statistics.fmean(a for r in results for a in r["accepted"]),
    }


def empty_call_ms(address: str, calls: int = 2000) -> float:
    """Median wall time of a `Batch` call carrying nothing: what gRPC and its Python cost per
    call over this connection, whatever is drafted."""
    with DraftClient(address, timeout=30, own_connection=True) as client:
        for _ in range(calls // 10):
            client.batch([])
        wall = []
        for _ in range(calls):
            t0 = time.perf_counter()
            client.batch([])
            wall.append(time.perf_counter() - t0)
    return statistics.median(wall) * 1e3


def same_replay(addresses: list[str], docs: list[list[int]], fp: str, params: DraftParams,
                n: int, calls: int) -> list[float]:
    """The same replay (seed, calls) on each server: its accepted tokens per step."""
    out = []
    for address in addresses:
        r = run_batches(address, docs, fp, params, n, 7, time.monotonic() + 600, calls)
        out.append(statistics.fmean(r["accepted"]))
    return out
