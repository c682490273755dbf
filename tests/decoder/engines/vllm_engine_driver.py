"""Runs inside vLLM's own environment (`make vllm-env`), started by test_vllm_engine.py: one
real vLLM engine (the `LLM` class, the engine core in its own process as vLLM runs it),
plain or with a speculative method, over a list of prompt token ids.

    python vllm_engine_driver.py '{"model": DIR, "method": "plain"|"redraft"|"ngram",
        "prompts": [[ids...], ...], "max_tokens": N, "phases": ["one", "all"],
        "kill_pid": PID, "kill_after_s": S}'

Phases: "one" generates each prompt alone (batch 1), "all" every prompt at once (batched),
"killed" every prompt at once while `kill_pid` is SIGKILLed `kill_after_s` into the run
(the draft service dying mid-generation), "wait" prints WAITING and reads one line of
standard input (the test reads the service's counters meanwhile). Prints one JSON line:
each phase's output token ids per prompt, the engine's wall seconds per phase and, for
redraft, the proposer's counters read from the worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time


def proposer_stats(worker) -> dict | None:
    """Run in vLLM's worker (collective_rpc): the RedraftProposer's counters, if it drafts."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    stats = getattr(drafter, "stats", None)
    return dict(stats) if isinstance(stats, dict) else None


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams  # vLLM's environment only

    method = args["method"]
    k = args.get("k", 5)
    spec = None
    if method == "redraft":
        spec = {"method": "custom_class", "num_speculative_tokens": k,
                "model": "redraft.decoder.engines.vllm.RedraftProposer"}
    elif method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
    elif method != "plain":
        raise SystemExit(f"unknown method {method!r}")
    # The CPU backend reserves gpu_memory_utilization of the node's memory for its KV cache:
    # a small share leaves room for the test's other processes.
    llm = LLM(model=args["model"], dtype="float32", max_model_len=args.get("max_model_len", 1024),
              speculative_config=spec, enforce_eager=True, gpu_memory_utilization=0.2,
              seed=0)
    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"])
    prompts = [{"prompt_token_ids": ids} for ids in args["prompts"]]
    out: dict = {"outputs": {}, "seconds": {}}

    def run(batch: list) -> list[list[int]]:
        return [list(r.outputs[0].token_ids) for r in llm.generate(batch, params,
                                                                   use_tqdm=False)]

    for phase in args["phases"]:
        start = time.perf_counter()
        if phase == "one":
            ids = [run([p])[0] for p in prompts]
        elif phase == "all":
            ids = run(prompts)
        elif phase == "killed":
            pid, delay = args["kill_pid"], args["kill_after_s"]
            timer = threading.Timer(delay, os.kill, (pid, signal.SIGKILL))
            timer.start()
            ids = run(prompts)
            timer.join()
        elif phase == "wait":
            print("WAITING", flush=True)
            sys.stdin.readline()
            continue
        else:
            raise SystemExit(f"unknown phase {phase!r}")
        out["outputs"][phase] = ids
        out["seconds"][phase] = time.perf_counter() - start
    if method == "redraft":
        out["proposer"] = [s for s in llm.collective_rpc(proposer_stats) if s is not None]
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    main()
