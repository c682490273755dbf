"""The Python half of tools/gpu_check.sh: the stages that need more than a command line,
run from the repository root as `python -m tools.gpu_check STAGE ...`:

    gpu_check.py cost --out FILE             forward-cost curve of the default model on CUDA
    gpu_check.py vllm --datastore DIR --work DIR --out FILE
                                             vLLM with RedraftProposer against plain vLLM,
                                             greedy, the draft service a real `redraft serve`
    gpu_check.py report --logs DIR --out DIR  DIR/results.json and DIR/summary.md

`report` needs the standard library only (it runs whatever was installed); `cost` runs in
the check's virtual environment, `vllm` in the one vLLM was installed into.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

K = 5  # num_speculative_tokens of the vLLM run
PROMPTS = Path(__file__).with_name("code_prompts.jsonl")
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LOG_TAIL = 15  # lines of a failed stage's log kept in the results


# ---- cost ------------------------------------------------------------------------------
def cost(args) -> None:
    """Milliseconds of one verifier forward of n tokens over a cached prefix, per dtype."""
    import torch
    from redraft.decoder.budget import CostModel
    from redraft.decoder.models.loading import load_model

    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for dtype, prefix in (("bfloat16", 128), ("bfloat16", 1024), ("float32", 128)):
        model, _ = load_model(None, device="cuda", dtype=dtype)
        curve = CostModel.measure(model, sizes=SIZES, prefix=prefix)
        out[f"{dtype}/prefix{prefix}"] = {
            "sizes": curve.sizes, "ms": [round(s * 1e3, 3) for s in curve.seconds],
            "ratio": [round(s / curve.seconds[0], 2) for s in curve.seconds]}
    Path(args.out).write_text(json.dumps(out, indent=1))


# ---- vllm ------------------------------------------------------------------------------
def vllm(args) -> None:
    """Plain vLLM and vLLM drafting from a real `redraft serve`, greedy, one engine each."""
    work = Path(args.work)
    model_dir = work / "model-hf"
    if not (model_dir / "config.json").exists():
        save_default_model(model_dir)
    log_path = Path(args.out).with_suffix(".serve.log")
    from tools import harness  # lazy: `report` runs on the standard library alone

    with harness.serving(args.datastore, "--port", "0", timeout=120, log=log_path) as serve:
        address = serve.address
        runs = {}
        for name in ("plain", "redraft"):
            path = work / f"vllm-{name}.json"
            cmd = [sys.executable, __file__, "vllm-run", "--model", str(model_dir),
                   "--out", str(path), "--max-tokens", str(args.max_tokens)]
            env = dict(os.environ)
            if name == "redraft":
                cmd.append("--speculate")
                env["REDRAFT_SERVICE"] = address
            subprocess.run(cmd, check=True, env=env)
            runs[name] = json.loads(path.read_text())
        from redraft.datastore.service.client import DraftClient

        with DraftClient(address, timeout=10) as client:
            service = client.stats()
    plain, spec = runs["plain"]["outputs"], runs["redraft"]["outputs"]
    differ = [i for i, (a, b) in enumerate(zip(plain, spec)) if a != b]
    result = {
        "k": K, "prompts": len(plain), "identical": len(plain) - len(differ),
        "first_difference": {str(i): _first_difference(plain[i], spec[i]) for i in differ},
        "plain_seconds": runs["plain"]["seconds"], "redraft_seconds": runs["redraft"]["seconds"],
        "vllm": runs["redraft"]["version"], "spec_metrics": runs["redraft"]["metrics"],
        "service": {k: service.get(k) for k in ("batch_calls", "batch_steps", "hit_rate",
                                                "mean_nodes", "latency_p50_us",
                                                "latency_p99_us", "errors")}}
    Path(args.out).write_text(json.dumps(result, indent=1))


def save_default_model(folder: Path) -> None:
    """The default model as a Hugging Face folder in bfloat16 (what vLLM loads): its GGUF
    weights load as their dense copy (`dense_weights`), which saves as any model does."""
    from redraft.decoder.models.loading import load_model

    plain, tokenizer = load_model(None, device="cpu", dtype="bfloat16")
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # the tokenizer class every transformers version knows (a vLLM may pin an older one)
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(settings, indent=1))


def _first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where two outputs differ (or where the shorter one ends)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def vllm_run(args) -> None:
    """One vLLM engine in this process: greedy answers to the code prompts."""
    import vllm as vllm_package
    from vllm import LLM, SamplingParams

    spec = None
    if args.speculate:
        # vLLM builds the proposer from this dotted path (method "custom_class")
        spec = {"method": "custom_class", "num_speculative_tokens": K,
                "model": "redraft.decoder.engines.vllm.RedraftProposer"}
    llm = LLM(model=args.model, max_model_len=2048, gpu_memory_utilization=0.3,
              enforce_eager=True, speculative_config=spec, seed=0, disable_log_stats=False)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()
               if line.strip()]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], params)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    metrics: dict = {}
    try:  # vLLM's speculative-decoding counters, where this version has them
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                metrics[m.name] = getattr(m, "value", None) or getattr(m, "values", None)
    except Exception as exc:  # report, do not fail the run
        metrics["error"] = repr(exc)
    Path(args.out).write_text(json.dumps({
        "outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
        "metrics": metrics, "version": getattr(vllm_package, "__version__", "?")}))


# ---- report ----------------------------------------------------------------------------
def report(args) -> None:
    """Every stage's outcome and numbers as results.json and summary.md."""
    logs, out = Path(args.logs), Path(args.out)
    stages = [json.loads(line) for line in _read(logs / "stages.jsonl").splitlines()
              if line.strip()]
    for s in stages:  # why a stage did not pass: the end of its log (or its install's)
        if s["status"] != "ok":
            log = _read(logs / f"{s['stage']}.log") or _read(logs / f"{s['stage']}-install.log")
            s["log_tail"] = log.splitlines()[-LOG_TAIL:]
    results: dict = {"stages": stages}
    for name, path in (("machine", "machine.json"), ("cost", "cost.json"),
                       ("vllm", "vllm.json"), ("bench", "bench/summary.json")):
        try:
            results[name] = json.loads(_read(logs / path))
        except ValueError:
            pass
    lossless = _junit(logs / "lossless.xml")
    if lossless:
        results["lossless"] = lossless
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    md = _markdown(results, _read(logs / "bench/summary.md"))
    (out / "summary.md").write_text(md)
    print(md, end="")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _junit(path: Path) -> dict:
    """Counts and failed test ids from a pytest JUnit file ({} when there is none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]
    return counts


def _markdown(results: dict, bench_table: str) -> str:
    machine = results.get("machine", {})
    md = ["# GPU check", ""]
    if machine:
        md += [", ".join(f"{k}: {v}" for k, v in machine.items()), ""]
    md += ["| stage | status | seconds | note |", "| --- | --- | --- | --- |"]
    md += [f"| {s['stage']} | {s['status']} | {s['seconds']} | {s.get('note', '')} |"
           for s in results["stages"]]
    ll = results.get("lossless")
    if ll:
        md += ["", f"Lossless tests on CUDA: {ll['tests']} tests, {ll['failures']} failed, "
               f"{ll['errors']} errors, {ll['skipped']} skipped"]
        md += [f"- failed: {t}" for t in ll["failed"]]
    curves = {k: v for k, v in results.get("cost", {}).items() if isinstance(v, dict)}
    if curves:
        c = results["cost"]
        sizes = next(iter(curves.values()))["sizes"]
        md += ["", f"Forward cost on {c.get('device')} (torch {c.get('torch')}): ms per "
               "forward of n tokens over a cached prefix (ratio to 1 token)", "",
               "| dtype / prefix | " + " | ".join(str(n) for n in sizes) + " |",
               "| --- |" + " --- |" * len(sizes)]
        md += [f"| {key} | " + " | ".join(f"{ms} ({r}x)" for ms, r in zip(v["ms"], v["ratio"]))
               + " |" for key, v in curves.items()]
    if bench_table.strip():
        md += ["", "## Spec-Bench on CUDA (bfloat16)", "", bench_table.strip()]
    v = results.get("vllm")
    if v:
        md += ["", f"## vLLM {v['vllm']} with RedraftProposer (k={v['k']}, greedy)", "",
               f"{v['identical']}/{v['prompts']} outputs identical to plain vLLM "
               f"(first differing token per prompt: {v['first_difference'] or 'none'}); "
               f"{v['redraft_seconds']:.2f} s against {v['plain_seconds']:.2f} s plain; "
               f"vLLM's counters {v['spec_metrics']}; draft service {v['service']}"]
    return "\n".join(md) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("cost").add_argument("--out", required=True)
    v = sub.add_parser("vllm")
    v.add_argument("--datastore", required=True)
    v.add_argument("--work", required=True)
    v.add_argument("--out", required=True)
    v.add_argument("--max-tokens", type=int, default=128)
    r = sub.add_parser("vllm-run")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--speculate", action="store_true")
    rep = sub.add_parser("report")
    rep.add_argument("--logs", required=True)
    rep.add_argument("--out", required=True)
    args = p.parse_args()
    {"cost": cost, "vllm": vllm, "vllm-run": vllm_run, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
