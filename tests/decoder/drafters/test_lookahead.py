"""Lookahead decoding: the Jacobi window as side rows (the paper's attention pattern), side rows
that leave the draft tree's logits untouched, the n-gram pool, and lossless greedy output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from redraft.decoder.budget import CostModel
from redraft.decoder.drafter import MergedDrafter, UnknownDrafter
from redraft.decoder.drafters.lookahead import SOURCE, LookaheadDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.generate import Generator
from redraft.decoder.verify import TreeVerifier, tree_mask_rows
from redraft.proto.models import load_tokenizer
from redraft.proto.tree import Tree, join

from ..conftest import tiny_model

FLAT = CostModel.flat(63)
PROMPT = [5, 9, 13, 7, 22, 5, 9]


def test_window_rows_see_what_the_lookahead_mask_allows():
    """Guess (level l, column j) attends to the root, level 0 up to column j, and its own
    column's guesses above it; its position is j + l + 1 after the root."""
    d = LookaheadDrafter(window=4, ngram=4)
    d.levels = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    side = d.side_rows([1, 2, 3])
    rows = tree_mask_rows(side)  # rows[i + 1]: the rows node i sees (0 = the root)
    tokens = [0, *side.tokens]
    for level in range(3):
        for j in range(4):
            node = level * 4 + j
            seen = sorted(tokens[r] for r in rows[node + 1])
            column = [10 * (lv + 1) + j for lv in range(1, level + 1)]
            expected = [0, *range(10, 10 + j + 1), *column]
            assert seen == sorted(expected), (level, j)
            assert side.depths()[node] == j + level + 1


def test_side_rows_leave_the_trees_logits_unchanged():
    model = tiny_model("llama", init=0.3)
    verifier = TreeVerifier(model)
    tree = Tree([3, 4, 5, 6], [-1, 0, 0, 2], [0.5] * 4, ["x"] * 4)
    side = Tree([7, 8, 9, 10], [-1, 0, 1, 0], [0.0] * 4, ["w"] * 4)
    verifier.prefill(PROMPT[:-1])
    alone = verifier.tree_forward(PROMPT[-1], tree).logits
    verifier.commit([0])
    verifier.prefill(PROMPT[:-1])
    both = verifier.tree_forward(PROMPT[-1], join(tree, side)).logits
    verifier.commit([0])
    assert torch.allclose(both[:5], alone, atol=1e-5)
    assert verifier.cached_len == len(PROMPT) + 1  # side rows left with the rejected nodes


def test_jacobi_levels_and_the_pool():
    d = LookaheadDrafter(window=2, ngram=3, guesses=2)
    d.levels = [[10, 11]]
    d.observe_side(np.array([[0], [0], [20], [21]]), None)  # warming up: a second level
    assert d.levels == [[10, 11], [20, 21]] and not d.pool
    d.observe_side(np.array([[0], [0], [0], [0], [30], [31]]), None)
    assert d.levels == [[20, 21], [30, 31]]
    assert list(d.pool[10]) == [(20, 30)] and list(d.pool[11]) == [(21, 31)]
    d._remember(10, (20, 40))
    d._remember(10, (25, 26))  # the oldest of more than G n-grams goes
    assert list(d.pool[10]) == [(20, 40), (25, 26)]
    tree = d.propose([1, 10], budget=8)
    assert sorted(zip(tree.parents, tree.tokens)) == [(-1, 20), (-1, 25), (0, 40), (1, 26)]
    assert tree.sources == [SOURCE] * 4 and sum(tree.probs[:2]) == pytest.approx(1.0)
    assert len(d.propose([1, 10], budget=1)) == 1 and not len(d.propose([1, 99], budget=8))


@pytest.mark.parametrize("init", [0.02, 0.1, 0.3])
def test_greedy_output_is_plain_greedy(init):
    model = tiny_model("llama", init=init)
    tok = load_tokenizer(None)
    plain = Generator(model, tok, None, cost=FLAT)
    drafter = LookaheadDrafter(window=4, ngram=3, guesses=4)
    spec = Generator(model, tok, drafter, cost=FLAT)
    merged = Generator(model, tok, MergedDrafter([PLDDrafter(), LookaheadDrafter()]), cost=FLAT)
    steps = tokens = 0
    for prompt in (PROMPT, [3, 4, 5, 6]):
        ref = plain.generate(prompt, max_new_tokens=60, eos=False)
        for gen in (merged, spec):
            got = gen.generate(prompt, max_new_tokens=60, eos=False)
            assert got.tokens == ref.tokens and got.stats.drafter_errors == 0
        steps += got.stats.steps  # lookahead alone
        tokens += got.stats.new_tokens
    assert drafter.pool  # the window produced n-grams
    assert tokens / steps > 1.2  # and they were accepted (random models repeat themselves)


def test_bad_settings_are_refused():
    for w, n, g in ((0, 3, 4), (4, 1, 4), (4, 3, 0)):
        with pytest.raises(UnknownDrafter, match="lookahead needs"):
            LookaheadDrafter(w, n, g)
