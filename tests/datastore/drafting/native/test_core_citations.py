"""The compiled core names the Python original of each of its functions as
`Python: redraft.<module>.<qualified name>`: every such citation in its sources must resolve
(import the module, getattr the rest), so that renaming the Python side breaks this test
instead of leaving a comment that points nowhere; and no pairing is written any other way
(`Reader.propose`, `merge_drafts`, `draft.Draft` named functions that had long gone)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
CORE = ROOT / "datastore" / "drafting" / "native"
CITATION = re.compile(r"Python: (\S+)")
NAME = re.compile(r"redraft(\.[A-Za-z_][A-Za-z0-9_]*)+")
# A dotted Python-side name outside the citation form: a module or class of the reference
# followed by an attribute (a header's own file name, `tree.h`, is not one).
INFORMAL = re.compile(r"(?<![\w.:])(Reader|_Shard|PromptLookup|LearnedIndex|LearnedWriter|"
                      r"SessionDrafter|Tree|pld|draft|merge|learned|reader|tree|session|"
                      r"retrieval|prompt_lookup|batch)\.(?!h\b)[A-Za-z_]\w*")
NO_PYTHON_SIDE = {"arrays.h"}  # working arrays' storage: the reference has no counterpart


def core_sources() -> list[Path]:
    return sorted([*CORE.glob("*.h"), *CORE.glob("*.cpp")])


def citations() -> list[tuple[str, str]]:
    """(file:line, cited name) of every citation in the core's sources."""
    out = []
    for path in core_sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            out += [(f"{path.name}:{n}", m.group(1)) for m in CITATION.finditer(line)]
    return out


def resolve(name: str) -> object:
    """The object `name` names: its longest importable prefix, then attributes. LookupError
    naming what is missing."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for i, attr in enumerate(parts[cut:], cut):
            if not hasattr(obj, attr):
                raise LookupError(f"{'.'.join(parts[:i])} has no {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"no module of {name} imports")


def test_every_cited_python_name_resolves():
    cited = citations()
    # every header and the bindings cite their Python side
    assert {where.split(":")[0] for where, _ in cited} == \
        {p.name for p in core_sources()} - NO_PYTHON_SIDE
    assert len(cited) >= 40, cited
    bad = [f"{where}: {name!r} is not `redraft.<module>.<name>`" for where, name in cited
           if not NAME.fullmatch(name)]
    for where, name in cited:
        if NAME.fullmatch(name):
            try:
                resolve(name)
            except LookupError as exc:
                bad.append(f"{where}: {name}: {exc}")
    assert not bad, "\n".join(bad)


def test_no_pairing_is_written_another_way():
    bad = []
    for path in core_sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            comment = line.partition("//")[2]
            if "Python:" in comment:
                continue
            bad += [f"{path.name}:{n}: {m.group(0)}" for m in INFORMAL.finditer(comment)]
    assert not bad, "cite the Python side as `Python: redraft.<module>.<name>`:\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("gone", ["redraft.datastore.reader.Reader.propose",
                                  "redraft.datastore.drafting.retrieval._trie_draft",
                                  "redraft.proto.tree.merge_drafts",
                                  "redraft.proto.draft.Draft"])
def test_a_name_that_is_gone_does_not_resolve(gone):
    """What the comments named before: a citation of any of them would fail the test above."""
    with pytest.raises(LookupError):
        resolve(gone)


def test_a_cited_name_resolves_to_the_python_original():
    from redraft.datastore.drafting.prompt_lookup import continuation_tree
    from redraft.proto.tree import Tree

    assert resolve("redraft.datastore.drafting.prompt_lookup.continuation_tree") \
        is continuation_tree
    assert resolve("redraft.proto.tree.Tree.expected_accepted") is Tree.expected_accepted


def test_every_constant_the_core_copies_equals_its_python_original():
    """The headers keep their own copies of the reference's bounds (a compiled loop reads a
    constant); the core lists each by the Python name it copies, and each must still be
    that name's value."""
    from redraft.datastore.drafting.native import _core

    copied = _core.COPIED_CONSTANTS
    assert len(copied) >= 7
    bad = [f"{name}: core {value}, Python {resolve(name)}" for name, value in copied.items()
           if resolve(name) != value]
    assert not bad, "\n".join(bad)
