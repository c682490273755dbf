"""The README stays a front door: short, its drafter table true to the registry, and every
relative link in it and in docs/ pointing at something that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redraft.decoder.drafters.registry import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 300

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link inside a code block is not a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def section(text: str, title: str) -> list[str]:
    """The prose lines under the level-2 heading `title`, up to the next level-2 heading."""
    lines = prose_lines(text)
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def table_names(lines: list[str]) -> list[str]:
    """The first column of a Markdown table whose names are written as `code`."""
    names = []
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and re.fullmatch(r"`[^`]+`", cells[0]):
            names.append(cells[0].strip("`"))
    return names


def slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's rule) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(text):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            result.add(base if n == 0 else f"{base}-{n}")
    return result


def broken_links(path: Path) -> list[str]:
    """Relative links of `path` whose file (or heading anchor) does not exist."""
    text = path.read_text(encoding="utf-8")
    broken = []
    for line in prose_lines(text):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # http:, https:, mailto: ... are not checked here
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(
                dest.read_text(encoding="utf-8")
            ):
                broken.append(f"{target} (no such heading)")
    return broken


def test_readme_is_a_front_door() -> None:
    n_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert n_lines <= MAX_README_LINES, f"README.md has {n_lines} lines"


def test_drafter_table_matches_the_registry() -> None:
    names = table_names(section(README.read_text(encoding="utf-8"), "Drafters"))
    assert len(names) == len(set(names)), f"a drafter appears twice: {names}"
    assert sorted(names) == sorted(REGISTRY), (
        f"README drafter table {sorted(names)} != registry {sorted(REGISTRY)}"
    )


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """A wrong table, a missing file and a missing heading are all caught."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Title\n\n## Drafters\n\n| name | from |\n|---|---|\n| `pld` | x |\n| `nope` | y |\n\n"
        "## Next\n\n[gone](missing.md) [bad anchor](#nowhere) [fine](#title) "
        "[web](https://example.org)\n```\n[in code](also-missing.md)\n```\n",
        encoding="utf-8",
    )
    names = table_names(section(doc.read_text(encoding="utf-8"), "Drafters"))
    assert names == ["pld", "nope"] and sorted(names) != sorted(REGISTRY)
    assert broken_links(doc) == ["missing.md (no such file)", "#nowhere (no such heading)"]
