"""The decoder's subcommand: `redraft generate`.

Everything a user can get wrong without loading the model (numbers, drafter names, prompt
files, datastore paths, model names) is checked first, so a typo costs milliseconds and
prints one line rather than a traceback after a ten-second model load.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

import torch
from redraft.datastore.cli import add_client_options
from redraft.decoder.budget import MAX_TREE_NODES, CostModel
from redraft.decoder.drafters.registry import (
    add_options,
    build_drafter,
    copying_drafters,
    default_drafters,
    known_names,
    options_from_args,
    parse_names,
    service_credentials,
)
from redraft.decoder.generate import (
    SEEDS,
    GenerationError,
    GenerationResult,
    GenerationStats,
    Generator,
    check_text,
)
from redraft.decoder.models.loading import add_dtype_option, load_model
from redraft.proto.files import read_input
from redraft.proto.jsonl import parse_record
from redraft.proto.models import DEFAULT_MODEL, load_tokenizer, resolve_model


def register(sub: argparse._SubParsersAction) -> None:
    """Add `generate` to the `redraft` parser."""
    p = sub.add_parser(
        "generate",
        help="generate text with lossless speculative decoding",
        description="Generate with the target model; drafts (prompt lookup, retrieval) only "
        "change the speed, never the output.",
    )
    p.add_argument("--model", default=None, help="model name, directory or .gguf file "
                   f"(default: {DEFAULT_MODEL})")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt, sent as a user message (chat template)")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help="JSONL: a 'prompt' string or a 'turns' list (Spec-Bench) per line")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafters", default=None,
                   help=f"{known_names()}, or a comma-separated combination such as "
                   "pld,rest (default: hybrid where the model has committed Medusa heads, "
                   f"else {copying_drafters(True)} with a datastore or draft service, else "
                   f"{copying_drafters(False)})")
    ds = p.add_mutually_exclusive_group()
    ds.add_argument("--draft-service", metavar="ADDR",
                    help="draft service address (host:port; replicas: several, comma-separated, "
                    "or dns:///name:port)")
    ds.add_argument("--datastore", metavar="DIR", help="datastore opened in this process")
    p.add_argument("--max-nodes", type=int, default=None,
                   help="cap on tree nodes per step (default: chosen from the hardware)")
    p.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                   help="verify the best N drafted nodes every step, ignoring this machine's "
                   "cost curve (tokens per forward at a fixed tree size, as on a GPU)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    add_dtype_option(p)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's; 1 is faster on busy machines). "
                        "Drafts never change the output at a given thread count, given or not; "
                        "on a GGUF model's blocks (the default) the count does not change it "
                        "either, on the dense copy plain decoding's own output may depend on it")
    p.add_argument("--raw", action="store_true",
                   help="use the prompt text as is, without the chat template")
    p.add_argument("--typical", action="store_true",
                   help="LOSSY: Medusa's typical acceptance (output may differ from the model's)")
    p.add_argument("--baseline", action="store_true",
                   help="also decode each prompt plainly and report the speed-up and whether "
                   "the tokens are identical")
    p.add_argument("--stock-kernels", action="store_true",
                   help="run the target on PyTorch's stock CPU kernels instead of packed oneDNN "
                        "weights (to isolate what drafting alone gains)")
    p.add_argument("--dense-weights", action="store_true",
                   help="verify on the model's dense copy (packed oneDNN) instead of the blocks "
                        "its GGUF file ships (the block kernel, the default where it runs)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_client_options(p)
    add_options(p)
    p.set_defaults(func=run_generate)


def read_prompts(path: str) -> list[list[str]]:
    """Each line: {"prompt": str} or {"turns": [str, ...]}; returns a list of turn lists."""
    try:
        lines = read_input(path).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationError(f"cannot read prompts file {path}: {exc}") from None
    out: list[list[str]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec = parse_record(line, f"{path}:{lineno}", GenerationError)
        turns = rec.get("turns") if isinstance(rec, dict) else None
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            turns = [rec["prompt"]]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise GenerationError(f"{path}:{lineno}: needs a 'prompt' string or a 'turns' list")
        if not all(t.strip() for t in turns):
            raise GenerationError(f"{path}:{lineno}: empty prompt")
        for t in turns:
            check_text(t, f"{path}:{lineno}: the prompt")
        out.append(turns)
    if not out:
        raise GenerationError(f"{path}: no prompts")
    return out


def check_args(args: argparse.Namespace) -> list[list[str]]:
    """Validate what needs no model; return the prompts as turn lists."""
    if args.max_new_tokens <= 0:
        raise GenerationError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise GenerationError(f"--temperature must be a finite number >= 0, got "
                              f"{args.temperature}")
    if not 0 < args.top_p <= 1:
        raise GenerationError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise GenerationError(f"--top-k must be >= 0, got {args.top_k}")
    if not 0 <= args.seed < SEEDS:
        raise GenerationError(f"--seed must be in 0..2**64-1, got {args.seed}")
    if args.threads is not None and args.threads <= 0:
        raise GenerationError(f"--threads must be positive, got {args.threads}")
    if args.max_nodes is not None and args.max_nodes < 0:
        raise GenerationError(f"--max-nodes must be >= 0, got {args.max_nodes}")
    if args.tree_nodes is not None and not 1 <= args.tree_nodes <= MAX_TREE_NODES:
        raise GenerationError(f"--tree-nodes must be in 1..{MAX_TREE_NODES}, "
                              f"got {args.tree_nodes}")
    if args.prompt is not None:
        if not args.prompt.strip():
            raise GenerationError("empty prompt")
        check_text(args.prompt, "--prompt")
        return [[args.prompt]]
    return read_prompts(args.prompts)


def run_generate(args: argparse.Namespace) -> int:

    logging.basicConfig(level=logging.WARNING, format="redraft: %(message)s")
    prompts = check_args(args)
    token, tls = service_credentials(args)
    if args.drafters is None:
        args.drafters = default_drafters(bool(args.datastore or args.draft_service), args.model)
    parse_names(args.drafters)  # unknown names fail before anything is loaded
    resolve_model(args.model)
    tokenizer = load_tokenizer(args.model)
    name = args.model or DEFAULT_MODEL

    def load():
        if args.threads:
            torch.set_num_threads(args.threads)
        return load_model(args.model, device=args.device, dtype=args.dtype)[0]

    # Drafters that need no model are built (and their inputs checked) before it loads.
    drafter = build_drafter(args.drafters, model_loader=load, tokenizer=tokenizer,
                            model_name=name,
                            datastore=args.datastore, draft_service=args.draft_service,
                            token=token, tls=tls, options=options_from_args(args))
    try:
        return _generate_all(args, prompts, drafter, load(), tokenizer, name)
    finally:
        if drafter is not None:
            drafter.close()


def _generate_all(args, prompts: list[list[str]], drafter, model, tokenizer, name: str) -> int:
    packed = not args.stock_kernels
    cost = CostModel.flat(args.tree_nodes) if args.tree_nodes else None
    blocks = not args.dense_weights
    gen = Generator(model, tokenizer, drafter, model_name=name, cost=cost,
                    max_nodes=args.max_nodes, persist_state=True, packed_kernels=packed,
                    block_weights=blocks)
    plain = (Generator(model, tokenizer, None, model_name=name, packed_kernels=packed,
                       block_weights=blocks) if args.baseline else None)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, seed=args.seed, typical=args.typical,
                  chat=not args.raw)
    totals = {"spec": 0.0, "plain": 0.0}
    _answer_all(args, prompts, gen, plain, kwargs, totals)
    if plain is not None and not args.json and len(prompts) > 1:
        print(f"[overall speed-up over plain decoding: "
              f"{totals['plain'] / max(totals['spec'], 1e-9):.2f}x]", file=sys.stderr)
    return 0


def _answer_all(args, prompts: list[list[str]], gen, plain, kwargs: dict, totals: dict) -> None:
    for turns in prompts:
        record = _run_turns(gen, turns, kwargs, stream=not args.json)
        if plain is not None:
            base = _run_turns(plain, turns, kwargs, stream=False)
            speedup = base["stats"]["seconds"] / max(record["stats"]["seconds"], 1e-9)
            record["baseline"] = {
                "seconds": base["stats"]["seconds"],
                "identical": base["tokens"] == record["tokens"],
                "speedup": round(speedup, 3),
            }
            totals["spec"] += record["stats"]["seconds"]
            totals["plain"] += base["stats"]["seconds"]
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(file=sys.stdout, flush=True)
            _report(record)


def _run_turns(gen, turns: list[str], kwargs: dict, stream: bool) -> dict:
    """Run a prompt turn by turn through the chat template; aggregate the stats."""
    messages: list[dict] = []
    results: list[GenerationResult] = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        prompt = messages if kwargs["chat"] else turn
        if stream:
            s = gen.stream(prompt, **kwargs)
            for piece in s:
                sys.stdout.write(piece)
                sys.stdout.flush()
            result = s.result
            if len(turns) > 1:
                sys.stdout.write("\n")
        else:
            result = gen.generate(prompt, **kwargs)
        results.append(result)
        messages.append({"role": "assistant", "content": result.text})
    total = GenerationStats()
    for r in results:
        s = r.stats
        total.prompt_tokens += s.prompt_tokens
        total.steps += s.steps
        total.new_tokens += s.new_tokens
        total.seconds += s.seconds
        total.prefill_seconds += s.prefill_seconds
        total.forward_seconds += s.forward_seconds
        total.packed_forwards += s.packed_forwards
        total.drafted += s.drafted
        total.drafter_errors += s.drafter_errors
        for k, v in s.accepted.items():
            total.accepted[k] = total.accepted.get(k, 0) + v
    record = {
        "tokens": [t for r in results for t in r.tokens],
        "text": "\n\n".join(r.text for r in results),
        "finish_reason": results[-1].finish_reason,
        "stats": total.to_dict(),
    }
    if len(results) > 1:
        record["turns"] = [r.to_dict() for r in results]
    return record


def _report(record: dict) -> None:
    s = record["stats"]
    line = (f"[{s['new_tokens']} tokens in {s['steps']} steps "
            f"({s['tokens_per_step']:.2f}/step), {s['seconds']:.2f} s, "
            f"{s['tokens_per_second']:.1f} tok/s")
    if s["accepted"]:
        line += ", accepted " + ", ".join(f"{k} {v}" for k, v in sorted(s["accepted"].items()))
    if s["drafter_errors"]:
        line += f", drafter errors {s['drafter_errors']} (fell back to local drafts)"
    if "baseline" in record:
        b = record["baseline"]
        line += (f"; plain decoding {b['seconds']:.2f} s -> speed-up {b['speedup']:.2f}x, "
                 f"{'identical' if b['identical'] else 'DIFFERENT'} tokens")
    print(line + "]", file=sys.stderr, flush=True)

