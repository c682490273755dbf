"""What an engine adapter drafted and what its engine accepted, counted in its own process.

The draft service counts the same things (`redraft serve --metrics-port`: drafts, draft
tokens and accepted tokens by source, accepted tokens by position, with vLLM's meanings), but
only for the trees it sent and from what clients report back. An adapter knows more: which
drafts it really handed to the engine (pacing cuts chains, prompt lookup drafts while the
service is down, a datastore may be opened in the engine's own process) and what the engine
accepted of them. `AdapterCounters` holds that per adapter object, as plain ints, lists and
dicts touched only by the engine's own loop: no lock and no Prometheus object per step.
`adapter_prometheus` reads them at scrape time.

The meanings, per sequence and engine step (vLLM's `spec_decode_*`):

- drafts: steps at which the adapter handed the sequence at least one draft token;
- draft tokens: the tokens handed out, by the source that proposed each (`rest`, `pld`,
  `learned`, or a combination such as `pld+rest`);
- accepted tokens: drafted tokens the engine accepted (the bonus token the target adds is
  not a draft token), by source, and by position (0: the first draft token after the last
  accepted one; the first POSITIONS only, deeper ones in the totals);
- steps, skipped steps: engine steps (calls) the adapter saw, and those it did not ask for
  drafts at all (its pacing backed off).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

POSITIONS = 16  # accepted tokens by position 0..15, as the service counts them

# Every AdapterCounters made in this process, so that one collector can report them all.
# Kept for the life of the process (a few hundred bytes each, one per engine adapter): the
# counts of an adapter that was closed still count, so no counter ever goes back.
ALL: list[AdapterCounters] = []


class AdapterCounters:
    """One adapter's counts (see the module docstring); `engine` names the engine in labels
    ("vllm", "sglang", "llama_cpp"). Not thread-safe for writing: one engine loop counts;
    another thread may read `snapshot()` at any time."""

    __slots__ = ("engine", "steps", "skipped_steps", "drafts", "draft_tokens",
                 "accepted_tokens", "_accepted_runs")

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.steps = 0
        self.skipped_steps = 0
        self.drafts = 0
        self.draft_tokens: dict[str, int] = {}  # by source label
        self.accepted_tokens: dict[str, int] = {}  # by source label
        # accepted paths by length (the last entry: POSITIONS or longer), so that a step adds
        # one to one entry; accepted_per_pos is read from it
        self._accepted_runs = [0] * (POSITIONS + 1)
        ALL.append(self)

    def drafted(self, sources: Sequence[str]) -> None:
        """One sequence was handed drafts whose nodes came from `sources` (one label per
        node; none: nothing handed, nothing counted)."""
        if not sources:
            return
        self.drafts += 1
        tokens = self.draft_tokens
        for src in sources:
            tokens[src] = tokens.get(src, 0) + 1

    def accepted(self, sources: Sequence[str], n: int) -> None:
        """The engine accepted the first `n` draft tokens of a path whose nodes came from
        `sources` (the path handed out, root first)."""
        if n <= 0:
            return
        tokens = self.accepted_tokens
        for src in sources[:n]:
            tokens[src] = tokens.get(src, 0) + 1
        self._accepted_runs[n if n < POSITIONS else POSITIONS] += 1

    @property
    def accepted_per_pos(self) -> list[int]:
        """Accepted draft tokens at each position 0..POSITIONS-1: the paths at least that
        long."""
        runs = self._accepted_runs.copy()
        out = [0] * POSITIONS
        longer = 0  # paths longer than position i
        for i in range(POSITIONS - 1, -1, -1):
            longer += runs[i + 1]
            out[i] = longer
        return out

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.draft_tokens.values())

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_tokens.values())

    def snapshot(self) -> dict[str, Any]:
        """A consistent-enough copy for another thread (each dict and list is copied in one
        step under the interpreter lock, so no read sees a dict being resized)."""
        return {"engine": self.engine, "steps": self.steps,
                "skipped_steps": self.skipped_steps, "drafts": self.drafts,
                "draft_tokens": self.draft_tokens.copy(),
                "accepted_tokens": self.accepted_tokens.copy(),
                "accepted_per_pos": self.accepted_per_pos}


def totals(counters: Iterable[AdapterCounters]) -> dict[str, dict[str, Any]]:
    """The snapshots of `counters` added up by engine: {engine: snapshot-shaped dict}."""
    out: dict[str, dict[str, Any]] = {}
    for c in counters:
        snap = c.snapshot()
        into = out.get(snap["engine"])
        if into is None:
            out[snap["engine"]] = snap
            continue
        for key in ("steps", "skipped_steps", "drafts"):
            into[key] += snap[key]
        for key in ("draft_tokens", "accepted_tokens"):
            for src, n in snap[key].items():
                into[key][src] = into[key].get(src, 0) + n
        into["accepted_per_pos"] = [a + b for a, b in zip(into["accepted_per_pos"],
                                                          snap["accepted_per_pos"])]
    return out
