"""Spec-Bench questions: reading a question file, its six categories, and an even spread of
questions per category (all of them for greedy runs, math and coding for repeated
sampling).

Tested by: tests/decoder/bench/test_greedy.py, tests/decoder/bench/test_sampling.py"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from redraft.proto.errors import RedraftError
from redraft.proto.jsonl import parse_record

MT_BENCH = {
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
}
CATEGORY_NAMES = {
    "translation": "translation",
    "summarization": "summarization",
    "qa": "question answering",
    "math_reasoning": "mathematical reasoning",
    "rag": "retrieval-augmented generation",
}
MULTI_TURN = "multi-turn conversation"
CATEGORIES = [MULTI_TURN, *CATEGORY_NAMES.values()]
# Spec-Bench categories answered by the repeated-sampling workload: its math questions (GSM8K
# test) and MT-Bench's coding questions.
SAMPLING_CATEGORIES = {"math_reasoning": "mathematical reasoning", "coding": "coding"}


class BenchError(RedraftError):
    """Bad benchmark input: missing question file, unknown method, bad counts."""


@dataclass
class Question:
    question_id: int
    category: str  # one of CATEGORIES
    turns: list[str]


def load_questions(path: str | Path, per_category: int | None) -> list[Question]:
    """Spec-Bench questions grouped into its six categories; `per_category` spread evenly."""
    grouped = read_questions(
        path, lambda cat: MULTI_TURN if cat in MT_BENCH else CATEGORY_NAMES.get(cat, cat))
    if not grouped:
        raise BenchError(f"{path}: no questions")
    return pick_evenly(grouped, [*CATEGORIES, *sorted(set(grouped) - set(CATEGORIES))],
                       per_category)


def read_questions(path: str | Path, category: Callable[[str], str | None]
                   ) -> dict[str, list[Question]]:
    """A question file's records by `category(record's category)`; None leaves a record out."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"question file not found: {path}")
    grouped: dict[str, list[Question]] = defaultdict(list)
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = parse_record(line, f"{path}:{n}", BenchError)
            try:
                cat = category(rec["category"])
                if cat is not None:
                    grouped[cat].append(Question(int(rec["question_id"]), cat,
                                                 question_turns(rec["turns"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise BenchError(f"{path}:{n}: not a Spec-Bench question ({exc})") from None
    return grouped


def question_turns(turns: object) -> list[str]:
    """A question's turns: a non-empty list of non-empty strings (a string is not split into
    one turn per character, and a question without turns is no question)."""
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'turns' must be a non-empty list of strings, got {turns!r:.60}")
    if not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError("every turn must be a non-empty string")
    return turns


def pick_evenly(grouped: dict[str, list[Question]], order: Sequence[str],
                per_category: int | None) -> list[Question]:
    """`per_category` questions of each category in `order`, evenly spaced (so the 8 MT-Bench
    sub-categories all appear in "multi-turn")."""
    out: list[Question] = []
    for cat in order:
        qs = grouped.get(cat, [])
        if per_category and len(qs) > per_category:
            qs = [qs[i * len(qs) // per_category] for i in range(per_category)]
        out.extend(qs)
    return out


def load_sampling_questions(path: str | Path, per_category: int | None) -> list[Question]:
    """Spec-Bench's math and coding questions, `per_category` of each, evenly spaced."""
    grouped = read_questions(path, SAMPLING_CATEGORIES.get)
    if not grouped:
        raise BenchError(f"{path}: no math or coding questions")
    return pick_evenly(grouped, list(SAMPLING_CATEGORIES.values()), per_category)
