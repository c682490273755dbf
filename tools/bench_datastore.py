"""Datastore benchmark over the Python standard library's .py files.

Measures, on the running Python's stdlib (site-packages left out, every 40th file held out
of the datastore):
  * build end to end vs. its two unavoidable costs measured alone (tokenization, suffix array)
  * bytes per token on disk, open time, resident memory added by opening
  * lookup latency (longest match + 64-node tree) on contexts from the held-out files, and
    how much of each held-out continuation the tree would have predicted
  * the same lookups on a 10x larger datastore: the stdlib tokens plus nine copies under
    random vocabulary permutations (same statistics, no shared matches), so the suffix
    arrays are 10x longer while the hits stay those of the real corpus

Usage: python -m tools.bench_datastore [--out bench-out/datastore] [--lookups 2000]
Prints a Markdown table and writes results.json under --out.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import psutil
from pydivsufsort import divsufsort
from redraft.datastore import Reader, build_datastore
from redraft.datastore.drafting import retrieval_tree
from redraft.datastore.sharding import BATCH_CHARS
from redraft.proto.models import DEFAULT_MODEL, load_tokenizer, tokenizer_fingerprint, vocab_size

from tools import harness

HOLD_OUT_EVERY = 40


def stdlib_files() -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.parts))
    good = []
    for p in files:
        try:
            p.read_bytes().decode("utf-8")
            good.append(p)
        except (UnicodeDecodeError, OSError):
            pass
    held = good[::HOLD_OUT_EVERY]
    kept = [p for i, p in enumerate(good) if i % HOLD_OUT_EVERY]
    return kept, held


def tokenize_alone(tok, texts: list[str]) -> tuple[float, list[list[int]]]:
    """The tokenizer's own cost: the same batches, nothing else."""
    backend = tok.backend_tokenizer
    t0 = time.perf_counter()
    out: list[list[int]] = []
    batch, size = [], 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= BATCH_CHARS:
            out.extend(e.ids for e in backend.encode_batch(batch, add_special_tokens=False))
            batch, size = [], 0
    if batch:
        out.extend(e.ids for e in backend.encode_batch(batch, add_special_tokens=False))
    return time.perf_counter() - t0, out


def concat(docs: list, sep: int, dtype) -> np.ndarray:
    lengths = np.array([len(d) + 1 for d in docs])
    arr = np.full(int(lengths.sum()), sep, dtype=dtype)
    pos = 0
    for d in docs:
        arr[pos:pos + len(d)] = d
        pos += len(d) + 1
    return arr


def contexts(held_docs: list[list[int]], n: int, seed: int = 0) -> list[tuple[list, list]]:
    """(context, true continuation) pairs at random points of the held-out documents."""
    rng = np.random.default_rng(seed)
    docs = [d for d in held_docs if len(d) > 80]
    weights = np.array([len(d) for d in docs], dtype=float)
    out = []
    for i in rng.choice(len(docs), size=n, p=weights / weights.sum()):
        d = docs[i]
        p = int(rng.integers(32, len(d) - 16))
        out.append((d[max(0, p - 64):p], d[p:p + 16]))
    return out


def accepted(draft, truth: list[int]) -> int:
    """Length of the longest tree path that equals the true continuation's prefix."""
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)):
        children.setdefault(p, {}).setdefault(t, i)
    node, n = -1, 0
    for t in truth:
        nxt = children.get(node, {}).get(t)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def time_lookups(r: Reader, ctxs, repeats: int = 1) -> dict:
    for c, _ in ctxs[:200]:  # warm the code paths (not the whole page cache)
        retrieval_tree(r, c)
    gc.collect()
    gc.disable()
    try:
        lat, lm, nodes, acc = [], [], [], []
        for c, truth in ctxs:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter_ns()
                d = retrieval_tree(r, c, budget=64)
                best = min(best, time.perf_counter_ns() - t0)
            lat.append(best / 1e3)
            lm.append(d.match_len)
            nodes.append(len(d))
            acc.append(accepted(d, truth))
        lat_lm = []
        for c, _ in ctxs:
            t0 = time.perf_counter_ns()
            r.longest_match(c, max_len=16, min_len=2)
            lat_lm.append((time.perf_counter_ns() - t0) / 1e3)
    finally:
        gc.enable()
    a = np.array(lat)
    return {
        "n": len(a), "median_us": float(np.median(a)), "p90_us": float(np.percentile(a, 90)),
        "p99_us": float(np.percentile(a, 99)), "max_us": float(a.max()),
        "longest_match_median_us": float(np.median(lat_lm)),
        "mean_match_len": float(np.mean(lm)), "mean_nodes": float(np.mean(nodes)),
        "hit_rate": float(np.mean(np.array(lm) > 0)), "mean_accepted": float(np.mean(acc)),
    }


def open_stats(path: Path, n_tokens: int) -> dict:
    proc = psutil.Process()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        r = Reader(path)
        times.append(time.perf_counter() - t0)
        r.close()
    gc.collect()
    before = proc.memory_info().rss
    r = Reader(path)
    after = proc.memory_info().rss
    r.close()
    return {"open_ms_median": float(np.median(times) * 1e3),
            "open_ms_max": float(max(times) * 1e3),
            "rss_bytes_per_token": (after - before) / n_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out/datastore")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--skip-10x", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = harness.Run()  # the machine (cores, load), commit and command, in the file
    res: dict = {}

    tok = load_tokenizer(DEFAULT_MODEL)
    kept, held = stdlib_files()
    texts = [p.read_text() for p in kept]  # also warms the page cache for the build
    res["files"] = {"kept": len(kept), "held_out": len(held),
                    "megabytes": sum(len(t.encode()) for t in texts) / 1e6}

    t_tok, ids = tokenize_alone(tok, texts)
    vocab = vocab_size(tok)
    arr = concat(ids, vocab, np.uint16)
    t0 = time.perf_counter()
    divsufsort(arr)
    t_sa = time.perf_counter() - t0
    res["tokenize_s"], res["suffix_array_s"] = t_tok, t_sa

    ds = out / "stdlib"
    t0 = time.perf_counter()
    m = build_datastore(kept, ds, tokenizer=DEFAULT_MODEL, corpus="stdlib")
    res["build_s"] = time.perf_counter() - t0
    res["build_ratio"] = res["build_s"] / (t_tok + t_sa)
    n_tok = m["n_tokens"]
    res["n_tokens"] = n_tok
    with Reader(ds) as r:
        res["bytes_per_token"] = r.files_bytes / n_tok  # its segments and its manifest
    res.update(open_stats(ds, n_tok))

    held_ids = tokenize_alone(tok, [p.read_text() for p in held])[1]
    ctxs = contexts(held_ids, args.lookups)
    with Reader(ds) as r:
        res["lookup"] = time_lookups(r, ctxs)
        res["lookup_min_of_3"] = time_lookups(r, ctxs, repeats=3)

    if not args.skip_10x:
        rng = np.random.default_rng(1)
        docs = [np.asarray(d, dtype=np.int64) for d in ids]
        big = list(docs)
        for _ in range(9):
            perm = rng.permutation(vocab)
            big.extend(perm[d] for d in docs)
        ds10 = out / "stdlib-10x"
        t0 = time.perf_counter()
        build_datastore(None, ds10, documents=big, fingerprint=tokenizer_fingerprint(tok),
                        vocab_size=vocab, tokenizer=DEFAULT_MODEL, corpus="stdlib10x")
        res["build_10x_s"] = time.perf_counter() - t0
        del big
        with Reader(ds10) as r:
            res["n_tokens_10x"] = r.n_tokens
            res["bytes_per_token_10x"] = r.files_bytes / r.n_tokens
            res["lookup_10x"] = time_lookups(r, ctxs)
            res["lookup_10x_min_of_3"] = time_lookups(r, ctxs, repeats=3)
        res.update({k + "_10x": v for k, v in open_stats(ds10, res["n_tokens_10x"]).items()})
        shutil.rmtree(ds10)

    run.write(out / "results.json", res, indent=2)
    print(table(res))


def table(res: dict) -> str:
    lk, lk3 = res["lookup"], res["lookup_min_of_3"]
    rows = [
        ("corpus", f"{res['files']['kept']} files, {res['files']['megabytes']:.1f} MB, "
                   f"{res['n_tokens']:,} tokens ({res['files']['held_out']} files held out)"),
        ("tokenization alone", f"{res['tokenize_s']:.1f} s"),
        ("suffix array alone", f"{res['suffix_array_s']:.2f} s"),
        ("build end to end", f"{res['build_s']:.1f} s = {res['build_ratio']:.2f}x "
                             "(tokenize + SA)"),
        ("on disk", f"{res['bytes_per_token']:.3f} bytes/token"),
        ("open", f"{res['open_ms_median']:.2f} ms median, {res['open_ms_max']:.2f} ms max"),
        ("resident memory after open", f"{res['rss_bytes_per_token']:.4f} bytes/token"),
        ("lookup (1 pass)", f"median {lk['median_us']:.0f} us, p90 {lk['p90_us']:.0f} us, "
                            f"p99 {lk['p99_us']:.0f} us, max {lk['max_us']:.0f} us"),
        ("lookup (min of 3)", f"median {lk3['median_us']:.0f} us, p90 {lk3['p90_us']:.0f} us, "
                              f"p99 {lk3['p99_us']:.0f} us"),
        ("longest match alone", f"median {lk['longest_match_median_us']:.0f} us"),
        ("hits", f"{lk['hit_rate']:.0%} of contexts, mean match {lk['mean_match_len']:.2f} "
                 f"tokens, {lk['mean_nodes']:.1f} nodes, {lk['mean_accepted']:.2f} tokens of "
                 "the true continuation on a tree path"),
    ]
    if "lookup_10x" in res:
        t10, t10b = res["lookup_10x"], res["lookup_10x_min_of_3"]
        rows += [
            ("10x datastore", f"{res['n_tokens_10x']:,} tokens, build {res['build_10x_s']:.1f} s"
                              f" (pre-tokenized), {res['bytes_per_token_10x']:.3f} bytes/token,"
                              f" open {res['open_ms_median_10x']:.2f} ms"),
            ("10x lookup (1 pass)", f"median {t10['median_us']:.0f} us, p90 {t10['p90_us']:.0f} "
                                    f"us, p99 {t10['p99_us']:.0f} us"),
            ("10x lookup (min of 3)", f"median {t10b['median_us']:.0f} us, p99 "
                                      f"{t10b['p99_us']:.0f} us; longest match "
                                      f"{t10['longest_match_median_us']:.0f} us"),
        ]
    return "\n".join(["| measure | result |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


if __name__ == "__main__":
    main()
