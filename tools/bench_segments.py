"""Segments against the single-file layout: what an append costs, and what many small
persists do to a datastore.

Two measurements, each run by this checkout and, with --baseline-python, by another
checkout's Python (for example main before segments, whose writers rewrite the whole file):

1. Appending 1% to a 100 M-token datastore: time and bytes written. The datastore is built
   once per layout under --out from pre-tokenized synthetic documents (Zipf-distributed ids,
   exponent 1.2, over the default model's 49,152-token vocabulary, in 2,000-token documents;
   seed 0) and copied before each append, so every run starts from the same files.
2. 100 small persists (100 tokens each, as the draft service persists learned outputs) on a
   1.4 MB datastore (200 documents of 1,000 random ids): size, the time of each append, and
   the time to open the datastore before and after.

Each run happens in a subprocess of the given Python, which imports its own checkout's
redraft and times the call alone. "Bytes written" are the sizes of the files that are new
after the call (a rewritten file is a new file); "write calls" is the kernel's count of
bytes the process passed to write(2) (/proc/self/io wchar), a cross-check.

Usage: python -m tools.bench_segments [--out bench-out/segments] [--tokens 100000000]
       [--baseline-python OTHER_CHECKOUT/.venv/bin/python] [--skip-large]
Prints Markdown tables and writes results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tools import harness

VOCAB = 49152
FINGERPRINT = "sha256:synthetic-zipf-bench"
DOC_TOKENS = 2000

# Runs inside the Python under test: only the API both layouts share.
_WORKER = r"""
import json, os, sys, time
import numpy as np
from redraft.datastore import Reader, append_corpus, build_datastore

op, out, data = sys.argv[1], sys.argv[2], sys.argv[3]
FP, VOCAB = "sha256:synthetic-zipf-bench", 49152


def docs(prefix):
    tokens = np.load(prefix + ".tokens.npy", mmap_mode="r")
    offsets = np.load(prefix + ".offsets.npy")
    for i in range(len(offsets) - 1):
        yield np.asarray(tokens[offsets[i]:offsets[i + 1]], dtype=np.int64)


def wchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def open_ms(repeat=21):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        Reader(out).close()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeat // 2] * 1e3


result = {}
w0, t0 = wchar(), time.perf_counter()
if op == "build":
    build_datastore(None, out, documents=docs(data), fingerprint=FP, vocab_size=VOCAB)
elif op == "append":
    append_corpus(None, out, documents=docs(data), fingerprint=FP, corpus="more")
elif op == "persists":
    rng = np.random.default_rng(1)
    base = [rng.integers(0, VOCAB, size=1000) for _ in range(200)]
    build_datastore(None, out, documents=base, fingerprint=FP, vocab_size=VOCAB)
    result["open_ms_before"] = open_ms()
    result["bytes_before"] = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    times = []
    for _ in range(int(data)):
        doc = rng.integers(0, VOCAB, size=100)
        t = time.perf_counter()
        append_corpus(None, out, documents=[doc], fingerprint=FP, corpus="learned")
        times.append(time.perf_counter() - t)
    result["append_s"] = times
    result["open_ms_after"] = open_ms()
    with Reader(out) as r:
        result["shards"] = len(r.manifest["shards"])
        result["segments"] = len(r.manifest.get("segments", [None]))
result["seconds"] = time.perf_counter() - t0
result["wchar"] = wchar() - w0
print(json.dumps(result))
"""


def synthetic(prefix: Path, n_tokens: int, seed: int) -> None:
    """Zipf-distributed ids under a random permutation of the vocabulary, in documents."""
    if Path(f"{prefix}.tokens.npy").exists():
        return
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(1.2, size=n_tokens), VOCAB) - 1
    tokens = rng.permutation(VOCAB).astype(np.uint16)[ranks]
    offsets = np.arange(0, n_tokens + 1, DOC_TOKENS, dtype=np.int64)
    if offsets[-1] != n_tokens:
        offsets = np.append(offsets, n_tokens)
    np.save(f"{prefix}.tokens.npy", tokens)
    np.save(f"{prefix}.offsets.npy", offsets)


def run(python: str, op: str, out: Path, data: str) -> dict:
    p = subprocess.run([python, "-c", _WORKER, op, str(out), data], capture_output=True,
                       text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if p.returncode:
        sys.exit(f"{python} {op} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def files(d: Path) -> dict[str, tuple[int, int]]:
    """name -> (inode, size) of every file of a datastore directory."""
    return {f: ((d / f).stat().st_ino, (d / f).stat().st_size) for f in os.listdir(d)}


def written(before: dict, after: dict) -> int:
    return sum(size for name, (ino, size) in after.items() if before.get(name, (None,))[0] != ino)


def size(d: Path) -> int:
    return sum(s for _, s in files(d).values())


def large(label: str, python: str, out: Path, tokens: int) -> dict:
    base = out / f"base-{label}"
    if not base.exists():
        print(f"[{label}] building the {tokens:,}-token datastore (once)", file=sys.stderr)
        built = run(python, "build", base, str(out / "docs"))
        (out / f"build-{label}.json").write_text(json.dumps(built))
    built = json.loads((out / f"build-{label}.json").read_text())
    work = out / f"work-{label}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work)
    before = files(work)
    print(f"[{label}] appending 1%", file=sys.stderr)
    res = run(python, "append", work, str(out / "more"))
    after = files(work)
    row = {"build_s": built["seconds"], "size_before": size(base), "append_s": res["seconds"],
           "bytes_written": written(before, after), "wchar": res["wchar"],
           "size_after": size(work)}
    shutil.rmtree(work)
    return row


def persists(label: str, python: str, out: Path, n: int) -> dict:
    work = out / f"persist-{label}"
    shutil.rmtree(work, ignore_errors=True)
    print(f"[{label}] {n} small persists", file=sys.stderr)
    res = run(python, "persists", work, str(n))
    res["size_after"] = size(work)
    shutil.rmtree(work)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-out/segments")
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--baseline-python", default=None,
                    help="the Python of another checkout (e.g. main before segments)")
    ap.add_argument("--persists", type=int, default=100)
    ap.add_argument("--skip-large", action="store_true", help="only the small persists")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [("segments", sys.executable)]
    if args.baseline_python:
        runs.insert(0, ("baseline", args.baseline_python))
    run = harness.Run()  # the machine (cores, load before and after), commit, command
    results: dict = {"tokens": args.tokens}
    if not args.skip_large:
        synthetic(out / "docs", args.tokens, seed=0)
        synthetic(out / "more", args.tokens // 100, seed=1)
        results["large"] = {label: large(label, py, out, args.tokens) for label, py in runs}
    results["persists"] = {label: persists(label, py, out, args.persists) for label, py in runs}
    run.write(out / "results.json", results)

    mb = 1e6
    if "large" in results:
        print(f"\nAppending 1% ({args.tokens // 100:,} tokens) to a {args.tokens:,}-token "
              "datastore\n")
        print("| layout | build | size | append | bytes written | write calls | size after |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for label, r in results["large"].items():
            print(f"| {label} | {r['build_s']:.1f} s | {r['size_before'] / mb:,.0f} MB | "
                  f"{r['append_s']:.2f} s | {r['bytes_written'] / mb:,.1f} MB | "
                  f"{r['wchar'] / mb:,.1f} MB | {r['size_after'] / mb:,.0f} MB |")
    print(f"\n{args.persists} persists of 100 tokens on a 1.4 MB datastore\n")
    print("| layout | size before | size after | first append | median | last 10 (median) "
          "| slowest | open before | open after | shards | segments |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in results["persists"].items():
        t = np.array(r["append_s"]) * 1e3
        print(f"| {label} | {r['bytes_before'] / mb:.2f} MB | {r['size_after'] / mb:.2f} MB | "
              f"{t[0]:.0f} ms | {np.median(t):.0f} ms | {np.median(t[-10:]):.0f} ms | "
              f"{t.max():.0f} ms | {r['open_ms_before']:.2f} ms | {r['open_ms_after']:.2f} ms | "
              f"{r['shards']} | {r['segments']} |")
    rec = run.record()
    print(f"\nload average before/after: {rec['load_average'][0]:.2f} / "
          f"{rec['load_average_end'][0]:.2f}; {time.strftime('%Y-%m-%d %H:%M')}")


if __name__ == "__main__":
    main()
