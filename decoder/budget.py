"""Sizing each step's tree to the hardware.

A tree forward of N tokens costs cost(N) seconds; a tree whose nodes have path probabilities
p_i yields 1 + sum(p_i) tokens in expectation. Each step keeps the k best nodes that
maximise (1 + sum of their p_i) / cost(k + 1). On a CPU cost grows quickly with N (on the
default model 64 tokens cost about 3x one), on a GPU it is nearly flat up to ~64, so the same
rule drafts little on one and a lot on the other. The cost curve is measured once per
(model, device, dtype, threads, kernels) and cached on disk, then kept honest by the forwards
the decoder times anyway (`CostModel.observe`): a curve measured while the machine was busy
is corrected within a few dozen steps and written back, instead of staying pessimistic.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from redraft.decoder.policy import best_prefix
from redraft.decoder.verify import TreeVerifier
from redraft.proto.files import cache_root, write_cache
from redraft.proto.tree import Tree

# Dense at small sizes: CPU matrix kernels are not smooth there (on the default model with one
# thread, 3 tokens cost more than 4: small-M GEMMs fall back to slower paths; the block
# kernel's few-rows path ends at 14 rows, so 15 costs a step more than 14).
DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 15, 16, 24, 32, 48, 64)
MAX_TREE_NODES = 256  # the largest fixed tree (`CostModel.flat`) a command accepts


@dataclass
class CostModel:
    """Forward time as a function of the number of tokens fed (root + tree nodes)."""

    sizes: list[int]
    seconds: list[float]
    device: str = "cpu"
    # Drafting at all must promise this much more speed: a tree forward has fixed overheads
    # (mask, drafter call, acceptance) and calibrated probabilities are estimates.
    min_gain: float = 0.03
    # Where the curve came from: "given", "cached" (read from `path`) or "measured" (just now,
    # in `measure_seconds`); `path` is the cache file that corrections are written back to.
    source: str = "given"
    measure_seconds: float = 0.0
    path: Path | None = None
    # Online correction (`observe`): timed forwards per curve point before a re-estimate, and
    # the disagreement beyond which the re-estimate replaces the point.
    window: int = 8
    tolerance: float = 0.15
    corrections: int = 0
    frozen: bool = False  # a fixed curve (`flat`): timed forwards do not correct it

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes or self.sizes[0] != 1:
            raise ValueError("a cost curve needs matching sizes/seconds starting at size 1")
        # Deliberately not forced monotone: where a bigger forward is really cheaper (kernel
        # quirks), `select` simply prefers the bigger tree. Noise is kept out by measuring
        # the minimum of several interleaved rounds instead.
        self.sizes, self.seconds = list(self.sizes), list(self.seconds)  # corrected in place
        self._base = list(self.seconds)  # the curve as measured or loaded
        self._factors: dict[int, float] = {}  # point index -> observed / base
        self._recent: dict[int, list[float]] = {}
        self._saved_corrections = 0

    def cost(self, n: int) -> float:
        """Seconds for a forward of n tokens, interpolated (linearly extrapolated past the end)."""
        xs, ys = self.sizes, self.seconds
        if n <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if n <= xs[i]:
                t = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + t * (ys[i] - ys[i - 1])
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
        return ys[-1] + slope * (n - xs[-1])

    @classmethod
    def flat(cls, nodes: int) -> CostModel:
        """A curve on which up to `nodes` tree nodes cost what one token does, so every step
        verifies the best `nodes` nodes drafted, as on a GPU, where a forward of a few dozen
        rows costs about one of a single row. Tokens per forward then measure the drafts at
        a fixed tree size (as papers report them), whatever this machine's curve; its wall
        clock still pays for every row."""
        if nodes < 1:
            raise ValueError(f"a fixed tree needs at least one node, got {nodes}")
        return cls([1, nodes + 1], [1.0, 1.0], "flat", source="flat", frozen=True)

    def relative(self, n: int) -> float:
        return self.cost(n) / self.cost(1)

    @property
    def max_nodes(self) -> int:
        """Largest tree the curve covers (tree nodes, the root excluded)."""
        return self.sizes[-1] - 1

    def select(self, tree: Tree, max_nodes: int | None = None, overhead: float = 0.0,
               fixed: int = 0) -> list[int]:
        """Indices of the best-node prefix that maximises expected tokens per second.

        `overhead` is the decoding loop's own time per step (drafting, acceptance, cache
        compaction), paid whatever the tree's size: it makes a step dearer than its
        forward alone, and so makes a bigger tree relatively cheaper. `fixed` rows (a
        drafter's side rows) are in the forward whatever is kept: they count in its cost and
        in `max_nodes`, never in the expected tokens.
        """
        if not len(tree):
            return []
        cap = (self.max_nodes if max_nodes is None else max_nodes) - fixed
        limit = max(0, min(len(tree), cap))
        order = tree.best_nodes()[:limit]
        pp = tree.path_probs()
        best_k, _ = best_prefix((pp[node] for node in order), self.cost, self.min_gain,
                                overhead, fixed)
        return sorted(order[:best_k])

    def choose(self, tree: Tree, max_nodes: int | None = None, overhead: float = 0.0,
               fixed: int = 0) -> Tree:
        """The sub-tree `select` picks."""
        keep = self.select(tree, max_nodes, overhead, fixed)
        return tree if len(keep) == len(tree) else tree.subset(keep)

    # -- keeping it honest ------------------------------------------------------------------

    def observe(self, n: int, seconds: float) -> None:
        """Correct the curve from one timed forward of n tokens.

        A forward counts for the curve point nearest its size (rescaled along the curve's
        shape). Once `window` forwards have accumulated there, their fastest (as `measure`
        keeps the fastest of several rounds: load only ever adds time) replaces the point
        when the two disagree by more than `tolerance`. Points no forward has reached move
        by the factor of their observed neighbours, so the sizes decoding actually uses
        correct the whole curve.
        """
        if self.frozen or not seconds > 0 or n < 1:
            return
        i = min(range(len(self.sizes)), key=lambda j: abs(math.log(self.sizes[j] / n)))
        recent = self._recent.setdefault(i, [])
        recent.append(seconds * self.cost(self.sizes[i]) / self.cost(n))
        if len(recent) < self.window:
            return
        fresh = min(recent)
        recent.clear()
        if self.seconds[i] > 0 and abs(fresh / self.seconds[i] - 1.0) <= self.tolerance:
            return
        self._factors[i] = fresh / self._base[i] if self._base[i] > 0 else 1.0
        observed = sorted(self._factors)
        for j in range(len(self.sizes)):
            k = bisect.bisect_left(observed, j)
            if k < len(observed) and observed[k] == j or k == 0:
                factor = self._factors[observed[k]]
            elif k == len(observed):
                factor = self._factors[observed[-1]]
            else:  # between two observed points: interpolate their factors
                a, b = observed[k - 1], observed[k]
                t = (j - a) / (b - a)
                factor = self._factors[a] + t * (self._factors[b] - self._factors[a])
            self.seconds[j] = self._base[j] * factor
        self.corrections += 1

    def save(self) -> None:
        """Write the curve back to its cache file if forwards have corrected it since."""
        if self.path is None or self.corrections == self._saved_corrections:
            return
        write_cache(self.path, _json_writer(self.to_json()))
        self._saved_corrections = self.corrections

    def describe(self) -> dict:
        """Where the curve came from and what it says (for benchmark summaries)."""
        return {"source": self.source, "measure_seconds": round(self.measure_seconds, 2),
                "corrections": self.corrections, "sizes": self.sizes,
                "seconds": [round(s, 5) for s in self.seconds],
                "base_seconds": [round(s, 5) for s in self._base]}

    # -- measuring and caching -------------------------------------------------------------

    def to_json(self) -> dict:
        return {"sizes": self.sizes, "seconds": self.seconds, "device": self.device}

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        return cls([int(s) for s in data["sizes"]], [float(s) for s in data["seconds"]],
                   str(data.get("device", "cpu")))

    @classmethod
    def measure(
        cls, model, sizes: Sequence[int] = DEFAULT_SIZES, prefix: int = 128, rounds: int = 5,
        packed_kernels: bool = True, choose_kernels: bool = True, block_weights: bool = True,
    ) -> CostModel:
        """Time one forward of n tokens over a cached prefix, for each n (on the verifier's
        `cost_clock`, as decoding's own forwards are timed).

        Sizes are interleaved round by round and the minimum is kept: on a shared machine
        noise only ever adds time, so the fastest of a few runs is the best estimate of the
        intrinsic cost, and interleaving keeps a busy spell from skewing one size. With
        `choose_kernels` the verifier picks packed or stock kernels per size as decoding
        does (its first rounds try both), so each size gets the faster kind's time;
        without it, packed kernels run every forward where they apply.
        """
        verifier = TreeVerifier(model, packed_kernels, choose_kernels,
                                block_weights=block_weights)
        vocab = int(model.config.vocab_size)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (prefix + max(sizes),), generator=gen).tolist()
        verifier.prefill(ids[:prefix])
        best = {n: float("inf") for n in sizes}
        for rnd in range(rounds + 1):
            for n in sizes:
                verifier.tree_forward(ids[prefix], Tree.chain(ids[prefix + 1 : prefix + n]))
                verifier.commit([])
                if rnd:  # round 0 warms up allocations and kernels
                    best[n] = min(best[n], verifier.last_forward_cost)
        return cls(list(sizes), [best[n] for n in sizes], verifier.device.type)

    @classmethod
    def for_model(
        cls, model, name: str, directory: Path | None = None, packed_kernels: bool = True,
        choose_kernels: bool = True, block_weights: bool = True,
    ) -> CostModel:
        """The cached curve for this model on this device and kernels, measured on first use."""
        # which forward runs (lean or modules, packed or stock, exact or batched attention):
        # a curve measured on one says little about another
        kernels = TreeVerifier(model, packed_kernels, choose_kernels,
                               block_weights=block_weights).kind
        p = next(model.parameters())
        cfg = model.config
        key_src = json.dumps(
            [name, type(model).__name__, getattr(cfg, "num_hidden_layers", None),
             getattr(cfg, "hidden_size", None), getattr(cfg, "vocab_size", None),
             str(p.device.type), str(p.dtype), torch.get_num_threads(),
             torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else "", kernels]
        )
        key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
        path = (directory or cache_root() / "costs") / f"{key}.json"
        try:
            curve = cls.from_json(json.loads(path.read_text()))
            curve.source = "cached"
        except (OSError, ValueError, KeyError, TypeError):
            start = time.perf_counter()
            curve = cls.measure(model, packed_kernels=packed_kernels,
                                choose_kernels=choose_kernels, block_weights=block_weights)
            curve.source, curve.measure_seconds = "measured", time.perf_counter() - start
            write_cache(path, _json_writer(curve.to_json()))
        curve.path = path
        return curve


def _json_writer(data: dict):
    text = json.dumps(data)
    return lambda tmp: tmp.write_text(text)
