"""When to merge segments: a tiered policy, so that neither a commit's cost nor a reader's
open time grows with the number of commits before it.

Every append and every learned persist adds a segment. Left alone, a thousand persists of a
few hundred tokens would leave a thousand segments (each with its own per-shard bucket
table of vocab_size + 2 entries: 196 KB at a 49,152-token vocabulary, whatever the shard's
size) and every lookup would search a thousand shards. So, after each commit, segments are
grouped by size tier (tier 0 below FLOOR_TOKENS; tier t >= 1 holds [FLOOR * F^(t-1),
FLOOR * F^t) with F = TIER_FACTOR) and:

- adjacent tier-0 segments merge as soon as there are two: a small commit merges at most
  FLOOR_TOKENS tokens, so its cost stays bounded while the datastore keeps growing;
- TIER_FACTOR adjacent segments of tier <= t (t >= 1) merge into one, the oldest first,
  if the merge is balanced (no segment holds more than half of it: a big segment is never
  rewritten to absorb a few small ones; a small one left between two bigger ones joins
  their merge);
- nothing that would exceed MAX_MERGE_TOKENS merges: big corpus segments are never rewritten
  by small commits.

Only adjacent segments merge, so global document ids never change (a merged segment holds
its inputs' documents in order, deleted ones as empty documents). Segments hold at most
about (TIER_FACTOR - 1) per tier plus one tier-0 segment: O(log of the data) in all.
"""

from __future__ import annotations

FLOOR_TOKENS = 1 << 16
TIER_FACTOR = 8
MAX_MERGE_TOKENS = 1 << 27


def size(segment: dict) -> int:
    """A segment's token-array length: tokens plus one separator per document id."""
    return int(segment["n_tokens"]) + int(segment["n_docs"])


def tier(tokens: int) -> int:
    t, bound = 0, FLOOR_TOKENS
    while tokens >= bound:
        t += 1
        bound *= TIER_FACTOR
    return t


def plan(segments: list[dict]) -> list[list[int]]:
    """Runs of consecutive segment indexes to merge, each into one segment (none: [])."""
    groups: list[list[int]] = [[i] for i in range(len(segments))]
    sizes = [size(s) for s in segments]
    while True:
        run = _next_run(sizes)
        if run is None:
            break
        a, b = run
        groups[a:b] = [[i for g in groups[a:b] for i in g]]
        sizes[a:b] = [sum(sizes[a:b])]
    return [g for g in groups if len(g) > 1]


def _next_run(sizes: list[int]) -> tuple[int, int] | None:
    """[a, b) of the first merge the policy asks for, or None."""
    tiers = [tier(s) for s in sizes]
    for t in range(max(tiers, default=0) + 1):
        need = 2 if t == 0 else TIER_FACTOR
        i = 0
        while i < len(sizes):
            if tiers[i] > t:
                i += 1
                continue
            j = i
            while j < len(sizes) and tiers[j] <= t:
                j += 1
            # a run [i, j) of segments of tier <= t: tier 0 merges whole, others the
            # oldest window of TIER_FACTOR that stays within the bound
            if t == 0 and j - i >= need:
                return i, j
            for a in range(i, j - need + 1) if t else ():
                total = sum(sizes[a:a + need])
                if total <= MAX_MERGE_TOKENS and 2 * max(sizes[a:a + need]) <= total:
                    return a, a + need
            i = j
    return None
