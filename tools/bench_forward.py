"""The verifier's forward against the floor of the bytes it reads, per stage, at 1..64 rows.

On the CPU at hand and in one run: the bytes of weights one forward reads (the GGUF's blocks,
or the dense copy in the model's dtype), this core's measured read bandwidth (a sum over a
512 MB array, the same threads), the floor those give, the block kernel's multiply-add rate
on weights in cache (a forward of many rows cannot beat its multiply-adds at that rate: the
floor at n rows is the larger of the two), and the forward's time split into its
linear layers, its attention and the rest (norms, rotary, the cache, Python), for the block
kernel and the dense packed kernels, interleaved round by round (the fastest round kept:
noise only adds time). At one thread every time is this thread's CPU time (as the cost curve
reads it): a shared machine's descheduling does not count, its memory traffic does. Each
forward verifies a tree of branches up to DEPTH deep, as drafts are, over a cached prefix.

    python -m tools.bench_forward --threads 1
    python -m tools.bench_forward --threads 1 --dtype float32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

SIZES = (1, 2, 4, 8, 16, 32, 64)
DEPTH = 8  # the trees' branches: a draft tree's shape, not one 64-deep chain


def tree(tokens: list[int]):
    """Branches of up to DEPTH nodes each hanging from the root: n - 1 drafted nodes."""
    from redraft.proto.tree import Tree

    parents = [-1 if i % DEPTH == 0 else i - 1 for i in range(len(tokens))]
    return Tree(list(tokens), parents, [0.5] * len(tokens), ["bench"] * len(tokens))


def read_bandwidth(seconds: float = 1.0) -> float:
    """Bytes per second one sum over a 512 MB float32 array reads (the best of a few)."""
    data = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds or best == float("inf"):
        t = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t)
    return data.numel() * 4 / best


def multiply_rate(dtype: torch.dtype, threads: int, seconds: float = 1.0) -> float | None:
    """Multiply-adds per second the block kernel reaches at 64 rows over weights that stay in
    cache (dense rows in the activations' dtype, so nothing is dequantized): what this core's
    dot-product units allow, the floor of a forward of many rows. None without a fast path."""
    from redraft.decoder import block_linear
    from redraft.decoder.native import _blocks

    if not block_linear.fast(dtype):
        return None
    fmt, kind = ((_blocks.BF16, _blocks.KIND_BF16) if dtype == torch.bfloat16
                 else (_blocks.F32, _blocks.KIND_F32))
    m, n, k, calls = 64, 256, 576, 10
    w, x = torch.randn(n, k).to(dtype), torch.randn(m, k).to(dtype)
    y = torch.empty(m, n, dtype=dtype)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds or best == float("inf"):
        t = cpu_clock()
        for _ in range(calls):
            _blocks.matmul(x.data_ptr(), m, k, w.data_ptr(), fmt, n, y.data_ptr(), kind, threads)
        best = min(best, cpu_clock() - t)
    return m * n * k * calls / best


def cpu_clock() -> float:
    """This thread's CPU time at one torch thread, else the wall clock."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


class Timed:
    """A stage's callable, its time added to a shared clock."""

    def __init__(self, inner, clock: dict, stage: str) -> None:
        self.inner, self.clock, self.stage = inner, clock, stage

    def __call__(self, *args):
        t = cpu_clock()
        out = self.inner(*args)
        self.clock[self.stage] += cpu_clock() - t
        return out

    def __getattr__(self, name):  # the attention strategy's `prepare`, a linear's `refresh`
        return getattr(self.inner, name)


def instrument(verifier, clock: dict) -> None:
    """Time the verifier's linear layers and attention (the lean forward only; its layers
    through the Python loop, the compiled one being a single call)."""
    stack = verifier.runner.stack
    stack.compiled_layers = False
    stack.lm_head = Timed(stack.lm_head, clock, "linear")
    for layer in stack.layers:
        for name in ("qkv", "out", "gate_up", "down"):
            setattr(layer, name, Timed(getattr(layer, name), clock, "linear"))
    run = stack.run
    stack.run = lambda tokens, positions, attention: run(
        tokens, positions, Timed(attention, clock, "attention"))


def weights(verifier) -> tuple[int, int]:
    """Bytes of weights one forward of the verifier reads, and one row's multiply-adds
    through its linear layers (the LM head included)."""
    nbytes = macs = 0
    for linear in verifier.runner.stack.linears:
        run = getattr(linear, "run", linear)
        weight = getattr(run, "weight", None)
        if hasattr(weight, "nbytes") and not isinstance(weight, torch.Tensor):
            nbytes, macs = nbytes + weight.nbytes, macs + weight.n * weight.k  # a BlockWeight
        else:
            nbytes += sum(m.weight.numel() * m.weight.element_size() for m in linear.modules)
            macs += sum(m.weight.numel() for m in linear.modules)
    return nbytes, macs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None, help="the model's dtype (default: auto)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=128, help="cached tokens before each forward")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from redraft.decoder import block_linear
    from redraft.decoder.bench.driver import machine_state
    from redraft.decoder.models.loading import load_model
    from redraft.decoder.verify import TreeVerifier

    model, _ = load_model(args.model, device="cpu", dtype=args.dtype)
    dtype = next(model.parameters()).dtype
    kinds = {"blocks": TreeVerifier(model), "blocks, Python layer loop": TreeVerifier(model),
             "dense": TreeVerifier(model, block_weights=False)}
    if "blocks" not in kinds["blocks"].kind:  # no blocks for this model, or no fast path
        del kinds["blocks"], kinds["blocks, Python layer loop"]
    # an AMX CPU also has the AVX512-BF16 path: the same blocks on it, side by side
    paths = {}
    if "blocks" in kinds and dtype == torch.bfloat16 and block_linear.kernel_path(dtype) == "amx":
        kinds["blocks, avx512bf16 path"] = TreeVerifier(model)
        paths["blocks, avx512bf16 path"] = "avx512bf16"
    clocks = {k: {"linear": 0.0, "attention": 0.0} for k in kinds}
    for kind, v in kinds.items():
        if kind == "blocks, Python layer loop" or kind == "dense":  # the rest: totals only
            instrument(v, clocks[kind])
    ids = torch.randint(0, int(model.config.vocab_size), (args.prefix + max(SIZES),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    best: dict[tuple[str, int], dict[str, float]] = {}
    for v in kinds.values():
        v.prefill(ids[: args.prefix])
    for rnd in range(args.rounds + 1):
        for n in SIZES:
            for kind, v in kinds.items():
                clock = clocks[kind]
                clock.update(linear=0.0, attention=0.0)
                with block_linear.on_path(dtype, paths.get(kind)):
                    t = cpu_clock()
                    v.tree_forward(ids[args.prefix], tree(ids[args.prefix + 1 : args.prefix + n]))
                    total = cpu_clock() - t
                    v.commit([])
                stages = {"total": total, "linear": clock["linear"],
                          "attention": clock["attention"],
                          "rest": total - clock["linear"] - clock["attention"]}
                if rnd and ((kind, n) not in best or total < best[(kind, n)]["total"]):
                    best[(kind, n)] = stages  # round 0 warms up
    bandwidth = read_bandwidth()
    rate = multiply_rate(dtype, args.threads)
    state = machine_state()
    print(f"{dtype}, {args.threads} thread(s), block kernel path "
          f"{block_linear.kernel_path(dtype) if block_linear.supports(dtype) else '-'}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s; the kernel's multiply-adds on cached "
          f"weights {f'{rate / 1e9:.1f} G/s' if rate else '-'}")
    report: dict = {"dtype": str(dtype), "threads": args.threads, "bandwidth": bandwidth,
                    "multiply_rate": rate, "machine": state, "kinds": {}}
    for kind, v in kinds.items():
        nbytes, macs = weights(v)
        floor = nbytes / bandwidth
        # a forward of n rows reads the weights once and multiplies n times: the floor is
        # the larger of the two (the compute one from the block kernel's own rate)
        floors = {n: max(floor, n * macs / rate if rate else 0.0) for n in SIZES}
        print(f"\n{kind}: {nbytes / 1e6:.1f} MB of weights per forward, bytes floor "
              f"{floor * 1e3:.1f} ms; {macs / 1e6:.0f} M multiply-adds per row")
        print("| rows | forward ms | floor ms | x floor | x one row | linear ms | attention ms "
              "| rest ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        one = best[(kind, 1)]["total"]
        for n in SIZES:
            s = best[(kind, n)]
            split = ("| - | - | - |" if kind not in ("blocks, Python layer loop", "dense") else
                     f"| {s['linear'] * 1e3:.1f} | {s['attention'] * 1e3:.1f} | "
                     f"{s['rest'] * 1e3:.1f} |")
            print(f"| {n} | {s['total'] * 1e3:.1f} | {floors[n] * 1e3:.1f} | "
                  f"{s['total'] / floors[n]:.2f} | {s['total'] / one:.2f} {split}")
        report["kinds"][kind] = {"bytes": nbytes, "floor": floor, "multiply_adds": macs,
                                 "floors": floors, "verifier": v.kind,
                                 "sizes": {n: best[(kind, n)] for n in SIZES}}
    print(f"\nmachine: {json.dumps(state)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
