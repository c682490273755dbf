"""Writing a benchmark's results: every record (`records.jsonl`), the summary with the run's
conditions (`summary.json`) and its table (`summary.md`).

Tested by: tests/decoder/bench/test_greedy.py"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path


def write_results(out: Path, records: Sequence, summary: dict, meta: dict, table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "records.jsonl").open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    (out / "summary.json").write_text(json.dumps({**meta, **summary}, indent=2) + "\n")
    (out / "summary.md").write_text(table)
