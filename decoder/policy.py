"""The drafting policy the decoding loop and the engine adapters share: torch-free.

- `Calibrator`: the drafters' probabilities are estimates; it corrects them online from what
  the target actually accepted (per source, binned by the predicted probability), so a
  drafter whose guesses never hit is soon given a budget of zero: with nothing accepted,
  decoding costs no more than plain decoding plus the drafter's own (small) lookup time.
- `best_prefix`: how many of the best drafted nodes to verify, the prefix that maximises
  expected tokens per second under a forward-cost function, if it beats plain decoding by
  `min_gain`.

Why a module of its own: the loop (`generate`, `budget`) needs torch, the engines'
adapters (`redraft.decoder.engines`) run inside serving engines that may not have it, and
both must decide by the same rule. It imports nothing of redraft but `proto`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from redraft.proto.files import cache_root, write_cache
from redraft.proto.tree import Tree


def calibration_path(model_name: str, drafter_name: str, directory: Path | None = None) -> Path:
    """Where the calibration of one drafter combination on one model is kept (under
    `directory`, by default the cache root)."""
    key = hashlib.sha256(f"{model_name}|{drafter_name}".encode()).hexdigest()[:16]
    return Path(directory or cache_root()) / "calibration" / f"{key}.json"


def best_prefix(path_probs: Iterable[float], cost: Callable[[int], float], min_gain: float,
                overhead: float = 0.0, fixed: int = 0) -> tuple[int, float]:
    """(k, expected): the number of nodes, taken best first with these path probabilities,
    that maximises expected tokens per second, (1 + sum of their path probabilities) /
    (cost(1 + fixed + k) + overhead), and that sum; (0, 0.0) when no prefix beats plain
    decoding, 1 / (cost(1 + fixed) + overhead), by `min_gain`.

    `overhead` is the caller's own time per step, paid whatever the size; `fixed` rows are in
    every forward (a drafter's side rows) and count in its cost, never in the expected tokens.
    """
    plain = cost(1 + fixed) + overhead
    best_k, best_rate, best_expected, expected = 0, 1.0 / plain, 0.0, 0.0
    for k, p in enumerate(path_probs, start=1):
        expected += p
        rate = (1.0 + expected) / (cost(1 + fixed + k) + overhead)
        if rate > best_rate:
            best_k, best_rate, best_expected = k, rate, expected
    if best_rate * plain < 1.0 + min_gain:
        return 0, 0.0
    return best_k, best_expected


class Accepted(Protocol):
    """What `Calibrator.observe` reads of an acceptance (the loop's `Acceptance`)."""

    nodes: list[int]  # the accepted nodes of the verified tree


@dataclass
class _Bins:
    """Hit / trial counts per predicted-probability bin, seeded with a weak prior."""

    hits: list[float]
    trials: list[float]
    observed_hits: int = 0
    observed_trials: int = 0


@dataclass
class Calibrator:
    """Maps a drafter's predicted acceptance probability to the observed one, per source."""

    bins: int = 10
    prior_weight: float = 2.0
    _table: dict[str, _Bins] = field(default_factory=dict)

    def _get(self, source: str) -> _Bins:
        table = self._table.get(source)
        if table is None:
            centers = [(i + 0.5) / self.bins for i in range(self.bins)]
            table = _Bins([c * self.prior_weight for c in centers], [self.prior_weight] * self.bins)
            self._table[source] = table
        return table

    def _bin(self, p: float) -> int:
        return min(self.bins - 1, max(0, int(p * self.bins)))

    def calibrated(self, probs: Sequence[float], sources: Sequence[str]) -> list[float]:
        """The calibrated probability of each (drafter's probability, source)."""
        out = []
        for p, src in zip(probs, sources):
            t = self._get(src)
            b = self._bin(p)
            out.append(t.hits[b] / t.trials[b])
        return out

    def apply(self, tree: Tree) -> Tree:
        """A copy of the tree whose probs are the calibrated ones."""
        return Tree(tree.tokens, tree.parents, self.calibrated(tree.probs, tree.sources),
                    tree.sources)

    def observe(self, raw: Tree, verified: Tree, acc: Accepted) -> None:
        """Record, for every verified node whose parent was accepted, whether it was accepted.

        `raw` holds the drafter's original probs for the same nodes as `verified`.
        """
        accepted = set(acc.nodes)
        for i, parent in enumerate(verified.parents):
            if parent < 0 or parent in accepted:
                self._count(raw.probs[i], raw.sources[i], i in accepted)

    def observe_chain(self, probs: Sequence[float], sources: Sequence[str],
                      accepted: int) -> None:
        """`observe` for a chain (each node the parent of the next; drafter's probabilities)
        whose first `accepted` nodes were accepted: every node up to the first miss was
        tried."""
        for j, (p, src) in enumerate(zip(probs, sources)):
            if j > accepted:
                break
            self._count(p, src, j < accepted)

    def _count(self, p: float, source: str, hit: bool) -> None:
        t = self._get(source)
        b = self._bin(p)
        t.trials[b] += 1.0
        t.observed_trials += 1
        if hit:
            t.hits[b] += 1.0
            t.observed_hits += 1

    # -- persistence: a new process starts from what earlier runs learned ----------------

    def to_json(self) -> dict:
        return {src: {"hits": t.hits, "trials": t.trials} for src, t in self._table.items()}

    def load(self, path: Path) -> bool:
        """Merge in saved counts (a missing or damaged file is ignored)."""
        try:
            data = json.loads(Path(path).read_text())
            for src, t in data.items():
                if len(t["hits"]) == len(t["trials"]) == self.bins:
                    self._table[str(src)] = _Bins([float(h) for h in t["hits"]],
                                                  [float(n) for n in t["trials"]])
            return True
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    def save(self, path: Path, max_trials: float = 500.0) -> None:
        """Write the counts, scaled down per bin past `max_trials` so old runs fade out."""
        data = {}
        for src, t in self._table.items():
            hits, trials = [], []
            for h, n in zip(t.hits, t.trials):
                f = min(1.0, max_trials / n) if n > 0 else 1.0
                hits.append(h * f)
                trials.append(n * f)
            data[src] = {"hits": hits, "trials": trials}
        text = json.dumps(data)
        write_cache(path, lambda tmp: tmp.write_text(text))

    def rate(self, source: str) -> float:
        """Observed acceptance rate of the source's verified nodes (0 before any)."""
        t = self._get(source)
        return t.observed_hits / t.observed_trials if t.observed_trials else 0.0
