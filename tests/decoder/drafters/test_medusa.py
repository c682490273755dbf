"""The Medusa drafter (sparse tree from the heads' accuracies), `fallback` and `hybrid`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from redraft.decoder.budget import CostModel
from redraft.decoder.drafter import Drafter, MergedDrafter
from redraft.decoder.drafters.fallback import FallbackDrafter, HitRate, matched_length
from redraft.decoder.drafters.medusa import MedusaDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.generate import Generator
from redraft.decoder.heads.blocks import MedusaHeads
from redraft.decoder.heads.heads_file import HeadsError
from redraft.decoder.heads.tree_shape import rank_accuracy
from redraft.proto.models import load_tokenizer
from redraft.proto.tree import Tree

from ..conftest import tiny_model

ACC = [[0.6, 0.75, 0.82, 0.86], [0.4, 0.55, 0.62, 0.66], [0.3, 0.42, 0.5, 0.55]]


def tiny_heads(model, k: int = 3, accuracy=None, seed: int = 0,
               next_token: bool = False, embed_std: float = 1.0) -> MedusaHeads:
    """Heads with random (non-zero) blocks, so their guesses differ from the next token's."""
    torch.manual_seed(seed)
    hidden = int(model.config.hidden_size)
    heads = MedusaHeads(hidden, k, meta={"accuracy": {"full": {"topk": accuracy or ACC[:k]}}},
                        next_token=next_token)
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.5)
        if block.embed is not None:
            torch.nn.init.normal_(block.embed.weight, std=embed_std)
    return heads


@pytest.mark.parametrize("next_token", [False, True])
def test_drafts_come_from_each_head_at_its_depth(next_token):
    model = tiny_model(vocab=64)
    heads = tiny_heads(model, next_token=next_token, embed_std=20.0)  # tiny embeddings
    drafter = MedusaDrafter(heads, model)
    ctx = [5, 9, 11]
    assert len(drafter.propose(ctx, 10)) == 0  # no hidden state yet
    hidden = model.base_model(input_ids=torch.tensor([ctx[:-1]])).last_hidden_state[0, -1]
    drafter.observe_hidden(ctx, hidden.detach())
    assert len(drafter.propose(ctx + [3], 10)) == 0  # a hidden state of another context
    tree = drafter.propose(ctx, 12)
    ids, _ = drafter.predictor.topk(hidden.detach(), 4, ctx[-1])  # ctx[-1] is the root
    if next_token:  # the heads read the root: another root, other guesses
        assert not np.array_equal(ids, drafter.predictor.topk(hidden.detach(), 4, 40)[0])
    s = drafter.shape
    assert len(tree) == 12 and set(tree.sources) == {"medusa"}
    for i in range(12):
        assert tree.tokens[i] == ids[s.depth[i] - 1, s.rank[i]]
        assert tree.probs[i] == pytest.approx(rank_accuracy(ACC)[s.depth[i] - 1][s.rank[i]])


def test_heads_without_recorded_accuracy_cannot_shape_a_tree():
    model = tiny_model()
    with pytest.raises(HeadsError, match="no held-out accuracy"):
        MedusaDrafter(MedusaHeads(int(model.config.hidden_size), 2), model)


def test_the_loop_hands_the_heads_the_last_accepted_rows_hidden_state():
    """Greedy decoding with Medusa drafts on a tiny model: identical to plain decoding, and
    the heads' drafts do get accepted (the loop feeds them the right hidden state)."""
    model = tiny_model("llama", vocab=5, init=0.3)
    tok = load_tokenizer(None)
    flat = CostModel.flat(63)
    plain = Generator(model, tok, None, cost=flat)
    drafter = MedusaDrafter(tiny_heads(model, accuracy=[[0.5, 0.7, 0.9, 1.0, 1.0]] * 3), model)
    spec = Generator(model, tok, drafter, cost=flat)
    for prompt in ([2, 3], [1, 4, 4, 0]):
        a = plain.generate(prompt, max_new_tokens=30, eos=False)
        b = spec.generate(prompt, max_new_tokens=30, eos=False)
        assert a.tokens == b.tokens
        assert b.stats.accepted.get("medusa", 0) > 0
        assert b.stats.steps < a.stats.steps


# -- fallback --------------------------------------------------------------------------------


class ChainDrafter(Drafter):
    """Drafts the next `n` tokens of a fixed text after the context (test fixture)."""

    def __init__(self, text: list[int], n: int, prob: float, name: str) -> None:
        self.text, self.n, self.prob, self.name = text, n, prob, name

    def propose(self, context, budget):
        i = len(context)
        return Tree.chain(self.text[i : i + min(self.n, budget)], self.prob, self.name)


def test_matched_length_walks_one_path():
    tree = Tree([1, 2, 3, 4], [-1, 0, 0, 2], [0.5] * 4, ["x"] * 4)
    assert matched_length(tree, [1, 3, 4, 9]) == (3, True)
    assert matched_length(tree, [1, 3]) == (2, False)
    assert matched_length(tree, [7]) == (0, True)
    assert matched_length(tree, [1, 2, 5]) == (2, True)


def test_hit_rate_forgets_old_steps():
    rate = HitRate()
    for _ in range(20):
        rate.record(0.0, 2.0)
    assert rate.rate < 0.01
    for _ in range(10):
        rate.record(2.0, 2.0)
    assert rate.rate > 0.85


def test_fallback_switches_to_the_source_that_hits():
    truth = list(range(100, 300))
    wrong = [t + 1 for t in truth]
    copying = ChainDrafter(wrong, 4, 0.9, "pld")  # confident and always wrong
    heads = ChainDrafter(truth, 3, 0.5, "medusa")  # modest and always right
    fb = FallbackDrafter(copying, heads)
    context = truth[:10]
    fb.begin(context)
    picks = []
    for _ in range(12):
        tree = fb.propose(context, 8)
        picks.append(tree.sources[0])
        step = truth[len(context) : len(context) + 2]  # the target accepts 1 + bonus
        context = context + step
        fb.update(step)
    assert picks[0] == "pld"  # at first each source's own claim is trusted
    assert picks[-6:] == ["medusa"] * 6
    assert fb.rates["copy"].rate < 0.2 and fb.rates["medusa"].rate > 0.8


def test_fallback_and_hybrid_are_lossless_on_greedy():
    model = tiny_model("llama", vocab=5, init=0.3)
    tok = load_tokenizer(None)
    flat = CostModel.flat(63)
    plain = Generator(model, tok, None, cost=flat)
    acc = [[0.5, 0.7, 0.9, 1.0, 1.0]] * 3
    for drafter in (FallbackDrafter(PLDDrafter(), MedusaDrafter(tiny_heads(model, accuracy=acc),
                                                                 model)),
                    MergedDrafter([PLDDrafter(), MedusaDrafter(tiny_heads(model, accuracy=acc),
                                                               model)])):
        gen = Generator(model, tok, drafter, cost=flat)
        for prompt in ([2, 3], [1, 4, 4, 0, 1, 4, 4]):
            a = plain.generate(prompt, max_new_tokens=30, eos=False)
            b = gen.generate(prompt, max_new_tokens=30, eos=False)
            assert a.tokens == b.tokens
            assert b.stats.steps < a.stats.steps


# -- the command line --------------------------------------------------------------------------


def _generate(capsys, *argv):
    from redraft.decoder.cli import main

    rc = main(["generate", "--prompt", "hi", "--max-new-tokens", "4", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, message", [
    (["--drafters", "medusa", "--medusa-heads", "/nonexistent/h.safetensors"],
     "heads file not found"),
    (["--drafters", "medusa", "--medusa-projection", "tiny"], "must be full or subset"),
    (["--drafters", "hybrid,pld"], "'hybrid' already combines drafters"),
])
def test_bad_medusa_options_are_one_line_errors(capsys, argv, message):
    rc, out, err = _generate(capsys, *argv)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("redraft generate: error:") and message in err


@pytest.mark.slow
@pytest.mark.parametrize("which", ["medusa", "fallback"])
def test_heads_for_another_model_are_refused_by_the_cli(capsys, tmp_path, default_model, which):
    from redraft.decoder.heads.heads_file import model_fingerprint, save_heads

    tiny = tiny_model()
    path = tmp_path / "tiny.safetensors"
    save_heads(tiny_heads(tiny), path, {"model": "tiny", "vocab_size": 64,
                                        "model_fingerprint": model_fingerprint(tiny)})
    rc, out, err = _generate(capsys, "--drafters", which, "--medusa-heads", str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "heads for hidden size 32" in err
