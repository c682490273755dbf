"""Generate the self-distillation corpus: the default model's own greedy answers.

What the target itself tends to say is what it will accept, so a datastore of its own
answers drafts well for chat and math. Prompts come from three sources:

- `gsm8k`: the GSM8K *training* questions (never the test split, which Spec-Bench uses);
- `code`: code-writing requests derived from public functions, then public methods, of the
  standard library (name, signature and the first line of the docstring);
- `instruct`: general instructions and short factual questions from templates and topics.

Spec-Bench questions are never used. Output is JSONL, one chat record per prompt
(`{"id", "source", "messages": [user, assistant]}`), appended as batches finish so an
interrupted run resumes where it stopped.

    python -m tools.make_selfdistill_corpus --out tools/corpora/self_distill.jsonl \
        --gsm8k ../shared/data/gsm8k/train.jsonl --limit 6000

Batches are generated on the packed CPU kernels (`redraft.decoder.kernels`), about twice as
fast as stock kernels; `--sources code` (etc.) lets two processes share the work.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from redraft.proto.models import DEFAULT_MODEL

TOPICS = [
    "photosynthesis", "the French Revolution", "machine learning", "climate change",
    "the water cycle", "personal budgeting", "healthy sleep habits", "the Roman Empire",
    "black holes", "public speaking", "vaccines", "renewable energy", "the stock market",
    "time management", "the human immune system", "World War II", "plate tectonics",
    "electric cars", "remote work", "the Renaissance", "quantum computing", "inflation",
    "the theory of evolution", "learning a new language", "volcanoes", "social media",
    "the internet", "meditation", "ancient Egypt", "recycling", "DNA", "the Moon landing",
    "supply and demand", "honeybees", "the printing press", "cybersecurity", "marathon training",
    "coral reefs", "the Industrial Revolution", "gardening", "democracy", "antibiotics",
    "the solar system", "cooking pasta", "job interviews", "the Great Wall of China",
    "artificial intelligence ethics", "earthquakes", "the Olympic Games", "rainforests",
    # Appended later: ids index these lists, so new entries go at the end.
    "the Amazon River", "Shakespeare", "the Cold War", "the periodic table", "jazz music",
    "the Eiffel Tower", "the human heart", "chess", "the Mongol Empire", "penicillin",
    "the Great Depression", "hurricanes", "the Beatles", "Mount Everest", "the Silk Road",
    "nuclear power", "the American Civil War", "the Nile", "football (soccer)", "opera",
    "the Sahara Desert", "the Titanic", "Albert Einstein", "the Internet of Things",
    "the Pacific Ocean", "the Byzantine Empire", "baking bread", "the electoral college",
    "glaciers", "the Mona Lisa", "tea", "the Berlin Wall", "Antarctica", "the printing of money",
    "the Declaration of Independence", "the Hubble Space Telescope", "the Aztecs",
    "basketball", "the Statue of Liberty", "coffee", "the Milky Way", "Mozart",
    "the United Nations", "tsunamis", "the Wright brothers", "the human brain", "bitcoin",
    "the Ottoman Empire", "photosynthesis in algae", "the Panama Canal",
]
TEMPLATES = [
    "Explain {t} in simple terms.",
    "Write a short blog post about {t}.",
    "Give me five interesting facts about {t}.",
    "What are the pros and cons of {t}?",
    "Summarize the key ideas of {t} in a few sentences.",
    "Write a short story that involves {t}.",
    "Pretend you are a teacher and give a lesson on {t}.",
    "Write an email to a friend recommending they learn about {t}.",
    "What are common misconceptions about {t}?",
    "Compare {t} with something from everyday life to explain it.",
    # Appended later, as above; short factual questions like a search engine gets.
    "What is {t}?",
    "How does {t} work?",
    "Why is {t} important?",
    "What is the history of {t}?",
    "Who are the most important people associated with {t}?",
    "When did {t} first become well known?",
    "Where can I learn more about {t}?",
    "Answer in one sentence: what is the most surprising fact about {t}?",
    "Write a haiku about {t}.",
    "Write a dialogue between two friends discussing {t}.",
]


def gsm8k_prompts(path: str) -> Iterator[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            yield f"gsm8k-{i}", json.loads(line)["question"]


def code_prompts(seed: int = 0) -> Iterator[tuple[str, str]]:
    """One request per public, documented stdlib function or method, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, str]] = []
    methods: list[tuple[str, str]] = []
    seen: set[str] = set()
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                request = _code_request(node)
                if request:
                    found.append((f"code-{path.stem}.{node.name}", request))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for item in node.body:  # methods come after all functions (see below)
                    request = _code_request(item, owner=node.name)
                    pid = f"code-{path.stem}.{node.name}.{getattr(item, 'name', '')}"
                    if request and pid not in seen:  # a property's getter and setter share it
                        seen.add(pid)
                        methods.append((pid, request))
    random.Random(seed).shuffle(found)
    random.Random(seed).shuffle(methods)
    # Functions first, then methods: ids done by an earlier run stay a prefix of the order.
    yield from found
    yield from methods


def _code_request(node, owner: str | None = None) -> str | None:
    """A code-writing request from a public, documented function's signature and summary."""
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node)
    if not doc:
        return None
    summary = doc.strip().splitlines()[0].strip().rstrip(".")
    if len(summary) < 15:
        return None
    args = ", ".join(a.arg for a in node.args.args)
    what = f"function `{node.name}" if owner is None else f"method `{owner}.{node.name}"
    return (
        f"Write a Python {what}({args})` that does the following: "
        f"{summary}. Include a docstring and a short example."
    )


def instruct_prompts(seed: int = 0) -> Iterator[tuple[str, str]]:
    pairs = [(t, tpl) for t in TOPICS for tpl in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    for t, tpl in pairs:
        yield f"instruct-{TEMPLATES.index(tpl)}-{TOPICS.index(t)}", tpl.format(t=t)


def interleave(*sources: Iterator[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """Round-robin over sources so an interrupted run still covers every kind of prompt."""
    iters = list(sources)
    while iters:
        for it in list(iters):
            try:
                yield next(it)
            except StopIteration:
                iters.remove(it)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gsm8k", help="GSM8K train.jsonl (training split only)")
    ap.add_argument("--limit", type=int, default=1000, help="total prompts to answer")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--sources", default="gsm8k,code,instruct",
                    help="comma-separated prompt kinds to answer (gsm8k needs --gsm8k)")
    args = ap.parse_args(argv)

    import contextlib

    import torch
    from redraft.decoder.kernels import packed_linears
    from redraft.proto.models import load_tokenizer, resolve_model
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    tok = load_tokenizer(args.model)
    src = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(src.path, **src.kwargs()).eval()
    tok.padding_side = "left"
    packed = packed_linears(model)  # batched CPU generation is ~2x faster on packed weights

    done: set[str] = set()
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            done = {json.loads(line)["id"] for line in f if line.strip()}
    kinds = {k.strip() for k in args.sources.split(",") if k.strip()}
    unknown = kinds - {"gsm8k", "code", "instruct"}
    if unknown:
        ap.error(f"unknown prompt kind(s): {', '.join(sorted(unknown))}")
    sources = []
    if "gsm8k" in kinds and args.gsm8k:
        sources.append(gsm8k_prompts(args.gsm8k))
    if "code" in kinds:
        sources.append(code_prompts())
    if "instruct" in kinds:
        sources.append(instruct_prompts())
    todo = [(i, p) for i, p in interleave(*sources) if i not in done]
    todo = todo[: max(0, args.limit - len(done))]
    print(f"{len(done)} already done, {len(todo)} to generate", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    start, n_tokens = time.time(), 0
    for b in range(0, len(todo), args.batch_size):
        batch = todo[b : b + args.batch_size]
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for _, p in batch
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with packed.active() if packed is not None else contextlib.nullcontext():
            out = model.generate(
                **enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        with open(args.out, "a", encoding="utf-8") as f:
            for (pid, prompt), ids in zip(batch, new):
                ids = [t for t in ids.tolist() if t != tok.pad_token_id]
                n_tokens += len(ids)
                answer = tok.decode(ids, skip_special_tokens=True).strip()
                record = {
                    "id": pid,
                    "source": pid.split("-")[0],
                    "messages": [
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": answer},
                    ],
                }
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        rate = n_tokens / (time.time() - start)
        print(f"{b + len(batch)}/{len(todo)} prompts, {rate:.0f} tok/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
