"""`redraft generate` in fresh processes, as a user runs it: on the machine's auto dtype, with
torch's default thread count and with `--threads 1`, every drafter's greedy tokens are plain
decoding's, and a first run on an empty cache decodes what a second run does.

Why here and not in process: the other decoder tests pin one thread (tests/decoder/conftest.py),
share one converted model and keep their trees small, so a kernel whose result for a row
depends on how many rows or threads share the call, or a first load (from the GGUF file) that
differs from a load from the cache, passes them. A failure names the CPU's features and the
kernel path, so that the machine it came from is known.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import have_default_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not have_default_model(), reason="default model not installed"),
]

PROMPTS = Path(__file__).resolve().parents[3] / "tools" / "code_chat_prompts.jsonl"
QUESTIONS = (9001, 9012)  # one code completion, one chat answer
NEW_TOKENS = 24
DEFAULT_THREADS = "default threads"  # no --threads: torch's own count


def auto_dtype() -> torch.dtype:
    from redraft.decoder.models.loading import resolve_dtype

    return resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu")


def machine() -> str:
    """The CPU's model, the features that choose kernels, torch's, oneDNN's and the block
    kernel's paths: what a failure report needs to name the machine."""
    model, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
              "amx_int8")
    dtype = auto_dtype()
    try:
        from redraft.decoder import block_linear

        path = block_linear.kernel_path(dtype)
    except (ImportError, AttributeError, KeyError, RuntimeError) as exc:
        path = f"unavailable ({type(exc).__name__}: {exc})"
    have = " ".join(f for f in wanted if f in flags) or "-"
    lack = " ".join(f for f in wanted if f not in flags) or "-"
    return (f"CPU {model!r}, flags: {have}; without: {lack}; torch {torch.__version__} capability "
            f"{torch.backends.cpu.get_cpu_capability()}, auto dtype {dtype}, block kernel "
            f"path {path}, {len(os.sched_getaffinity(0))} cores, OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, exact forwards {exact_forwards()}")


class Runs:
    """`redraft generate --json` over the same prompts, one fresh process per configuration,
    all on one cache. The first (`cold`: plain decoding, default threads) starts it empty, so
    that it converts the model from its GGUF file as a user's first run does; every other run
    finds the cache warm."""

    def __init__(self, cache: Path, prompts: Path) -> None:
        self.cache, self.prompts = cache, prompts
        self.done: dict[tuple, list[dict]] = {}
        self.cold = self.run("--drafters", "none")

    def get(self, threads: str, *argv: str) -> list[dict]:
        key = (threads, *argv)
        if key not in self.done:
            extra = [] if threads == DEFAULT_THREADS else ["--threads", threads]
            self.done[key] = self.run(*argv, *extra)
        return self.done[key]

    def run(self, *argv: str) -> list[dict]:
        cmd = [sys.executable, "-m", "redraft.decoder.cli", "generate", "--prompts",
               str(self.prompts), "--max-new-tokens", str(NEW_TOKENS), "--json", *argv]
        env = dict(os.environ, REDRAFT_CACHE=str(self.cache), TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"{' '.join(argv)}: exit {proc.returncode}\n" \
                                     f"{proc.stderr[-3000:]}\non {machine()}"
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        assert len(records) == len(QUESTIONS), proc.stdout[-2000:]
        return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exact")
    prompts = folder / "prompts.jsonl"
    lines = [line for line in PROMPTS.read_text().splitlines()
             if line.strip() and json.loads(line)["question_id"] in QUESTIONS]
    prompts.write_text("\n".join(lines) + "\n")
    cache = folder / "cache"
    cache.mkdir()  # empty: no converted model, no cost curve, no calibration
    yield Runs(cache, prompts)
    shutil.rmtree(cache, ignore_errors=True)  # 0.5 GB of converted weights


def first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                min(len(got), len(want)))


def exact_forwards() -> bool:
    """Whether the verifier runs exact forwards on the auto dtype: in bfloat16, and in float32
    on the GGUF's blocks where the block kernel has a fast path on this CPU."""
    dtype = auto_dtype()
    if dtype != torch.float32:
        return True
    try:
        from redraft.decoder import block_linear

        return block_linear.fast(dtype)
    except (ImportError, AttributeError):
        return False


def assert_same_tokens(request, got: list[dict], want: list[dict], what: str) -> None:
    """Token for token; without exact forwards (float32 on dense weights) a first difference
    is allowed only at a near-tie of the target's top two logits, as in
    tests/decoder/test_generate.py."""
    for question, g, w in zip(QUESTIONS, got, want):
        if g["tokens"] == w["tokens"]:
            continue
        i = first_difference(g["tokens"], w["tokens"])
        message = (f"{what}: question {question}: tokens differ at token {i} of {NEW_TOKENS}\n"
                   f"  got  {g['tokens']}\n  want {w['tokens']}\n"
                   f"  stats got {g['stats']}\n  stats want {w['stats']}\non {machine()}")
        assert not exact_forwards() and i < min(len(g["tokens"]), len(w["tokens"])), message
        tie, gap = near_tie_at(request, question, w["tokens"][:i])
        assert tie, f"{message}\n(top-2 logit gap {gap:.3g} at the first difference: a bug)"


def near_tie_at(request, question: int, before: list[int]) -> tuple[bool, float]:
    """Whether the float32 target's top two logits after the prompt and `before` tie."""
    from redraft.decoder.near_tie import is_near_tie
    from redraft.decoder.text import chat_ids

    model, tokenizer = request.getfixturevalue("default_model")
    turn = next(json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines()
                if line.strip() and json.loads(line)["question_id"] == question)
    ids = chat_ids(tokenizer, [{"role": "user", "content": turn}]) + before
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
    return is_near_tie(logits, torch.float32)


def test_a_first_run_on_an_empty_cache_decodes_what_the_second_does(request, runs):
    """The first run builds the model from its GGUF file; every later run loads the copy it
    left in the cache. A user who runs the same command twice gets one answer (the first
    load's rotary buffers were once bfloat16 where a cached load's are float32)."""
    warm = runs.get(DEFAULT_THREADS, "--drafters", "none")
    assert all(len(r["tokens"]) == NEW_TOKENS for r in warm)
    assert_same_tokens(request, runs.cold, warm, "first run on an empty cache against the second")


# Each against plain decoding at the same thread count. `hybrid` is the default model's
# default (its committed Medusa heads); `--tree-nodes N` verifies the best N drafted nodes
# every step (N + 1 rows a forward) whatever the cost curve says. Runs that size trees by the
# cost curve run at one thread only: measuring the curve at several threads on a busy machine
# can take minutes, and the fixed trees cover the sizes it picks. Every row count and thread
# count against the one-row call is the kernel tests' job (tests/decoder/native/).
CONFIGS = [
    (DEFAULT_THREADS, ("--drafters", "hybrid", "--tree-nodes", "1")),
    (DEFAULT_THREADS, ("--drafters", "pld", "--tree-nodes", "4")),
    (DEFAULT_THREADS, ("--drafters", "pld,recycle", "--tree-nodes", "16")),
    ("1", ("--drafters", "hybrid")),
    ("1", ("--drafters", "hybrid", "--tree-nodes", "64")),
]


@pytest.mark.parametrize("threads, argv", CONFIGS,
                         ids=[" ".join(a) + ("" if t == DEFAULT_THREADS else f" --threads {t}")
                              for t, a in CONFIGS])
def test_every_drafter_decodes_what_plain_decoding_does(request, runs, threads, argv):
    """With the same model, dtype, device and thread count, given or defaulted."""
    plain = runs.get(threads, "--drafters", "none")
    drafted = runs.get(threads, *argv)
    assert_same_tokens(request, drafted, plain,
                       f"{' '.join(argv)} against --drafters none ({threads})")
    assert sum(r["stats"]["drafted"] for r in drafted) > 0  # drafts were verified
