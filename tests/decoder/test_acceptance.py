"""Acceptance rules: greedy follows the argmax; sampling is lossless, proven statistically on a
tiny model whose exact sequence distribution is enumerated; typical acceptance is lossy."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from redraft.datastore import build_datastore
from redraft.datastore.drafting.learned_index import LearnedIndex
from redraft.decoder.acceptance import (
    SamplingParams,
    accept_greedy,
    accept_sampling,
    target_probs,
    top_candidates,
)
from redraft.decoder.budget import CostModel
from redraft.decoder.drafter import Drafter, MergedDrafter
from redraft.decoder.drafters.datastore_drafter import DatastoreDrafter
from redraft.decoder.drafters.draft_model import DraftModelDrafter
from redraft.decoder.drafters.fallback import FallbackDrafter
from redraft.decoder.drafters.lookahead import LookaheadDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.drafters.recycle import RecycleDrafter
from redraft.decoder.generate import Generator
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint
from redraft.proto.tree import Tree

from .conftest import tiny_model

VOCAB = 5
PROMPT = [2, 3]
LENGTH = 3


class FixedTreeDrafter(Drafter):
    """Always drafts the same multi-child tree (3 root children, 2 children each)."""

    name = "fixed"

    def propose(self, context, budget):
        return Tree([0, 4, 3, 0, 4, 0, 3, 4, 3], [-1, -1, -1, 0, 0, 1, 1, 2, 2], [0.5] * 9,
                    ["fixed"] * 9)


def test_greedy_follows_argmax_then_bonus():
    tree = Tree([1, 2, 3, 4], [-1, -1, 1, 1], [0.5] * 4, ["pld"] * 4)
    logits = torch.full((5, 6), -1.0)
    logits[0, 2] = 5  # root -> 2 (node 1)
    logits[2, 4] = 5  # node 1 -> 4 (node 3)
    logits[4, 5] = 5  # node 3 -> 5 (bonus)
    acc = accept_greedy(logits, tree)
    assert acc.nodes == [1, 3] and acc.tokens == [2, 4, 5]
    logits[0] = torch.tensor([0, 0, 0, 0, 0, 9.0])
    assert accept_greedy(logits, tree).tokens == [5]


def test_target_probs_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95)


def test_a_tiny_top_p_keeps_the_top_token():
    """top_p below float32's range (1e-300 compares as 0) still keeps the most likely token:
    sampling becomes greedy, never a distribution of NaNs."""
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]]))
    for top_p in (1e-300, 1e-45, 1e-8):
        p = target_probs(logits, SamplingParams(temperature=0.7, top_p=top_p))
        assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    model = tiny_model("llama", vocab=VOCAB, init=0.3)
    gen = Generator(model, load_tokenizer(None), FixedTreeDrafter(),
                    cost=CostModel.flat(63))
    greedy = gen.generate(PROMPT, max_new_tokens=20, eos=False)
    sampled = gen.generate(PROMPT, max_new_tokens=20, eos=False, temperature=0.7, top_p=1e-300)
    assert sampled.tokens == greedy.tokens


def test_sampling_acceptance_of_a_single_node_matches_the_target():
    """Recursive rejection at one node: P(output = t) must equal p(t) for every t."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25],
                                     [0.25] * 4, [0.25] * 4]))
    tree = Tree([1, 0, 3], [-1, -1, -1], [0.5] * 3, ["x"] * 3)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0)
    n = 20000
    counts = Counter(accept_sampling(logits, tree, params, gen).tokens[0] for _ in range(n))
    for t, p in enumerate([0.4, 0.3, 0.2, 0.1]):
        assert abs(counts[t] / n - p) < 4 * math.sqrt(p * (1 - p) / n), (t, counts)


def exact_distribution(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1..xL | prompt) for every sequence, from plain sequential forwards."""
    out = {}
    with torch.inference_mode():
        for seq in itertools.product(range(VOCAB), repeat=LENGTH):
            prob = 1.0
            for i in range(LENGTH):
                logits = model(torch.tensor([PROMPT + list(seq[:i])])).logits[0, -1]
                prob *= float(target_probs(logits, params)[seq[i]])
            out[seq] = prob
    return out


def chi_square_critical(df: int, z: float = 3.72) -> float:
    """Upper critical value (z = 3.72: alpha ~ 1e-4), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: Counter, exact: dict, n: int) -> tuple[float, int]:
    """Pearson chi-square with cells of expected count < 5 pooled into one."""
    stat, df = 0.0, -1
    pooled_obs = pooled_exp = 0.0
    for seq, p in exact.items():
        e = n * p
        if e < 5:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += e
            continue
        stat += (counts.get(seq, 0) - e) ** 2 / e
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        df += 1
    return stat, df


def sample_sequences(params: SamplingParams, n: int, drafter: Drafter | None = None,
                     dtype: torch.dtype = torch.float32) -> tuple[Counter, dict, float]:
    model = tiny_model("llama", vocab=VOCAB, init=0.3).to(dtype)
    flat = CostModel.flat(63)  # a flat cost curve: the whole tree is verified
    gen = Generator(model, load_tokenizer(None), drafter or FixedTreeDrafter(), cost=flat)
    counts: Counter = Counter()
    per_step = 0.0
    for seed in range(n):
        r = gen.generate(PROMPT, max_new_tokens=LENGTH, eos=False, seed=seed,
                         temperature=params.temperature, top_p=params.top_p,
                         top_k=params.top_k, typical=params.typical)
        counts[tuple(r.tokens)] += 1
        per_step += r.stats.tokens_per_step
    return counts, exact_distribution(model, params), per_step / n


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
    ids=["t1", "t0.7-topk4-topp0.9"],
)
def test_speculative_sampling_is_lossless(params):
    n = 4000
    counts, exact, per_step = sample_sequences(params, n)
    assert per_step > 1.3, "the tree must actually be accepted for this test to mean anything"
    stat, df = chi_square(counts, exact, n)
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - p) for s, p in exact.items())
    assert stat < chi_square_critical(df), f"chi2={stat:.1f} df={df} tv={tv:.3f}"
    assert tv < 0.08  # sampling noise alone gives ~0.05 with 125 cells and n = 4000


def test_speculative_sampling_is_lossless_in_bfloat16():
    """The same in bfloat16: the target's distribution is the one its bfloat16 forwards
    give (enumerated with Hugging Face's modules), sampled through the verifier's exact
    bfloat16 forwards (packed kernels where oneDNN has them)."""
    n = 4000
    counts, exact, per_step = sample_sequences(SamplingParams(temperature=1.0), n,
                                               dtype=torch.bfloat16)
    assert per_step > 1.3, "the tree must actually be accepted for this test to mean anything"
    stat, df = chi_square(counts, exact, n)
    tv = 0.5 * sum(abs(counts.get(s, 0) / n - p) for s, p in exact.items())
    assert stat < chi_square_critical(df), f"chi2={stat:.1f} df={df} tv={tv:.3f}"
    assert tv < 0.08


def test_sampling_with_drafts_learned_from_earlier_samples_is_lossless():
    """Token recycling drafts from what the target predicted in earlier (random) generations:
    drafts that depend on past randomness must still leave the distribution unchanged."""
    n = 4000
    params = SamplingParams(temperature=1.0)
    counts, exact, per_step = sample_sequences(params, n, RecycleDrafter())
    assert per_step > 1.3, "recycled drafts must actually be accepted for this to mean anything"
    stat, df = chi_square(counts, exact, n)
    assert stat < chi_square_critical(df), f"chi2={stat:.1f} df={df}"


def test_sampling_with_learned_drafts_is_lossless(tmp_path):
    """Learned drafts copy what earlier samples of the same prompt continued with, so each
    draft depends on earlier randomness: the distribution must still be the target's."""
    path = tmp_path / "ds"
    fingerprint = tokenizer_fingerprint(load_tokenizer(None))  # the Generator's tokenizer
    build_datastore(None, path, documents=[[0]], fingerprint=fingerprint, vocab_size=VOCAB)
    drafter = DatastoreDrafter(str(path), learned=LearnedIndex())
    n = 4000
    counts, exact, per_step = sample_sequences(SamplingParams(temperature=1.0), n, drafter)
    drafter.close()
    assert drafter.learned.stats()["learned_docs"] == n  # every sample was learned
    assert per_step > 1.3, "learned drafts must actually be accepted for this to mean anything"
    stat, df = chi_square(counts, exact, n)
    assert stat < chi_square_critical(df), f"chi2={stat:.1f} df={df}"


def _medusa(model):
    from redraft.decoder.drafters.medusa import MedusaDrafter

    from .drafters.test_medusa import tiny_heads

    # heads that read the next token (the root), as the committed ones do
    return MedusaDrafter(tiny_heads(model, accuracy=[[0.5, 0.8, 1.0]] * 3, next_token=True),
                         model)


MEDUSA_DRAFTERS = {
    "medusa": _medusa,
    "hybrid": lambda model: MergedDrafter([PLDDrafter(), RecycleDrafter(), _medusa(model)]),
    "fallback": lambda model: FallbackDrafter(MergedDrafter([PLDDrafter(), RecycleDrafter()]),
                                              _medusa(model)),
}


@pytest.mark.parametrize("which", sorted(MEDUSA_DRAFTERS))
def test_sampling_with_medusa_drafts_is_lossless(which):
    """Drafts from heads on the hidden state of the last accepted row (which depends on the
    earlier samples), alone and merged with or switched against the copying drafters."""
    n = 4000
    params = SamplingParams(temperature=1.0)
    drafter = MEDUSA_DRAFTERS[which](tiny_model("llama", vocab=VOCAB, init=0.3))
    counts, exact, per_step = sample_sequences(params, n, drafter)
    assert per_step > 1.3, "the heads' drafts must actually be accepted for this to mean anything"
    stat, df = chi_square(counts, exact, n)
    assert stat < chi_square_critical(df), f"chi2={stat:.1f} df={df}"


@pytest.mark.parametrize("family", ["draft-model", "lookahead"])
def test_sampling_with_model_drafts_is_lossless(family):
    """A draft model's proposals (its greedy chain and top-k siblings: deterministic given the
    context) and Lookahead's (n-grams from Jacobi iterations, whose window rides along in
    every verification forward as side rows) leave the distribution unchanged."""
    n = 4000
    # The draft model: a separate copy of the target (random draft models rarely agree),
    # drafting to a fixed depth (how deep pays depends on timings, not on what is tested).
    drafter = (DraftModelDrafter(tiny_model("llama", vocab=VOCAB, init=0.3), top_k=2,
                                 branch_steps=2, depth=2) if family == "draft-model"
               else LookaheadDrafter(window=3, ngram=3, guesses=3))
    counts, exact, per_step = sample_sequences(SamplingParams(temperature=1.0), n, drafter)
    assert per_step > 1.2, "drafts must actually be accepted for this to mean anything"
    stat, df = chi_square(counts, exact, n)
    assert stat < chi_square_critical(df), f"chi2={stat:.1f} df={df}"


def test_typical_acceptance_is_detectably_lossy():
    """The same test has the power to catch a rule that changes the distribution."""
    n = 4000
    counts, exact, _ = sample_sequences(SamplingParams(temperature=1.0, typical=True), n)
    stat, df = chi_square(counts, exact, n)
    assert stat > chi_square_critical(df), f"chi2={stat:.1f} df={df}: typical looked lossless"


def test_top_candidates_are_the_softmax_top_k():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    ids, probs = top_candidates(logits, 4)
    want_p, want_i = torch.softmax(logits, -1).topk(4, dim=-1)
    assert ids.shape == (5, 4) and (ids == want_i.numpy()).all()
    assert np.allclose(probs, want_p.numpy(), atol=1e-6)
