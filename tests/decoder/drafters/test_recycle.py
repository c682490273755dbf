"""Token recycling: the candidate table, its best-first drafts, and its place in the loop."""

from __future__ import annotations

import numpy as np
from redraft.decoder.budget import CostModel
from redraft.decoder.drafter import MergedDrafter
from redraft.decoder.drafters.fallback import FallbackDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.drafters.recycle import CandidateTable, RecycleDrafter, table_path
from redraft.decoder.generate import Generator
from redraft.proto.models import load_tokenizer

from ..conftest import tiny_model


def table_with(rows: dict[int, list[tuple[int, float]]], k: int = 3) -> CandidateTable:
    table = CandidateTable(k)
    for token, row in rows.items():
        ids = np.array([[t for t, _ in row]], dtype=np.int32)
        probs = np.array([[p for _, p in row]], dtype=np.float32)
        table.record([token], ids, probs)
    return table


def test_draft_is_best_first_with_parents_before_children():
    table = table_with({7: [(1, 0.6), (2, 0.3), (3, 0.1)], 1: [(4, 0.9), (5, 0.05), (6, 0.05)],
                        2: [(8, 0.5), (9, 0.5), (6, 0.0)]})
    tree = table.draft(7, budget=4, max_depth=8)
    tree.validate()
    # path probabilities: 1: .6, 1->4: .54, 2: .3, 2->8 / 2->9: .15, 3: .1, 1->5: .03
    assert tree.tokens == [1, 4, 2, 8]
    assert tree.parents == [-1, 0, -1, 2]
    assert np.allclose(tree.probs, [0.6, 0.9, 0.3, 0.5])
    assert set(tree.sources) == {"recycle"}
    assert len(table.draft(7, budget=100, max_depth=1)) == 3  # depth 1: the root's row only
    # paths below min_prob are left out: 3 (.1) stays, 1->5 (.03) goes
    assert 5 not in table.draft(7, budget=100, max_depth=8, min_prob=0.05).tokens


def test_unseen_tokens_draft_nothing_and_the_latest_prediction_wins():
    table = table_with({3: [(4, 0.7), (5, 0.2), (6, 0.1)]})
    assert len(table.draft(99, budget=8, max_depth=4)) == 0  # never recorded (beyond the table)
    assert len(table.draft(0, budget=8, max_depth=4)) == 0  # inside the table, never recorded
    table.record([3], np.array([[9, 4, 5]], dtype=np.int32),
                 np.array([[0.8, 0.1, 0.1]], dtype=np.float32))
    assert table.draft(3, budget=1, max_depth=4).tokens == [9]


def test_recycled_drafts_are_lossless_and_learned_across_generations():
    model = tiny_model("llama", vocab=64, init=0.3)
    tok = load_tokenizer(None)
    flat = CostModel.flat(63)
    plain = Generator(model, tok, None, cost=flat)
    drafter = RecycleDrafter()
    gen = Generator(model, tok, drafter, cost=flat)
    prompt = [5, 9, 14, 3]
    want = plain.generate(prompt, max_new_tokens=30, eos=False).tokens
    first = gen.generate(prompt, max_new_tokens=30, eos=False)
    again = gen.generate(prompt, max_new_tokens=30, eos=False)
    assert first.tokens == want and again.tokens == want
    # the second time, the table holds what the target predicted the first time
    assert again.stats.steps < first.stats.steps
    assert again.stats.accepted.get("recycle", 0) > 0


def test_a_failing_recycler_drops_out_and_the_others_keep_drafting():
    class Broken(RecycleDrafter):
        def observe(self, context, tree, ids, probs):
            raise RuntimeError("table lost")

    model = tiny_model("llama", vocab=64, init=0.3)
    tok = load_tokenizer(None)
    flat = CostModel.flat(63)
    prompt = [5, 9, 14, 3, 5, 9, 14, 3, 5, 9]
    want = Generator(model, tok, None, cost=flat).generate(prompt, max_new_tokens=20).tokens
    for drafter, errors in ((Broken(), 1), (MergedDrafter([PLDDrafter(), Broken()]), 1)):
        r = Generator(model, tok, drafter, cost=flat).generate(prompt, max_new_tokens=20)
        assert r.tokens == want and r.stats.drafter_errors == errors


def test_table_survives_a_round_trip_and_bad_files_are_ignored(tmp_path):
    table = table_with({3: [(4, 0.7), (5, 0.2), (6, 0.1)]})
    path = tmp_path / "t.npz"
    table.save(path)
    back = CandidateTable(3)
    assert back.load(path, vocab_size=64)
    assert back.draft(3, budget=8, max_depth=1).tokens == [4, 5, 6]
    assert not CandidateTable(3).load(path, vocab_size=5)  # ids beyond this vocabulary
    assert not CandidateTable(8).load(path, vocab_size=64)  # another k
    assert not CandidateTable(3).load(tmp_path / "missing.npz", vocab_size=64)
    (tmp_path / "bad.npz").write_bytes(b"not a table")
    assert not CandidateTable(3).load(tmp_path / "bad.npz", vocab_size=64)


def test_a_table_grown_past_the_vocabulary_still_loads(tmp_path):
    # rows double as they grow: a 7-token vocabulary's table has 8 rows once token 6 is seen
    table = table_with({3: [(4, 0.7), (5, 0.2), (6, 0.1)], 6: [(1, 0.9), (2, 0.1), (0, 0.0)]})
    assert len(table.ids) == 8
    table.save(tmp_path / "t.npz")
    back = CandidateTable(3)
    assert back.load(tmp_path / "t.npz", vocab_size=7)
    assert back.draft(6, budget=8, max_depth=1).tokens == [1, 2]
    assert len(back.ids) == 7  # the never-seen rows past the vocabulary are dropped
    table.record([7], np.array([[1, 2, 3]], dtype=np.int32),
                 np.array([[0.5, 0.3, 0.2]], dtype=np.float32))
    table.save(tmp_path / "t.npz")  # a row recorded for a token this vocabulary lacks
    assert not CandidateTable(3).load(tmp_path / "t.npz", vocab_size=7)


def test_composites_forward_the_state_hooks_to_their_members(tmp_path):
    def hybrid(rec):  # the shapes `hybrid` and `fallback` build, with the recycler inside
        return {"merged": MergedDrafter([PLDDrafter(), rec]),
                "fallback": FallbackDrafter(MergedDrafter([PLDDrafter(), rec]), PLDDrafter())}

    for kind in ("merged", "fallback"):
        rec = RecycleDrafter(k=3)
        rec.table = table_with({3: [(4, 0.7), (5, 0.2), (6, 0.1)]})
        folder = tmp_path / kind
        hybrid(rec)[kind].save_state(folder, "tiny")
        assert [p.relative_to(folder) for p in folder.rglob("*.npz")] == \
            [table_path("tiny", folder).relative_to(folder)]  # where the CLI always kept it
        back = RecycleDrafter(k=3)
        hybrid(back)[kind].load_state(folder, "tiny", 64)
        assert back.propose([1, 3], budget=8).tokens == [4, 5, 6]
        other = RecycleDrafter(k=3)  # another model's table is another file
        hybrid(other)[kind].load_state(folder, "another model", 64)
        assert len(other.propose([1, 3], budget=8)) == 0
