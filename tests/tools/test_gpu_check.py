"""tools/gpu_check.sh: it parses, stops at once with one line where there is no GPU, and
reports whatever stages ran (here: a setup that cannot install, as on a machine whose
package index is unreachable). Its GPU stages themselves run only on a CUDA machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ..decoder.conftest import have_default_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.sh"
REPORTER = REPO / "tools" / "gpu_check.py"


def fake_nvidia_smi(folder: Path, gpus: bool) -> dict:
    """An environment whose `nvidia-smi` lists one GPU, or fails as it does without a
    driver; nothing else of the machine changes."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "nvidia-smi"
    if gpus:
        tool.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    else:
        tool.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not "
                        "communicate with the NVIDIA driver.'\nexit 9\n")
    tool.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def run(tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    env = {**env, "GPU_CHECK_WORK": str(tmp_path / "work")}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)


def test_without_a_gpu_it_stops_at_once_with_one_line(tmp_path):
    envs = [fake_nvidia_smi(tmp_path / "bin", gpus=False)]
    if shutil.which("nvidia-smi") is None:
        envs.append(dict(os.environ))  # this machine as it is
    for env in envs:
        r = run(tmp_path, env, str(tmp_path / "out"))
        assert r.returncode == 2
        assert r.stdout == ""
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpu_check: no NVIDIA GPU")
        assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_help_says_what_it_runs(tmp_path):
    r = run(tmp_path, dict(os.environ), "--help")
    assert r.returncode == 0
    for stage in ("lossless", "cost", "bench", "vllm", "results.json", "summary.md"):
        assert stage in r.stdout


def test_a_setup_that_cannot_install_is_reported(tmp_path):
    """A GPU listed, but nothing installable (WHEELS: an empty folder, no package index):
    setup fails, the rest is not run, and the results still say what happened."""
    env = fake_nvidia_smi(tmp_path / "bin", gpus=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env.update(WHEELS=str(wheels), GPU_CHECK_VLLM="0", PYTHON=sys.executable,
               TORCH_SPEC="torch-that-does-not-exist")
    r = run(tmp_path, env, str(tmp_path / "out"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "gpu_check: setup: failed" in r.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    (setup,) = results["stages"]
    assert setup["stage"] == "setup" and setup["status"].startswith("failed")
    assert any("torch-that-does-not-exist" in line for line in setup["log_tail"])
    assert "| setup | failed" in (tmp_path / "out" / "summary.md").read_text()
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert {"./setup.log", "./stages.jsonl"} <= set(tar.getnames())


def test_the_report_gathers_every_stage(tmp_path):
    logs = tmp_path / "logs"
    (logs / "bench").mkdir(parents=True)
    stages = [{"stage": "lossless", "status": "ok", "seconds": 80, "note": "n"},
              {"stage": "bench", "status": "timed out after 180 s", "seconds": 180,
               "note": "b"}]
    (logs / "stages.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stages))
    (logs / "bench.log").write_text("".join(f"line {i}\n" for i in range(40)))
    (logs / "lossless.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.decoder.test_generate" name="test_a"/>'
        '<testcase classname="tests.decoder.test_generate" name="test_b">'
        '<failure message="differs"/></testcase>'
        '<testcase classname="tests.decoder.test_verify" name="test_c"><skipped/></testcase>'
        '</testsuite></testsuites>')
    (logs / "cost.json").write_text(json.dumps({
        "device": "NVIDIA H200", "torch": "2.11", "bfloat16/prefix128": {
            "sizes": [1, 2], "ms": [5.0, 5.1], "ratio": [1.0, 1.02]}}))
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(REPORTER), "report", "--logs", str(logs),
                    "--out", str(out)], check=True, capture_output=True)
    results = json.loads((out / "results.json").read_text())
    assert results["lossless"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                   "failed": ["tests.decoder.test_generate::test_b"]}
    assert "log_tail" not in results["stages"][0]
    assert results["stages"][1]["log_tail"][-1] == "line 39"
    assert len(results["stages"][1]["log_tail"]) == 15
    md = (out / "summary.md").read_text()
    assert "| bench | timed out after 180 s | 180 | b |" in md
    assert "failed: tests.decoder.test_generate::test_b" in md
    assert "| bfloat16/prefix128 | 5.0 (1.0x) | 5.1 (1.02x) |" in md


@pytest.mark.parametrize("command", ["cost", "vllm"])
def test_the_python_stages_name_their_arguments(command):
    r = subprocess.run([sys.executable, str(REPORTER), command], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--out" in r.stderr


@pytest.mark.slow
def test_the_default_model_is_saved_as_a_folder_vllm_can_load(tmp_path):
    """The vLLM stage's model: the default model's weights (rounded to bfloat16) and tokenizer
    in a Hugging Face folder (transformers itself refuses to save a model loaded from GGUF)."""
    torch = pytest.importorskip("torch")
    from redraft.decoder.models.loading import load_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPORTER.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPORTER.parent))
    if not have_default_model():
        pytest.skip("default model package not installed (make install)")
    model, tokenizer = load_model(None, device="cpu", dtype="float32")
    gpu_check.save_default_model(tmp_path / "hf")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ours = model.state_dict()
    for name, weight in saved.state_dict().items():
        assert torch.equal(weight, ours[name].to(torch.bfloat16).float()), name
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    loaded = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.eos_token == tokenizer.eos_token
