"""The Python half of tools/gpu_check.sh: the stages that need more than a command line.

    gpu_check.py cost --out FILE                 forward-cost curve of the default model
    gpu_check.py vllm --datastore DIR --work DIR --out FILE
                                                 vLLM with RedraftProposer against plain vLLM
    gpu_check.py report OUT                      OUT/results.json and OUT/summary.md

`report` needs the standard library only (it runs whatever was installed); the others run in
the check's virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

K = 5  # num_speculative_tokens of the vLLM run
PROMPTS = Path(__file__).with_name("code_prompts.jsonl")


# ---- cost ------------------------------------------------------------------------------
def cost(args) -> None:
    import torch
    from redraft.decoder.budget import CostModel
    from redraft.decoder.models.loading import load_model

    out = {}
    for dtype in ("bfloat16", "float32"):
        model, _ = load_model(None, device=args.device, dtype=dtype)
        curve = CostModel.measure(model, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        out[dtype] = {"sizes": curve.sizes, "ms": [round(s * 1e3, 3) for s in curve.seconds],
                      "ratio": [round(s / curve.seconds[0], 2) for s in curve.seconds]}
    out["device"] = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    Path(args.out).write_text(json.dumps(out, indent=1))


# ---- vllm ------------------------------------------------------------------------------
def vllm(args) -> None:
    work = Path(args.work)
    model_dir = work / "model-hf"
    if not (model_dir / "config.json").exists():  # vLLM reads a Hugging Face folder
        from redraft.decoder.models.loading import load_model

        model, tokenizer = load_model(None, device="cpu", dtype="bfloat16")
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    serve = subprocess.Popen([sys.executable, "-m", "redraft.decoder.cli", "serve",
                              "--datastore", args.datastore, "--port", "0"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        address = ""
        for line in serve.stdout:
            if "listening on" in line:
                address = line.split("listening on ")[1].strip()
                break
        if not address:
            raise SystemExit("redraft serve did not start")
        runs = {}
        for name, env in (("plain", {}), ("redraft", {"REDRAFT_SERVICE": address})):
            path = work / f"vllm-{name}.json"
            cmd = [sys.executable, __file__, "vllm-run", "--model", str(model_dir),
                   "--out", str(path), "--max-tokens", str(args.max_tokens)]
            if name == "redraft":
                cmd.append("--speculate")
            subprocess.run(cmd, check=True, env={**os.environ, **env})
            runs[name] = json.loads(path.read_text())
        from redraft.datastore.service.client import DraftClient

        with DraftClient(address, timeout=10) as client:
            service = client.stats()
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(30)
    plain, spec = runs["plain"]["outputs"], runs["redraft"]["outputs"]
    result = {"k": K, "prompts": len(plain),
              "identical": sum(a == b for a, b in zip(plain, spec)),
              "plain_seconds": runs["plain"]["seconds"],
              "redraft_seconds": runs["redraft"]["seconds"],
              "spec_metrics": runs["redraft"]["metrics"],
              "service_stats": {k: v for k, v in service.items() if not isinstance(v, dict)}}
    Path(args.out).write_text(json.dumps(result, indent=1))


def vllm_run(args) -> None:
    """One vLLM engine in this process: greedy answers to the code prompts."""
    from vllm import LLM, SamplingParams

    spec = None
    if args.speculate:
        spec = {"method": "custom_class", "num_speculative_tokens": K,
                "model": "redraft.decoder.engines.vllm.RedraftProposer"}
    llm = LLM(model=args.model, max_model_len=2048, gpu_memory_utilization=0.3,
              enforce_eager=True, speculative_config=spec, seed=0,
              disable_log_stats=False)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], params)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    metrics = {}
    try:  # vLLM's counters, where this version has them
        for m in llm.get_metrics():
            if "spec_decode" in m.name and hasattr(m, "value"):
                metrics[m.name] = m.value
    except Exception as exc:  # report, do not fail the run
        metrics["error"] = repr(exc)
    Path(args.out).write_text(json.dumps({
        "outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
        "metrics": metrics}))


# ---- report ----------------------------------------------------------------------------
def report(args) -> None:
    out = Path(args.out)
    stages = [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()
              if line.strip()]
    results = {"stages": stages}
    for name, path in (("cost", "cost.json"), ("vllm", "vllm.json"),
                       ("bench", "bench_summary.json")):
        try:
            results[name] = json.loads((out / path).read_text())
        except (OSError, ValueError):
            pass
    try:
        suite = ET.parse(out / "lossless.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        results["lossless"] = {k: int(suite.get(k, 0)) for k in
                               ("tests", "failures", "errors", "skipped")}
    except (OSError, ET.ParseError, AttributeError):
        pass
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = ["# GPU check", "", "| stage | status | seconds | note |", "| --- | --- | --- | --- |"]
    md += [f"| {s['stage']} | {s['status']} | {s['seconds']} | {s.get('note', '')} |"
           for s in stages]
    if "lossless" in results:
        md += ["", "Lossless tests on CUDA: " + ", ".join(
            f"{k} {v}" for k, v in results["lossless"].items())]
    for dtype, c in results.get("cost", {}).items():
        if isinstance(c, dict):
            md += ["", f"Forward cost ({results['cost'].get('device')}, {dtype}): tokens "
                   + " ".join(f"{n}:{r}x" for n, r in zip(c["sizes"], c["ratio"]))
                   + f" (1 token: {c['ms'][0]} ms)"]
    bench_md = out / "bench_summary.md"
    if bench_md.exists():
        md += ["", "## Spec-Bench (bfloat16)", "", bench_md.read_text()]
    v = results.get("vllm")
    if v:
        md += ["", f"vLLM with RedraftProposer (k={v['k']}): {v['identical']}/{v['prompts']} "
               f"outputs identical to plain vLLM; {v['redraft_seconds']:.2f} s vs "
               f"{v['plain_seconds']:.2f} s plain; metrics {v['spec_metrics']}"]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--out", required=True)
    c.add_argument("--device", default="cuda")
    v = sub.add_parser("vllm")
    v.add_argument("--datastore", required=True)
    v.add_argument("--work", required=True)
    v.add_argument("--out", required=True)
    v.add_argument("--max-tokens", type=int, default=64)
    r = sub.add_parser("vllm-run")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--speculate", action="store_true")
    rep = sub.add_parser("report")
    rep.add_argument("out")
    args = p.parse_args()
    {"cost": cost, "vllm": vllm, "vllm-run": vllm_run, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
