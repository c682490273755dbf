"""The shipped corpora must never contain a Spec-Bench question (the public benchmark)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("REDRAFT_SHARED_DATA", REPO.parent / "shared" / "data"))
CORPORA = sorted((REPO / "tools" / "corpora").glob("*.jsonl"))


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _spec_bench_turns() -> list[str]:
    path = SHARED / "spec_bench" / "question.jsonl"
    if not path.is_file():
        pytest.skip(f"Spec-Bench questions not found (set REDRAFT_SHARED_DATA): {path}")
    turns = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            turns.extend(_norm(t) for t in json.loads(line)["turns"])
    return turns


def test_shipped_corpora_exist_and_are_chat_records():
    assert CORPORA, "tools/corpora/ ships no corpus"
    for path in CORPORA:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                rec = json.loads(line)
                roles = [m["role"] for m in rec["messages"]]
                assert roles == ["user", "assistant"], f"{path.name}:{n}"
                assert rec["source"] in {"gsm8k", "code", "instruct"}, f"{path.name}:{n}"


def find_leaks(jsonl: str, turns: list[str]) -> list[str]:
    """Questions whose first 80 characters (specific enough to identify one) appear in any
    message of a JSONL chat corpus, ignoring case and white space."""
    contents = [
        m["content"] for line in jsonl.splitlines() if line.strip()
        for m in json.loads(line)["messages"]
    ]
    text = _norm("\n".join(contents))
    return [turn[:80] for turn in turns if turn[:80] in text]


def test_no_spec_bench_question_in_shipped_corpora():
    turns = _spec_bench_turns()
    assert len(turns) > 480
    for path in CORPORA:
        leaks = find_leaks(path.read_text(encoding="utf-8"), turns)
        assert not leaks, f"Spec-Bench questions in {path.name}: {leaks[:3]}"


def test_leak_check_catches_a_reformatted_question():
    turns = _spec_bench_turns()
    question = turns[3]
    record = json.dumps({"messages": [{"role": "user", "content": "Q:\n" + question.upper()}]})
    assert find_leaks(record, turns) == [question[:80]]
