"""The one benchmark driver behind `redraft bench`: greedy Spec-Bench (`greedy`) or, with
`--samples N` > 1, repeated sampling (`sampling`).

Both load the model once, pack its kernels, load (or measure) one forward-cost curve shared
by every drafting method, build each method's drafters afresh (a run learns nothing from
another), warm every method up before anything is timed, run the questions with the methods
interleaved, and write records, summary and table under `--out`.

Tested by: tests/decoder/bench/test_greedy.py
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from redraft.decoder.bench.greedy import (
    conditions_note,
    kernel_report,
    markdown_table,
    run_bench,
    summarize,
    write_outputs,
)
from redraft.decoder.bench.llama_cpp_method import LlamaCppMethod
from redraft.decoder.bench.methods import (
    DEFAULT_METHODS,
    DEFAULT_SAMPLING_METHODS,
    HF_METHODS,
    LLAMA_CPP,
    VARIANTS,
    HFMethod,
    Method,
    RedraftMethod,
    drafter_options,
    method_drafters,
    parse_methods,
    split_dense,
    warm_up,
)
from redraft.decoder.bench.questions import BenchError, load_questions, load_sampling_questions
from redraft.decoder.bench.results import write_results
from redraft.decoder.bench.sampling import markdown_samples, run_samples, summarize_samples
from redraft.decoder.budget import MAX_TREE_NODES, CostModel
from redraft.decoder.drafters.registry import (
    build_drafter,
    options_from_args,
    service_credentials,
)
from redraft.decoder.generate import Generator
from redraft.decoder.models.loading import load_model
from redraft.proto.models import DEFAULT_MODEL
from tqdm import tqdm


def machine_state() -> dict:
    """What a CPU timing depends on besides the code: threads, usable cores, load."""
    cpus = os.cpu_count()
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    return {"torch_threads": torch.get_num_threads(), "cpus": cpus, "cpus_allowed": allowed,
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def verifier_kernels(methods: Sequence[Method]) -> tuple:
    """(the packed kernels redraft's methods share or None, how their verifier runs the
    target, e.g. "lean packed exact"), for the report."""
    verifier = next((m.generator.verifier for m in methods if isinstance(m, RedraftMethod)),
                    None)
    return (None, None) if verifier is None else (verifier.kernels, verifier.kind)


def check_args(args: argparse.Namespace) -> None:
    """Everything that needs no model, checked before it loads."""
    if args.samples < 1:
        raise BenchError(f"--samples must be at least 1, got {args.samples}")
    if args.tree_nodes is not None and not 1 <= args.tree_nodes <= MAX_TREE_NODES:
        raise BenchError(f"--tree-nodes must be in 1..{MAX_TREE_NODES}, got {args.tree_nodes}")
    if args.max_new_tokens <= 0:
        raise BenchError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.per_category < 0:
        raise BenchError(f"--per-category must be >= 0, got {args.per_category}")
    if args.repeat < 1:
        raise BenchError(f"--repeat must be >= 1, got {args.repeat}")
    if args.samples > 1 and not args.temperature > 0:
        raise BenchError(f"--samples needs a --temperature above 0, got {args.temperature}")


def method_names(args: argparse.Namespace) -> list[str]:
    if args.methods is not None and not [m for m in args.methods.split(",") if m.strip()]:
        raise BenchError(f"--methods names no method: {args.methods!r}")
    if args.samples == 1:
        return parse_methods(args.methods or DEFAULT_METHODS,
                             bool(args.datastore or args.draft_service))
    names = [m.strip() for m in (args.methods or DEFAULT_SAMPLING_METHODS).split(",")
             if m.strip()]
    for m in names:
        if method_drafters(m) is None:
            raise BenchError(f"--samples runs redraft methods only; unknown method {m!r}")
    return names


def run(args: argparse.Namespace) -> int:
    """`redraft bench`: the run `args` describe, its results printed and written."""
    check_args(args)
    sampling = args.samples > 1
    names = method_names(args)
    per_category = args.per_category or None
    questions = (load_sampling_questions(args.questions, per_category) if sampling
                 else load_questions(args.questions, per_category))
    token, tls = service_credentials(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine_start = machine_state()
    model_name = args.model or DEFAULT_MODEL
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    choose = not args.always_packed
    # One forward-cost curve for every drafting method, loaded (or, on a cold cache, measured)
    # before any answer is timed; the methods' timed forwards keep correcting it.
    # (one per kind of weights: `-dense` methods verify on the dense copy)
    costs: dict[bool, CostModel | None] = {}
    for dense in {split_dense(n)[1] for n in names}:
        costs[dense] = None
        if args.tree_nodes:
            costs[dense] = CostModel.flat(args.tree_nodes)
        elif any(method_drafters(n) not in (None, "none") for n in names
                 if split_dense(n)[1] == dense):
            # (measuring it also packs the kernels redraft's methods share, before any answer)
            costs[dense] = CostModel.for_model(
                model, model_name, packed_kernels=not args.stock_kernels,
                choose_kernels=choose, block_weights=not dense)
    run_id = uuid.uuid4().hex[:12]
    methods: list[Method] = []
    drafters = []
    try:
        for name in names:
            if name == LLAMA_CPP:
                methods.append(LlamaCppMethod(args.model, tokenizer, torch.get_num_threads()))
                continue
            if name in HF_METHODS:
                methods.append(HFMethod(name, model, tokenizer,
                                        10 if name == "hf-pld" else None))
                continue
            base, dense = split_dense(name)
            options = {**options_from_args(args), **VARIANTS.get(base, ("", {}))[1]}
            drafter = build_drafter(method_drafters(name, args.model), model=model,
                                    tokenizer=tokenizer, model_name=model_name,
                                    datastore=args.datastore, draft_service=args.draft_service,
                                    token=token, tls=tls,
                                    options=drafter_options(name, options, run_id))
            drafters.append(drafter)
            # persist_state off: every run starts from the priors, so runs compare
            methods.append(RedraftMethod(name, Generator(
                model, tokenizer, drafter, model_name=model_name, cost=costs[dense],
                persist_state=False, packed_kernels=not args.stock_kernels,
                choose_kernels=choose, block_weights=not dense)))
        warm_up(methods)
        rounds = args.samples if sampling else args.repeat
        with tqdm(total=len(questions) * len(methods) * rounds, unit="answer", file=sys.stderr,
                  desc="samples" if sampling else "spec-bench") as bar:
            if sampling:
                generators = {m.name: m.generator for m in methods}
                records = run_samples(questions, generators, args.samples, args.temperature,
                                      args.max_new_tokens, progress=bar.update)
            else:
                records = run_bench(questions, methods, model, tokenizer, args.max_new_tokens,
                                    progress=bar.update, repeat=args.repeat)
    finally:
        for d in drafters:
            if d is not None:
                d.close()
        for m in methods:
            if isinstance(m, LlamaCppMethod):
                m.close()
    out = Path(args.out)
    common = {"model": model_name, "questions": len(questions)}
    if sampling:
        summary = summarize_samples(records)
        meta = {**common, "samples": args.samples, "temperature": args.temperature,
                "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
                "methods": names, "datastore": args.datastore,
                "draft_service": args.draft_service, "torch_threads": torch.get_num_threads(),
                "run_id": run_id}
        table = markdown_samples(summary, args.samples)
        write_results(out, records, summary, meta, table)
        print(table)
        print(f"results in {out}/ (records.jsonl, summary.json, summary.md)")
        return 0
    summary = summarize(records)
    cost = costs.get(False) or costs.get(True)  # the block kernel's, where both ran
    meta = {**common, "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
            "repeat": args.repeat, "methods": names, "datastore": args.datastore,
            "draft_service": args.draft_service, "device": str(model.device),
            "machine_start": machine_start, "machine_end": machine_state(),
            # redraft's forwards run on packed oneDNN weights on a CPU; HF's on stock kernels
            "kernels": kernel_report(records, *verifier_kernels(methods), choose),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "cost_curve": cost.describe() if cost is not None else None}
    write_outputs(out, records, summary, names, meta)
    print(markdown_table(summary, names))
    print(conditions_note(meta))
    print(f"results in {out}/ (records.jsonl, summary.json, summary.md, speedup.png)")
    return 0
