"""Forward time per tree size on stock vs packed CPU kernels (the README's kernel table).

Uses `CostModel.measure` (the budget logic's own measurement: the fastest of several
interleaved rounds over a 128-token cached prefix), alternating the two kinds of kernel for
`--repeats` measurements each and keeping each size's fastest, so a busy spell on a shared
machine does not land on one kind only. Packed means packed for every forward here (no
per-size choice).

    python -m tools.bench_kernels --threads 1
"""

from __future__ import annotations

import argparse
import sys

import torch

SIZES = (1, 2, 3, 4, 8, 16, 32, 64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from redraft.decoder.budget import CostModel
    from redraft.decoder.models.loading import load_model

    model, _ = load_model(args.model, device="cpu", dtype="float32")
    curves: dict[str, CostModel] = {}
    for _ in range(args.repeats):
        for kind in ("stock", "packed"):
            curve = CostModel.measure(model, SIZES, rounds=args.rounds,
                                      packed_kernels=kind == "packed", choose_kernels=False)
            best = curves.get(kind)
            curves[kind] = curve if best is None else CostModel(
                list(SIZES), [min(a, b) for a, b in zip(best.seconds, curve.seconds)])
    print("| tokens per forward | " + " | ".join(str(n) for n in SIZES) + " |")
    print("|---|" + "---:|" * len(SIZES))
    for kind, curve in curves.items():
        label = "`F.linear` (stock), ms" if kind == "stock" else "packed oneDNN, ms"
        print(f"| {label} | " + " | ".join(f"{s * 1e3:.1f}" for s in curve.seconds) + " |")
    for kind, curve in curves.items():
        rel = ", ".join(f"{n}: {curve.relative(n):.2f}" for n in SIZES[1:])
        print(f"{kind}, relative to one token: {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
