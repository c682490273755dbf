"""bfloat16 on a CPU, end to end on the default model: speculative greedy output is exactly
the plain greedy output in bfloat16, through every drafter (the verifier's exact forwards
make each tree row compute what a one-token forward computes, so even the frequent bfloat16
ties cannot flip); against Hugging Face's `generate` in bfloat16 a difference is allowed only
at a near-tie of the bfloat16 rule, counted and reported."""

from __future__ import annotations

import pytest
import torch
from redraft.decoder.budget import CostModel
from redraft.decoder.drafters.registry import build_drafter
from redraft.decoder.generate import Generator
from redraft.decoder.kernels import can_pack

from .conftest import CODE_PROMPTS, CPU_COST, have_default_model
from .test_generate import assert_same_or_near_tie, check_drafter_against_plain, hf_generate

NEW = 40

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN without bfloat16"),
]


@pytest.fixture(scope="module")
def bf16_model():
    if not have_default_model():
        pytest.skip("default model package not installed (make install)")
    from redraft.decoder.models.loading import load_model

    return load_model(None, device="cpu", dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_plain(bf16_model):
    model, tok = bf16_model
    gen = Generator(model, tok, None, cost=CostModel(*CPU_COST))
    assert gen.verifier.exact and gen.verifier.kernels is not None
    return {p: gen.generate(p, max_new_tokens=NEW) for p in CODE_PROMPTS}


@pytest.mark.parametrize("which", ["pld", "rest", "recycle", "pld,rest,recycle", "medusa",
                                   "hybrid", "fallback", "draft-model", "lookahead"])
def test_bf16_speculative_greedy_is_exactly_plain(bf16_model, bf16_plain, code_datastore,
                                                   which):
    def identical(result, reference) -> None:
        assert result.tokens == reference.tokens, (which, result.prompt_ids)

    check_drafter_against_plain(bf16_model, code_datastore, which, identical, bf16_plain)


def test_bf16_early_exit_draft_model_and_a_fixed_big_tree_are_exactly_plain(bf16_model,
                                                                              bf16_plain):
    """The target's own first layers drafting (shared packed layers), and 64-node trees: many
    rows per forward, deep ones past the exact attention's cached body."""
    model, tok = bf16_model
    for which, options, cost in (("draft-model", {"draft_model": "skip:20"}, CPU_COST),
                                 ("pld,recycle", {}, None)):
        drafter = build_drafter(which, model=model, tokenizer=tok, options=options)
        curve = CostModel(*cost) if cost else CostModel.flat(64)
        gen = Generator(model, tok, drafter, cost=curve)
        for prompt in CODE_PROMPTS:
            assert gen.generate(prompt, max_new_tokens=NEW).tokens == \
                bf16_plain[prompt].tokens, (which, prompt)
        drafter.close()


def test_bf16_plain_decoding_matches_hf_generate_but_at_near_ties(bf16_model, bf16_plain):
    """Hugging Face's own bfloat16 loop (stock kernels, bfloat16 attention) rounds otherwise:
    where its tokens differ, the first difference must be a bfloat16 near-tie."""
    identical = sum(assert_same_or_near_tie(bf16_model[0], bf16_plain[p],
                                            hf_generate(bf16_model, bf16_plain[p]))
                    for p in CODE_PROMPTS)
    print(f"identical to Hugging Face bfloat16 generate: {identical}/{len(CODE_PROMPTS)}")


def test_bf16_on_the_dense_copy_speculative_greedy_is_exactly_plain(bf16_model):
    """The dense copy (`block_weights=False`: packed oneDNN) keeps its own exactness: the
    default model verified on it, speculative against plain on the same kernels."""
    model, tok = bf16_model
    plain = Generator(model, tok, None, cost=CostModel(*CPU_COST), block_weights=False)
    assert not plain.verifier.on_blocks and plain.verifier.exact
    drafter = build_drafter("pld,recycle", model=model, tokenizer=tok)
    spec = Generator(model, tok, drafter, cost=CostModel(*CPU_COST), block_weights=False)
    for prompt in CODE_PROMPTS[:2]:
        want = plain.generate(prompt, max_new_tokens=NEW).tokens
        assert spec.generate(prompt, max_new_tokens=NEW).tokens == want, prompt
