"""Prompt lookup on hand-made contexts: matches, merging of occurrences, budgets, increments."""

from __future__ import annotations

import random

import pytest
from redraft.datastore.drafting.prompt_lookup import PromptLookup, match_confidence, prompt_lookup
from redraft.proto.tree import PLD


def paths(draft):
    """Every root-to-node token path of a draft, as tuples."""
    out = []
    for i, parent in enumerate(draft.parents):
        out.append((out[parent] if parent >= 0 else ()) + (draft.tokens[i],))
    return set(out)


def test_copies_continuation_of_single_earlier_match():
    ctx = [10, 11, 12, 13, 14, 15, 99, 10, 11, 12]
    d = prompt_lookup(ctx, budget=16, max_depth=16)
    d.validate()
    assert d.match_len == 3
    assert d.sources == [PLD] * len(d)
    assert (13, 14, 15, 99, 10, 11, 12) in paths(d)  # copies up to the context's end
    assert d.parents[0] == -1 and d.tokens[0] == 13


def test_several_occurrences_form_a_tree_longest_match_first():
    # "1 2 3" is followed by 4 twice and by 7 once; the longer match "0 1 2 3" -> 4.
    ctx = [0, 1, 2, 3, 4, 5, 8, 1, 2, 3, 7, 7, 9, 0, 1, 2, 3, 4, 6, 9, 0, 1, 2, 3]
    d = prompt_lookup(ctx, budget=32, max_depth=4)
    d.validate()
    roots = {d.tokens[i]: d.probs[i] for i, p in enumerate(d.parents) if p < 0}
    assert set(roots) == {4, 7}
    assert roots[4] > roots[7]
    assert d.match_len == 5  # "9 0 1 2 3" occurred before (followed by 4 6 9)
    ps = paths(d)
    assert (4, 6, 9, 0) in ps and (4, 5, 8, 1) in ps and (7, 7, 9, 0) in ps
    assert max(len(p) for p in ps) <= 4


def test_no_match_gives_empty_draft():
    assert len(prompt_lookup([1, 2, 3, 4, 5])) == 0
    assert len(prompt_lookup([])) == 0
    assert len(prompt_lookup([1, 2, 1, 3], budget=0)) == 0


def test_min_ngram_excludes_short_matches():
    ctx = [5, 6, 1, 9, 9, 1]
    assert len(prompt_lookup(ctx, min_ngram=1)) > 0
    assert len(prompt_lookup(ctx, min_ngram=2)) == 0


def test_budget_keeps_best_nodes_and_tree_is_valid():
    rng = random.Random(1)
    ctx = [rng.randrange(6) for _ in range(3000)]
    for budget in (1, 5, 16, 64):
        d = prompt_lookup(ctx, budget=budget, max_depth=8)
        d.validate()
        assert 0 < len(d) <= budget
        path = d.path_probs()
        assert all(0 < p <= 1 for p in d.probs)
        full = prompt_lookup(ctx, budget=10_000, max_depth=8)
        worst_kept = min(path)
        dropped = sorted(full.path_probs(), reverse=True)[len(d):]
        assert all(p <= worst_kept + 1e-12 for p in dropped)


def test_longer_matches_give_more_confident_drafts():
    assert match_confidence(1) < match_confidence(2) < match_confidence(8) < 1
    follow = [1, 2, 3, 4, 5, 6, 7, 8]
    short = prompt_lookup([52, *follow, 0, 52], max_depth=8)  # a 1-token match
    long = prompt_lookup([50, 51, 52, *follow, 0, 50, 51, 52], max_depth=8)  # 3 tokens
    assert short.tokens == long.tokens == follow  # both draft all that followed
    assert all(s < x for s, x in zip(short.path_probs(), long.path_probs()))


def test_incremental_extend_equals_one_shot():
    rng = random.Random(7)
    ctx = [rng.randrange(20) for _ in range(600)]
    pl = PromptLookup()
    pos = 0
    while pos < len(ctx):
        step = rng.randrange(1, 6)
        pl.extend(ctx[pos : pos + step])
        pos += step
        assert pl.propose(24, 10) == prompt_lookup(ctx[:pos], budget=24, max_depth=10)


def test_bad_parameters_raise():
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        PromptLookup(min_ngram=0)
