"""Faster linear layers for CPU verification: oneDNN matmuls over pre-packed weights.

On a CPU a decoding forward is bound by streaming the weights from memory, and the default
`F.linear` path handles few-row inputs poorly: on the default model with one thread, 2 or 3
rows cost 1.5-2x one row, so a small draft tree is barely cheaper than decoding its tokens one
by one. oneDNN's inner product over weights packed once into its blocked layout streams
each weight once for any small row count: on the default model a one-token forward runs
about 1.5x faster and a 16-token one about 2x faster than with `F.linear`, which is what
makes trees pay on a CPU.

That gain depends on the machine's state, not only on the code. While other processes stream
memory through the shared caches (another model's inference or training), the packed kernels
lose it at one or two rows (measured here: a one-token forward 10-20% *slower* than
`F.linear`) and keep it from about four rows up. `KernelChoice` therefore picks, per forward
size, whichever kind ran faster recently, from the forwards' own CPU times.

The packed kernels are switched on only inside `PackedLinears.active()`, per module, so the
same model object still runs stock kernels elsewhere (e.g. Hugging Face's own `generate`
in the benchmark). Results differ from `F.linear` only in the last bits, like any change of
matmul blocking; the lossless checks compare against plain greedy decoding either way.

bfloat16 weights pack the same way (oneDNN's bf16 inner product, float32 accumulation
inside): on a CPU with bf16 units (`cpu_has_bf16`) it is the fastest linear layer at every
row count, 1.6-2x faster than float32 packed. Its rows are batch-invariant for two rows and
more, but a one-row call may round differently (a 1536-wide reduction did, in about 0.02%
of outputs): `exact` forwards run a single row as two (`min_rows`), which costs about nothing
at that size, so a row's outputs never depend on how many rows share the call.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Iterator

import torch

# The row count oneDNN tunes the packed layout for; measured flat from 2 to 64 here.
_PACK_ROWS = 8
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Layer calls that really ran on packed weights, process-wide: the verifier and the benchmark
# read it to report which kernels a forward used, rather than which ones were asked for.
_packed_calls = 0


def packed_calls() -> int:
    """Linear-layer calls run on packed weights so far in this process."""
    return _packed_calls


# Per layer, so that models sharing layers (a draft model made of the target's first layers)
# share one packed copy: first layer -> {layers' ids: (stamp of what was packed, packed
# weight and bias)}.
_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX units). oneDNN also
    offers bf16 on other AVX-512 CPUs, by emulation: correct, but slower than float32."""
    cpu = torch.cpu
    try:
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):  # a torch build without these probes
        return False


def can_pack(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether weights of this dtype on this device can run on packed oneDNN kernels."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False


def run_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               min_rows: int = 1) -> torch.Tensor:
    """x W^T + b on packed weights; fewer than `min_rows` rows run as `min_rows` copies of
    the first (the multi-row kernel's rounding, see the module docstring)."""
    global _packed_calls
    _packed_calls += 1
    rows = x.numel() // x.shape[-1]
    if rows >= min_rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    flat = x.reshape(1, x.shape[-1]).expand(min_rows, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return y[:1].reshape(*x.shape[:-1], y.shape[-1])


def _pack(modules: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights side by side (output rows one layer after another), packed."""
    weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else \
        modules[0].weight.detach()
    biases = [m.bias for m in modules]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
    return packed, bias


def _stamp(module: torch.nn.Linear) -> tuple:
    """Identity and in-place version of a layer's parameters."""
    w, b = module.weight, module.bias
    return (w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version))


def _packed(modules: tuple[torch.nn.Linear, ...], stamp: tuple) -> tuple:
    """The layers' packed weights, packed again only if their weights changed since. Kept
    per first layer, so that models sharing layers (a draft model made of the target's first
    layers) share one packed copy."""
    entries = _LAYERS.setdefault(modules[0], {})
    key = tuple(id(m) for m in modules)
    hit = entries.get(key)
    if hit is None or hit[0] != stamp:
        hit = entries[key] = (stamp, _pack(modules))
    return hit[1]


class PackedFused:
    """Linear layers run as one packed matmul: their outputs side by side (the lean forward's
    fused query/key/value and gate/up projections), or a single layer's."""

    def __init__(self, modules, min_rows: int = 1) -> None:
        self.modules = tuple(modules)
        self.min_rows = min_rows
        self.stamp = tuple(_stamp(m) for m in self.modules)
        self.weight, self.bias = _packed(self.modules, self.stamp)

    def refresh(self) -> bool:
        """Re-pack if a layer's weights were replaced or changed in place; True if it did."""
        stamp = tuple(_stamp(m) for m in self.modules)
        if stamp == self.stamp:
            return False
        self.stamp = stamp
        self.weight, self.bias = _packed(self.modules, stamp)
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return run_packed(x, self.weight, self.bias, self.min_rows)


def _available(model) -> bool:
    param = next(model.parameters(), None)
    return param is not None and can_pack(param.dtype, param.device)


class PackedLinears:
    """The model's `nn.Linear` layers with their weights packed for oneDNN."""

    def __init__(self, model) -> None:
        start = time.perf_counter()
        self.forwards: list[tuple[torch.nn.Linear, functools.partial]] = []
        self._exact: list[functools.partial] = []  # the same, one row run as two
        self._stamps: list[tuple] = []  # what each packed copy was made from
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                stamp = _stamp(module)
                self._add(module, stamp)
                self._stamps.append(stamp)
        self.pack_seconds = time.perf_counter() - start  # packing, re-packing included
        self.repacked = 0  # layers packed again after their weights changed
        self.choice = KernelChoice()  # shared by every verifier of this model

    def refresh(self) -> None:
        """Re-pack any layer whose weights were replaced or changed in place since packing.

        A stale packed copy would silently compute with old weights (e.g. after loading an
        adapter). The verifier calls this once per generation, at prefill: checking every
        layer costs ~1 ms, too much for every forward.
        """
        for i, (module, _) in enumerate(self.forwards):
            stamp = _stamp(module)
            if stamp != self._stamps[i]:
                start = time.perf_counter()
                self._add(module, stamp, i)
                self._stamps[i] = stamp
                self.pack_seconds += time.perf_counter() - start
                self.repacked += 1

    def _add(self, module: torch.nn.Linear, stamp: tuple, at: int | None = None) -> None:
        weight, bias = _packed((module,), (stamp,))
        pair = (module, functools.partial(run_packed, weight=weight, bias=bias))
        exact = functools.partial(run_packed, weight=weight, bias=bias, min_rows=2)
        if at is None:
            self.forwards.append(pair)
            self._exact.append(exact)
        else:
            self.forwards[at], self._exact[at] = pair, exact

    @contextlib.contextmanager
    def active(self, exact: bool = False) -> Iterator[None]:
        """Run the packed kernels inside the block; the stock ones again after it. `exact`:
        a single row runs as two (see the module docstring).

        The instance attribute shadows the class's `forward`; it is set in the modules'
        `__dict__` directly because `nn.Module.__setattr__` costs ~1 us per call, per layer,
        per forward.
        """
        forwards = self._exact if exact else [f for _, f in self.forwards]
        for (module, _), forward in zip(self.forwards, forwards):
            module.__dict__["forward"] = forward
        try:
            yield
        finally:
            for module, _ in self.forwards:
                module.__dict__.pop("forward", None)


class KernelChoice:
    """Per forward size, the kind of kernels (packed or stock) that ran faster lately.

    Forwards are timed by the verifier (`TreeVerifier.cost_clock`: CPU time with one torch
    thread, so time spent descheduled by other processes does not count but memory stalls
    do). Each size class keeps the last `keep` times of each kind; the faster kind runs, and
    every `explore`-th forward of a class tries the other kind (every 4 × `explore`-th when it
    was more than 25% slower), so the choice follows the machine when its load changes. Sizes
    up to 4 are classes of their own (where the two kinds are closest), larger ones share a
    class per power of two.
    """

    def __init__(self, explore: int = 32, keep: int = 4) -> None:
        self.explore = explore
        self.keep = keep
        self._times: dict[tuple[int, bool], list[float]] = {}
        self._runs: dict[int, int] = {}

    @staticmethod
    def size_class(n: int) -> int:
        return n if n <= 4 else n.bit_length() + 2

    def packed(self, n: int) -> bool:
        """Whether the next forward of n rows should run on the packed kernels."""
        c = self.size_class(n)
        packed, stock = self._times.get((c, True), []), self._times.get((c, False), [])
        if len(packed) < 2 or len(stock) < 2:  # measure both kinds first, packed first
            return len(packed) < 2
        runs = self._runs[c] = self._runs.get(c, 0) + 1
        best_packed, best_stock = min(packed), min(stock)
        # a clear loser (25% slower) is retried 4x less often: trying it costs its difference
        clear = max(best_packed, best_stock) > 1.25 * min(best_packed, best_stock)
        return (best_packed <= best_stock) != (runs % (self.explore * (4 if clear else 1)) == 0)

    def record(self, n: int, packed: bool, seconds: float) -> None:
        times = self._times.setdefault((self.size_class(n), packed), [])
        times.append(seconds)
        del times[: -self.keep]

    def summary(self) -> dict[str, str]:
        """Forward sizes ("1", "5-7", ...) -> the kind they currently prefer (for reports)."""
        out = {}
        for c in sorted({c for c, _ in self._times}):
            packed, stock = self._times.get((c, True)), self._times.get((c, False))
            if packed and stock:
                sizes = str(c) if c <= 4 else f"{max(5, 1 << (c - 3))}-{(1 << (c - 2)) - 1}"
                out[sizes] = "packed" if min(packed) <= min(stock) else "stock"
        return out


def packed_linears(model) -> PackedLinears | None:
    """The model's packed layers (packed once per model), or None where they do not apply.

    They apply to float32 and bfloat16 models on a CPU with oneDNN; CUDA and float16 keep
    the stock kernels, which are already good there.
    """
    if not _available(model):
        return None
    if model not in _PACKED:
        try:
            _PACKED[model] = PackedLinears(model)
        except RuntimeError:  # a torch build whose oneDNN lacks the packed ops
            return None
    return _PACKED[model]
