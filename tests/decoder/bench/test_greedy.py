"""The Spec-Bench runner: question selection, accounting, identity check, outputs."""

from __future__ import annotations

import json

import pytest
import torch
from redraft.decoder.bench.driver import machine_state
from redraft.decoder.bench.greedy import (
    Record,
    conditions_note,
    kernel_report,
    markdown_table,
    run_bench,
    summarize,
    write_outputs,
)
from redraft.decoder.bench.methods import HFMethod, RedraftMethod, method_drafters, parse_methods
from redraft.decoder.bench.questions import CATEGORIES, MULTI_TURN, BenchError, load_questions


def _write_questions(path, per_cat: int = 3) -> None:
    cats = ["writing", "coding", "translation", "summarization", "qa", "math_reasoning", "rag"]
    with path.open("w") as f:
        qid = 0
        for cat in cats:
            for _ in range(per_cat):
                qid += 1
                turns = [f"q{qid} first", f"q{qid} second"] if cat in ("writing", "coding") else [
                    f"q{qid}"]
                f.write(json.dumps({"question_id": qid, "category": cat, "turns": turns}) + "\n")


def test_questions_grouped_into_six_categories_and_spread_evenly(tmp_path):
    path = tmp_path / "q.jsonl"
    _write_questions(path)
    qs = load_questions(path, per_category=2)
    assert [q.category for q in qs].count(MULTI_TURN) == 2
    # MT-Bench sub-categories are spread: one writing and one coding question, not two writing.
    assert {q.question_id for q in qs if q.category == MULTI_TURN} == {1, 4}
    assert {q.category for q in qs} == set(CATEGORIES)
    assert len(load_questions(path, None)) == 21


@pytest.mark.parametrize("content", ["", "{not json}\n", '{"category": "qa"}\n'])
def test_bad_question_files_are_errors(tmp_path, content):
    path = tmp_path / "q.jsonl"
    path.write_text(content)
    with pytest.raises(BenchError):
        load_questions(path, 10)
    with pytest.raises(BenchError, match="not found"):
        load_questions(tmp_path / "missing.jsonl", 10)


def test_methods_need_a_reference_and_retrieval_for_rest():
    assert parse_methods("redraft-pld", False) == ["hf-greedy", "redraft-pld"]
    with pytest.raises(BenchError, match="unknown method"):
        parse_methods("hf-greedy,medusa2", False)
    with pytest.raises(BenchError, match="--datastore"):
        parse_methods("redraft-pld-rest", False)


def test_the_default_method_is_the_models_default():
    assert method_drafters("redraft-default") == "hybrid"  # the default model has heads
    assert method_drafters("redraft-default", "models/other.gguf") == "pld,rest,recycle"


def test_summary_divides_by_hf_greedy_measured_in_the_same_run(tmp_path):
    recs = [
        Record(1, "translation", "hf-greedy", 0, new_tokens=100, steps=100, seconds=10.0),
        Record(1, "translation", "redraft-pld", 0, new_tokens=100, steps=40, seconds=5.0,
               identical=True, draft_seconds=0.2, accepted={"pld": 30}, tried={"pld": 40}),
        Record(2, "qa", "hf-greedy", 0, new_tokens=50, steps=50, seconds=10.0),
        Record(2, "qa", "redraft-pld", 0, new_tokens=50, steps=50, seconds=10.0,
               identical=False, first_diff=7, logit_gap=2e-5),
    ]
    rows = {(r["method"], r["category"]): r for r in summarize(recs)["rows"]}
    assert rows[("redraft-pld", "translation")]["speedup"] == 2.0
    assert rows[("redraft-pld", "translation")]["tokens_per_forward"] == 2.5
    overall = rows[("redraft-pld", "overall")]["speedup"]
    assert overall == pytest.approx(150 / 15 / (150 / 20), abs=1e-3)
    assert rows[("redraft-pld", "qa")]["identical"] == "0/1"
    assert rows[("redraft-pld", "qa")]["max_gap_at_diff"] == 2e-5
    table = markdown_table(summarize(recs), ["hf-greedy", "redraft-pld"])
    assert rows[("redraft-pld", "translation")]["draft_ms_per_step"] == 5.0
    assert rows[("redraft-pld", "overall")]["acceptance"] == {"pld": 0.75}
    assert "| translation | redraft-pld | 2.50 | 20.0 | 2.00× | – | 5.0 | 1/1 |" in table
    assert "| translation | hf-greedy | 1.00 | 10.0 | 1.00× | – | – | 1/1 |" in table
    write_outputs(tmp_path / "out", recs, summarize(recs), ["hf-greedy", "redraft-pld"], {})
    for name in ("records.jsonl", "summary.json", "summary.md", "speedup.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_repeats_give_each_speedup_a_median_and_range(tmp_path):
    recs = []
    for rep, (hf_s, pld_s) in enumerate([(10.0, 5.0), (10.0, 4.0), (12.0, 8.0)]):
        # CPU time: what the process itself spent; the wall clock adds other jobs' turns
        recs += [Record(1, "qa", "hf-greedy", 0, 100, 100, hf_s, repeat=rep, forwards=100,
                        cpu_seconds=8.0),
                 Record(1, "qa", "redraft-pld", 0, 100, 50, pld_s, identical=True, repeat=rep,
                        forwards=51, packed_forwards=51, cpu_seconds=4.0)]
    summary = summarize(recs)
    assert summary["repeats"] == 3
    row = {(r["method"], r["category"]): r for r in summary["rows"]}[("redraft-pld", "qa")]
    assert row["speedup_runs"] == [2.0, 2.5, 1.5]
    assert (row["speedup_median"], row["speedup_min"], row["speedup_max"]) == (2.0, 1.5, 2.5)
    assert row["speedup"] == pytest.approx(32 / 17, abs=1e-3)  # pooled over all runs
    assert row["forwards"] == row["packed_forwards"] == 153
    assert row["cpu_speedup"] == 2.0 and row["cpu_speedup_runs"] == [2.0, 2.0, 2.0]
    table = markdown_table(summary, ["hf-greedy", "redraft-pld"])
    assert "median (min–max) of 3 runs" in table
    row = "| qa | redraft-pld | 2.00 | 17.6 | 1.88× | 2.00× (1.50–2.50) | 2.00× | 0.0 | 3/3 |"
    assert row in table
    meta = {"machine_start": machine_state(), "machine_end": machine_state(),
            "kernels": kernel_report(recs, None),
            "cost_curve": {"source": "measured", "measure_seconds": 7.5, "corrections": 2}}
    assert meta["kernels"]["forwards"]["hf-greedy"] == {"forwards": 300, "packed": 0}
    note = conditions_note(meta)
    assert "redraft-pld 153/153" in note and "measured at start in 7.5 s" in note
    assert f"torch threads {torch.get_num_threads()}" in note


@pytest.mark.slow
def test_bench_on_the_default_model_is_token_identical(default_model, tmp_path):
    from redraft.decoder.drafters.registry import build_drafter
    from redraft.decoder.generate import Generator
    from redraft.decoder.kernels import packed_linears

    model, tok = default_model
    path = tmp_path / "q.jsonl"
    _write_questions(path, per_cat=1)
    questions = [q for q in load_questions(path, 1) if q.category in (MULTI_TURN, "translation")]
    methods = [
        HFMethod("hf-greedy", model, tok),
        HFMethod("hf-pld", model, tok, prompt_lookup_num_tokens=10),
        RedraftMethod("redraft-pld", Generator(model, tok, build_drafter("pld"))),
    ]
    recs = run_bench(questions, methods, model, tok, max_new_tokens=12, repeat=2)
    assert len(recs) == 2 * 3 * 3  # 2 runs x (2 turns + 1 turn) x 3 methods
    assert sorted({r.repeat for r in recs}) == [0, 1]
    hf = [r for r in recs if r.method == "hf-greedy"]
    assert all(r.identical for r in hf) and all(r.steps == r.new_tokens for r in hf)
    for r in recs:
        assert r.identical or r.near_tie, r
        assert r.prompt_tokens > 0 and r.forwards >= r.steps
        # the kernels each forward really ran on: HF's always stock; redraft's counted, the
        # prefill included, packed where they are the faster kind here (see test_kernels)
        if r.method.startswith("hf-"):
            assert r.packed_forwards == 0
        else:
            assert 0 <= r.packed_forwards <= r.forwards == r.steps + 1
    if packed_linears(model) is not None:
        assert sum(r.packed_forwards for r in recs) > 0


@pytest.mark.parametrize("argv, message", [
    (["--repeat", "0"], "--repeat must be >= 1"),
    (["--tree-nodes", "300"], "--tree-nodes must be in 1..256"),
    (["--always-packed", "--stock-kernels"], "not allowed with argument"),
    (["--dtype", "float64"], "unknown dtype 'float64'"),
    (["--samples", "3", "--methods", "llama-cpp"], "runs redraft methods only"),
])
def test_bad_bench_arguments_are_one_line_errors(capsys, tmp_path, argv, message):
    from redraft.decoder.cli import main

    path = tmp_path / "q.jsonl"
    _write_questions(path, per_cat=1)
    try:
        methods = [] if "--methods" in argv else ["--methods", "redraft-none"]
        rc = main(["bench", "--questions", str(path), *methods, *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    _, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]  # argparse prints its usage line first
    assert rc == 2 and last.startswith("redraft bench: error:") and message in last


def test_a_question_line_nested_too_deeply_is_one_line(capsys, tmp_path):
    from redraft.decoder.cli import main

    path = tmp_path / "q.jsonl"
    _write_questions(path, per_cat=1)
    with path.open("a") as f:
        f.write("[" * 100_000 + "\n")
    rc = main(["bench", "--questions", str(path), "--methods", "redraft-none", "--model",
               "no-such-model"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err == f"redraft bench: error: {path}:8: JSON nested too deeply\n"


@pytest.mark.parametrize("turns, message", [
    ("notalist", "'turns' must be a non-empty list of strings, got 'notalist'"),
    ([], "'turns' must be a non-empty list of strings, got []"),
    (["fine", 7], "every turn must be a non-empty string"),
    (["fine", "  "], "every turn must be a non-empty string"),
])
def test_a_question_without_a_list_of_turns_is_one_line(capsys, tmp_path, turns, message):
    from redraft.decoder.cli import main

    path = tmp_path / "q.jsonl"
    _write_questions(path, per_cat=1)
    with path.open("a") as f:
        f.write(json.dumps({"question_id": 99, "category": "qa", "turns": turns}) + "\n")
    rc = main(["bench", "--questions", str(path), "--methods", "redraft-none", "--model",
               "no-such-model"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"redraft bench: error: {path}:8: not a Spec-Bench question") \
        and message in err


@pytest.mark.parametrize("extra", [[], ["--samples", "2"]])
@pytest.mark.parametrize("methods", [",", " , ,", ""])
def test_methods_naming_nothing_are_one_line(capsys, tmp_path, methods, extra):
    from redraft.decoder.cli import main

    path = tmp_path / "q.jsonl"
    _write_questions(path, per_cat=1)
    rc = main(["bench", "--questions", str(path), "--methods", methods, "--model",
               "no-such-model", *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err == f"redraft bench: error: --methods names no method: {methods!r}\n"


@pytest.mark.slow
def test_llama_cpp_method_decodes_the_gguf_plainly_and_is_not_compared(tmp_path):
    """`llama-cpp` runs the model's GGUF in llama-cpp-python, one forward per token, beside
    the others; its tokens come from another (quantized) model, so identity reads n/a."""
    pytest.importorskip("llama_cpp")
    from redraft.decoder.bench.llama_cpp_method import LlamaCppMethod
    from redraft.proto.models import load_tokenizer

    tok = load_tokenizer(None)
    method = LlamaCppMethod(None, tok, threads=1)
    try:
        res = method.run([{"role": "user", "content": "Name three colours."}], 12)
    finally:
        method.close()
    assert 0 < len(res.tokens) <= 12 and res.text.strip()
    assert res.steps == res.forwards == len(res.tokens) + (len(res.tokens) < 12)
    assert res.packed_forwards == 0 and res.seconds > 0
    record = Record(1, "qa", "llama-cpp", 0, len(res.tokens), res.steps, res.seconds)
    hf = Record(1, "qa", "hf-greedy", 0, len(res.tokens), res.steps, res.seconds, True)
    rows = {r["method"]: r for r in summarize([hf, record])["rows"] if r["category"] == "qa"}
    assert rows["llama-cpp"]["identical"] == "n/a"
