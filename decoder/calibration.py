"""Correcting the drafters' probabilities from what the target accepted.

The drafters' probabilities are estimates. `Calibrator` corrects them online from what the
target actually accepted (per source, binned by the predicted probability), so a drafter
whose guesses never hit is soon given a budget of zero: with nothing accepted, decoding
costs no more than plain decoding plus the drafter's own (small) lookup time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from redraft.decoder.acceptance import Acceptance
from redraft.proto.files import cache_root, write_cache
from redraft.proto.tree import Tree


def calibration_path(model_name: str, drafter_name: str) -> Path:
    """Where the calibration of one drafter combination on one model is kept."""
    key = hashlib.sha256(f"{model_name}|{drafter_name}".encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"{key}.json"


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

    def apply(self, tree: Tree) -> Tree:
        """A copy of the tree whose probs are the calibrated ones."""
        probs = []
        for p, src in zip(tree.probs, tree.sources):
            t = self._get(src)
            b = self._bin(p)
            probs.append(t.hits[b] / t.trials[b])
        return Tree(tree.tokens, tree.parents, probs, tree.sources)

    def observe(self, raw: Tree, verified: Tree, acc: Acceptance) -> None:
        """Record, for every verified node whose parent was accepted, whether it was accepted.

        `raw` holds the drafter's original probs for the same nodes as `verified`.
        """
        accepted = set(acc.nodes)
        for i, parent in enumerate(verified.parents):
            if parent >= 0 and parent not in accepted:
                continue
            t = self._get(raw.sources[i])
            b = self._bin(raw.probs[i])
            t.trials[b] += 1.0
            t.observed_trials += 1
            if i in accepted:
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
