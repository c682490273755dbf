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
# share one packed copy: layer -> (stamp of what was packed, packed forward).
_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _packed_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    global _packed_calls
    _packed_calls += 1
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pack(module: torch.nn.Linear) -> functools.partial:
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), _PACK_ROWS)
    bias = None if module.bias is None else module.bias.detach()
    return functools.partial(_packed_forward, weight=packed, bias=bias)


def _stamp(module: torch.nn.Linear) -> tuple:
    """Identity and in-place version of a layer's parameters."""
    w, b = module.weight, module.bias
    return (w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version))


def _packed(module: torch.nn.Linear, stamp: tuple) -> functools.partial:
    """The layer's packed forward, packed again only if its weights changed since."""
    hit = _LAYERS.get(module)
    if hit is None or hit[0] != stamp:
        hit = _LAYERS[module] = (stamp, _pack(module))
    return hit[1]


def _available(model) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu" and param.dtype == torch.float32


class PackedLinears:
    """The model's `nn.Linear` layers with their weights packed for oneDNN."""

    def __init__(self, model) -> None:
        start = time.perf_counter()
        self.forwards: list[tuple[torch.nn.Linear, functools.partial]] = []
        self._stamps: list[tuple] = []  # what each packed copy was made from
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                stamp = _stamp(module)
                self.forwards.append((module, _packed(module, stamp)))
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
                self.forwards[i] = (module, _packed(module, stamp))
                self._stamps[i] = stamp
                self.pack_seconds += time.perf_counter() - start
                self.repacked += 1

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the packed kernels inside the block; the stock ones again after it.

        The instance attribute shadows the class's `forward`; it is set in the modules'
        `__dict__` directly because `nn.Module.__setattr__` costs ~1 us per call, per layer,
        per forward.
        """
        for module, forward in self.forwards:
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

    They apply to float32 models on a CPU with oneDNN; CUDA and half precision keep the
    stock kernels, which are already good there.
    """
    if not _available(model):
        return None
    if model not in _PACKED:
        try:
            _PACKED[model] = PackedLinears(model)
        except RuntimeError:  # a torch build whose oneDNN lacks the packed ops
            return None
    return _PACKED[model]
