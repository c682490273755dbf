"""Building on Ray against the single-process build: throughput, CPU time, and what the
measured serial parts predict for N machines.

The input is the standard-library code datastore's (the Makefile's `stdlib-datastore`: every
.py file of the running Python's standard library, site-packages left out, bad files
skipped). For each shard size (--shard-tokens, repeatable) and round (--rounds):

1. `redraft index` as a user runs it (a subprocess of the CLI; its wall time, and its CPU
   time from the kernel's accounting of the child);
2. the same build through the Python API with `ray=ADDRESS`, on a fresh local cluster of 1
   and of 2 nodes (Ray's own `cluster_utils.Cluster`, num_cpus=1 per node, every process a
   child of this one). CPU time: this process (the driver) plus every process of the cluster
   (its daemons and workers, from /proc via psutil), and the tasks' own CPU time as they
   report it (the build's history event). Starting the cluster is timed apart.

Each Ray build's shards are compared with the single-process build's (byte for byte).

The serial parts on the driver are measured one by one (listing the inputs, loading the
tokenizer, connecting, putting the tokenizer in the object store, batching, cutting shards,
committing) so that the prediction T(N) = serial + task CPU / (N * cores) + longest task
rests on measurements; it assumes idle machines, which this one is not.

On the shared 2-core machine 2 nodes cannot show scaling: both "nodes" share the same 2
cores with everything else running there. /proc/loadavg is recorded around each run.

Usage: python -m tools.bench_ray_build [--out bench-out/ray-build] [--rounds 1]
       [--shard-tokens 1048576] [--shard-tokens 134217728] [--nodes 1 --nodes 2]
Prints a Markdown table and writes results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import psutil

from tools import harness

ROOT = Path(__file__).resolve().parents[1]
EXCLUDE = ["*/site-packages/*", "*/dist-packages/*"]


def stdlib_inputs() -> list[str]:
    return [str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py")]


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cli_build(out: Path, shard_tokens: int) -> dict:
    """`redraft index` in a child process: wall time and the child's CPU time."""
    redraft = Path(sys.executable).with_name("redraft")
    argv = [str(redraft), "index", "--tokenizer", "smollm2-135m", "--out", str(out),
            "--corpus", "stdlib", "--skip-bad", "--quiet", "--shard-tokens", str(shard_tokens)]
    for pat in EXCLUDE:
        argv += ["--exclude", pat]
    load = loadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv + stdlib_inputs(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"redraft index failed: {proc.stdout.read()}")
    proc.stdout.close()
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "load": f"{load} -> {loadavg()}"}


class TreeCpu:
    """CPU seconds of every process under this one (the cluster's daemons and workers),
    sampled every 0.2 s while inside: a worker exits when the driver disconnects, so its
    last sample is what it used (less at most one interval)."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for p in psutil.Process().children(recursive=True):
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            self.first.setdefault(p.pid, t.user + t.system)
            self.last[p.pid] = t.user + t.system

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def __enter__(self) -> TreeCpu:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def seconds(self) -> float:
        return sum(v - self.first[pid] for pid, v in self.last.items())


def start_cluster(nodes: int):
    from ray.cluster_utils import Cluster

    t0 = time.perf_counter()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 200 << 20})
    for _ in range(nodes - 1):
        c.add_node(num_cpus=1, object_store_memory=200 << 20)
    c.wait_for_nodes()
    return c, time.perf_counter() - t0


def cold_tokenizer_load() -> float:
    """Loading and fingerprinting the tokenizer in a fresh process (a build's first step)."""
    code = ("import time; from redraft.datastore.build import _tokenizer_info; "
            "t0 = time.perf_counter(); _tokenizer_info('smollm2-135m'); "
            "print(time.perf_counter() - t0)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)


def serial_parts(address: str) -> dict:
    """The driver's serial steps, each timed alone (what N machines cannot shorten)."""
    import ray
    from redraft.datastore.build import _tokenizer_info
    from redraft.datastore.corpus import expand_inputs

    t = {"load_tokenizer": cold_tokenizer_load()}
    t0 = time.perf_counter()
    paths = expand_inputs(stdlib_inputs(), EXCLUDE)
    t["list_inputs"] = time.perf_counter() - t0
    tok = _tokenizer_info("smollm2-135m")[0]  # loaded in this process: the build's is warm
    t0 = time.perf_counter()
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    t["connect"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray.put(tok.backend_tokenizer)
    t["put_tokenizer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sum(p.stat().st_size for p in paths)
    t["stat_inputs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray.shutdown()
    t["disconnect"] = time.perf_counter() - t0
    t["n_files"] = len(paths)
    return t


def ray_build(out: Path, shard_tokens: int, nodes: int) -> dict:
    from redraft.datastore import build_datastore

    cluster, start_s = start_cluster(nodes)
    try:
        serial = serial_parts(cluster.address)
        load = loadavg()
        drv0 = time.process_time()
        with TreeCpu() as cpu:
            t0 = time.perf_counter()
            m = build_datastore(stdlib_inputs(), out, tokenizer="smollm2-135m",
                                corpus="stdlib", exclude=EXCLUDE, skip_bad=True,
                                shard_tokens=shard_tokens, ray=cluster.address)
            wall = time.perf_counter() - t0
            drv = time.process_time() - drv0
    finally:
        cluster.shutdown()
    cluster_cpu = cpu.seconds
    event = m["build"]["history"][-1]
    return {"wall_s": wall, "cluster_start_s": start_s, "driver_cpu_s": drv,
            "cluster_cpu_s": cluster_cpu, "cpu_s": drv + cluster_cpu, "ray": event["ray"],
            "write_s": event["seconds"], "serial_s": serial, "load": f"{load} -> {loadavg()}"}


def commit_time(out: Path) -> float:
    """The commit alone: publishing the build's manifest again (the same bytes: nothing
    changes), under the write lock, as the build did (its segments were synced by their
    tasks)."""
    from redraft.datastore import manifest as mf
    from redraft.datastore.commit import write_lock

    m, _ = mf.read(out)
    t0 = time.perf_counter()
    with write_lock(out):
        mf.publish(out, m)
    return time.perf_counter() - t0


def same_shards(a: Path, b: Path) -> bool:
    from redraft.datastore import Reader
    from redraft.datastore import format as fmt

    with Reader(a) as ra, Reader(b) as rb:
        sa, sb = ra.manifest["shards"], rb.manifest["shards"]
        return len(sa) == len(sb) and all(
            bytes(ra.shard_raw(x["id"], w)) == bytes(rb.shard_raw(y["id"], w))
            for x, y in zip(sa, sb) for w in fmt.SHARD_KEYS)


def predict(run: dict, n_machines: int, cores: int) -> float:
    """Seconds for the build on N idle machines of `cores` CPUs: the driver's serial steps,
    the tasks' CPU time spread over every core, and the longest task (the tail)."""
    s = run["serial_s"]
    serial = (s["list_inputs"] + s["load_tokenizer"] + s["connect"] + s["put_tokenizer"]
              + s["stat_inputs"] + s["disconnect"] + run["ray"]["driver_s"]["plan"]
              + run["commit_s"])
    tasks = sum(run["ray"]["cpu_s"].values())
    return serial + tasks / (n_machines * cores) + run["ray"]["longest_task"]["cpu_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/ray-build"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shard-tokens", type=int, action="append")
    ap.add_argument("--nodes", type=int, action="append")
    args = ap.parse_args()
    shard_sizes = args.shard_tokens or [1 << 20, 128 << 20]
    node_counts = args.nodes or [1, 2]
    tmp = tempfile.mkdtemp(prefix="ray")  # Ray's socket paths must stay under 108 bytes
    os.environ.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    os.environ.pop("RAY_ADDRESS", None)
    args.out.mkdir(parents=True, exist_ok=True)
    header = harness.Run()  # cores, load, commit, Python, platform, the command
    results = {"memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "runs": []}
    try:
        for rnd in range(args.rounds):
            for shard in shard_sizes:
                ref = args.out / f"single-{shard}"
                shutil.rmtree(ref, ignore_errors=True)
                run = {"round": rnd, "shard_tokens": shard, "how": "redraft index",
                       **cli_build(ref, shard)}
                run.update(_sizes(ref))
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
                for nodes in node_counts:
                    out = args.out / f"ray{nodes}-{shard}"
                    shutil.rmtree(out, ignore_errors=True)
                    run = {"round": rnd, "shard_tokens": shard, "how": f"ray, {nodes} node(s)",
                           **ray_build(out, shard, nodes)}
                    run.update(_sizes(out))
                    run["commit_s"] = commit_time(out)
                    run["identical_to_single"] = same_shards(out, ref)
                    results["runs"].append(run)
                    print(json.dumps(run), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    header.write(args.out / "results.json", results)
    print(table(results))


def _sizes(out: Path) -> dict:
    from redraft.datastore import Reader

    with Reader(out) as r:
        m = r.manifest
        return {"n_tokens": m["n_tokens"], "n_docs": m["n_docs"], "n_shards": m["n_shards"],
                "n_segments": m["n_segments"]}


def table(results: dict) -> str:
    rows = ["| shard tokens | build | wall s | tokens/s | CPU s (tasks) | cluster start s | "
            "load before -> after | identical |", "|---|---|---:|---:|---:|---:|---|---|"]
    for r in results["runs"]:
        tasks = f" ({sum(r['ray']['cpu_s'].values()):.1f})" if "ray" in r else ""
        rows.append(
            f"| {r['shard_tokens']:,} | {r['how']} | {r['wall_s']:.1f} | "
            f"{r['n_tokens'] / r['wall_s']:,.0f} | {r['cpu_s']:.1f}{tasks} | "
            f"{r.get('cluster_start_s', 0):.1f} | {r['load']} | "
            f"{'yes' if r.get('identical_to_single', True) else 'NO'} |")
    sizes = sorted({r["shard_tokens"] for r in results["runs"]})
    preds = ["", "Predicted for N idle machines x C cores (from the last Ray run of each shard "
             "size: its serial steps, task CPU and longest task):", "",
             "| machines x cores | " + " | ".join(f"{s:,}-token shards: s, tokens/s"
                                                  for s in sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    last = {r["shard_tokens"]: r for r in results["runs"] if "ray" in r}
    for n, c in ((1, 2), (4, 2), (16, 8), (64, 16)):
        cells = []
        for size in sizes:
            if size in last:
                t = predict(last[size], n, c)
                cells.append(f"{t:.1f} s, {last[size]['n_tokens'] / t:,.0f}")
            else:
                cells.append("-")
        preds.append(f"| {n} x {c} | " + " | ".join(cells) + " |")
    return "\n".join(rows + preds)


if __name__ == "__main__":
    sys.exit(main())
