"""The repeated-sampling benchmark: question choice, accounting, learning pairs, isolation."""

from __future__ import annotations

import json

import pytest
from redraft.decoder.bench.methods import drafter_options, method_drafters
from redraft.decoder.bench.questions import load_sampling_questions
from redraft.decoder.bench.sampling import (
    SampleRecord,
    markdown_samples,
    run_samples,
    summarize_samples,
)
from redraft.decoder.drafters.registry import default_drafters


def test_math_and_coding_questions_only(tmp_path):
    path = tmp_path / "q.jsonl"
    with path.open("w") as f:
        for qid, cat in enumerate(["writing", "coding", "coding", "math_reasoning", "qa",
                                   "math_reasoning", "math_reasoning"]):
            f.write(json.dumps({"question_id": qid, "category": cat, "turns": [f"q{qid}"]}) + "\n")
    qs = load_sampling_questions(path, 2)
    assert [(q.question_id, q.category) for q in qs] == [
        (3, "mathematical reasoning"), (5, "mathematical reasoning"), (1, "coding"), (2, "coding")]


def test_nolearn_methods_and_a_tenant_per_method_and_run():
    assert method_drafters("redraft-default-nolearn") == default_drafters(True)
    assert drafter_options("redraft-default-nolearn", {}, "r1")["learn"] == "off"
    learn = drafter_options("redraft-default", {"learn_max_tokens": 5}, "r1")
    assert "learn" not in learn and learn["learn_max_tokens"] == 5
    tenants = {drafter_options(m, {}, run)["tenant"] for m in ("redraft-a", "redraft-a-nolearn")
               for run in ("r1", "r2")}
    assert len(tenants) == 4
    assert drafter_options("redraft-a", {"tenant": "mine"}, "r1")["tenant"] == "mine"


def test_summary_separates_the_cold_start_and_compares_with_nolearn():
    def rec(method, sample, tokens, steps, learned=0):
        return SampleRecord(1, "coding", method, sample, 0, tokens, steps, 1.0,
                            {"learned": learned} if learned else {})

    recs = [rec("redraft-x", 0, 100, 50), rec("redraft-x", 1, 100, 20, learned=60),
            rec("redraft-x-nolearn", 0, 100, 50), rec("redraft-x-nolearn", 1, 100, 50)]
    rows = {(r["method"], r["category"]): r for r in summarize_samples(recs)["rows"]}
    x = rows[("redraft-x", "overall")]
    assert x["tokens_per_forward_first"] == 2.0 and x["tokens_per_forward_later"] == 5.0
    assert x["later_vs_nolearn"] == 2.5 and x["learned_share_later"] == 0.6
    assert "later_vs_nolearn" not in rows[("redraft-x-nolearn", "coding")]
    assert "| coding | redraft-x | 2.00 | 5.00 | 2.50× |" in markdown_samples(
        summarize_samples(recs), 2)


@pytest.mark.slow
def test_later_samples_draft_from_earlier_ones_and_only_when_learning(default_model,
                                                                     code_datastore):
    from redraft.decoder.bench.questions import Question
    from redraft.decoder.drafters.registry import build_drafter
    from redraft.decoder.generate import Generator

    model, tok = default_model
    generators = {}
    for m in ("redraft-rest", "redraft-rest-nolearn"):
        drafter = build_drafter("rest", tokenizer=tok, datastore=code_datastore,
                                options=drafter_options(m, {}, "test"))
        generators[m] = Generator(model, tok, drafter)
    q = Question(1, "coding", ["Write a Python function that returns the square of a number."])
    recs = run_samples([q], generators, samples=3, temperature=0.8, max_new_tokens=24)
    assert len(recs) == 6 and {r.sample for r in recs} == {0, 1, 2}
    learned = {m: sum(v for r in recs if r.method == m and r.sample > 0
                      for k, v in r.accepted.items() if "learned" in k) for m in generators}
    assert learned["redraft-rest"] > 0 and learned["redraft-rest-nolearn"] == 0
    for g in generators.values():
        g.drafter.close()
