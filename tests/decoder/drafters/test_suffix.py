"""The `suffix` drafter: arctic-inference's SuffixDecoding trees behind redraft's Drafter
interface, lossless in the loop and learning across generations as vLLM's `suffix` does."""

from __future__ import annotations

import pytest
from redraft.decoder.budget import CostModel
from redraft.decoder.drafters.registry import build_drafter
from redraft.decoder.generate import Generator
from redraft.proto.models import load_tokenizer
from redraft.proto.tree import path_probs

from ..conftest import tiny_model

pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference not built")
from redraft.decoder.drafters.suffix import SuffixDrafter  # noqa: E402


def test_drafts_a_repeat_in_the_prompt_as_a_tree_of_per_node_probabilities():
    d = SuffixDrafter(max_depth=8)
    prompt = [5, 6, 7, 8, 9, 10, 11, 2, 3, 5, 6, 7]
    d.begin(prompt)
    tree = d.propose(prompt, budget=16)
    tree.validate()
    # what followed 5 6 7 the first time, as long as the match (vLLM's spec factor 1)
    assert tree.tokens == [8, 9, 10]
    assert set(tree.sources) == {"suffix"} and tree.match_len == 3
    assert all(0 < p <= 1 for p in tree.probs)
    # 5 6 7 was seen twice, followed by 8 once: SuffixDecoding's path estimate 0.5 at every
    # node, redraft's per-node probabilities 0.5 then certain
    assert tree.probs == pytest.approx([0.5, 1.0, 1.0])
    assert path_probs(tree.probs, tree.parents)[:3] == pytest.approx([0.5] * 3)
    assert len(d.propose(prompt, budget=2)) == 2  # the budget caps the nodes
    assert len(d.propose([40, 41], budget=16)) == 0  # nothing matches: no draft
    d.end()


def test_a_finished_generation_is_drafted_for_the_next():
    d = SuffixDrafter()
    d.begin([1, 2, 3])
    d.update([20, 21, 22, 23, 24])
    d.end()
    d.begin([9, 9, 20, 21])  # a new request whose context meets the last output
    assert d.propose([9, 9, 20, 21], budget=8).tokens == [22, 23]  # a match of 2: 2 drafts
    d.end()


def test_suffix_drafts_are_lossless_and_cut_forwards_on_a_repeated_request():
    model = tiny_model("llama", vocab=64, init=0.3)
    tok = load_tokenizer(None)
    flat = CostModel.flat(63)
    want = Generator(model, tok, None, cost=flat).generate([5, 9, 14, 3], max_new_tokens=30,
                                                          eos=False)
    gen = Generator(model, tok, build_drafter("suffix"), cost=flat)
    first = gen.generate([5, 9, 14, 3], max_new_tokens=30, eos=False)
    again = gen.generate([5, 9, 14, 3], max_new_tokens=30, eos=False)
    assert first.tokens == want.tokens and again.tokens == want.tokens
    assert again.stats.steps < first.stats.steps  # the first answer, drafted from the tree
    assert again.stats.accepted.get("suffix", 0) > 0
