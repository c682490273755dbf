"""`python -m redraft.decoder.models.export`: the default model as a Hugging Face folder
(what vLLM loads). Writing it is exercised by `make vllm-env` and the vLLM engine tests;
here, what a bad target gets."""

from __future__ import annotations

import subprocess
import sys


def test_an_existing_target_is_one_line_and_exit_2(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    p = subprocess.run([sys.executable, "-m", "redraft.decoder.models.export", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [f"export: {out} exists; remove it first"]
    assert list(out.iterdir()) == []  # nothing written into it
