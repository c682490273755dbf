"""The merge policy: bounded segment counts and bounded work per commit, ids never move."""

from __future__ import annotations

from redraft.datastore import tiers


def _seg(tokens: int, docs: int = 1) -> dict:
    return {"n_tokens": tokens - docs, "n_docs": docs}


def _apply(segments: list[dict], groups: list[list[int]]) -> tuple[list[dict], int]:
    """The segments after merging `groups`, and the tokens the merges rewrote."""
    rewritten = 0
    for g in reversed(groups):
        assert g == list(range(g[0], g[-1] + 1)), "only adjacent segments merge"
        merged = _seg(sum(tiers.size(segments[i]) for i in g), sum(segments[i]["n_docs"]
                                                                      for i in g))
        rewritten += tiers.size(merged)
        segments[g[0]:g[-1] + 1] = [merged]
    return segments, rewritten


def test_tiers():
    assert tiers.tier(0) == tiers.tier(tiers.FLOOR_TOKENS - 1) == 0
    assert tiers.tier(tiers.FLOOR_TOKENS) == 1
    assert tiers.tier(tiers.FLOOR_TOKENS * tiers.TIER_FACTOR - 1) == 1
    assert tiers.tier(tiers.FLOOR_TOKENS * tiers.TIER_FACTOR) == 2


def test_small_commits_stay_few_segments_and_bounded_work():
    """5,000 commits of 100 tokens after a big corpus: the corpus segment is never
    rewritten, the segments stay few, and no commit rewrites more than a few tiers' worth."""
    big = _seg(50_000_000)
    segments = [big]
    most, worst = 0, 0
    for _ in range(5000):
        segments.append(_seg(100))
        segments, rewritten = _apply(segments, tiers.plan(segments))
        assert segments[0] is big
        most = max(most, len(segments))
        worst = max(worst, rewritten)
    assert most <= 1 + (tiers.TIER_FACTOR - 1) * 2 + 2
    assert worst <= tiers.FLOOR_TOKENS * tiers.TIER_FACTOR * 2  # never the whole store
    assert sum(tiers.size(s) for s in segments) == 50_000_000 + 5000 * 100


def test_nothing_merges_past_the_bound_and_stranded_small_segments_merge_in_a_tier():
    huge = _seg(tiers.MAX_MERGE_TOKENS)
    assert tiers.plan([huge, huge]) == []
    assert tiers.plan([_seg(10), huge, _seg(10)]) == []  # not adjacent: ids must not move
    assert tiers.plan([_seg(10), _seg(20), huge, _seg(5), _seg(7), _seg(9)]) == [[0, 1],
                                                                               [3, 4, 5]]
    mid = _seg(tiers.FLOOR_TOKENS)
    run = [mid] * (tiers.TIER_FACTOR - 1)
    assert tiers.plan(run) == []
    assert tiers.plan([*run, mid]) == [list(range(tiers.TIER_FACTOR))]
    # a small segment stranded between two tier-1 ones merges with them in tier 1
    mixed = [mid, _seg(10), *[mid] * (tiers.TIER_FACTOR - 2)]
    assert tiers.plan(mixed) == [list(range(tiers.TIER_FACTOR))]
