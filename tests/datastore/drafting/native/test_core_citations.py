"""The compiled core names the Python original of each of its functions as
`Python: redraft.<module>.<qualified name>`: every such citation in its sources must resolve
(import the module, getattr the rest), so that renaming the Python side breaks this test
instead of leaving a comment that points nowhere; and no pairing is written any other way
(`Reader.propose`, `merge_drafts`, `draft.Draft` named functions that had long gone).

The same holds for the prose: every full dotted name (`redraft.<module>.<name>`) in README.md,
docs/*.md and the comments and docstrings of the library, the tests and the tools resolves,
and so does every short one that names a library function, class or constant by its
module's basename (`retrieval.retrieval_tree`); no text names a module the renames retired
(`RETIRED`), by its basename or as a file."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
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


# Modules the renames retired (`datastore/service/batching.py` is `batch_rpc.py` now, and so
# on): a comment or a page that names one points nowhere.
RETIRED = {"base", "batch", "batched", "batching", "bench_samples", "calibration", "chain",
           "commands", "draft", "draft_models", "learned", "learning", "medusa_command",
           "medusa_train", "merge", "service_cli", "service_stats", "session", "sessions",
           "tokenizer"}
# Dotted words in prose that look like a module's name and are not: a key of the segment
# file (`format`), written beside the module `manifest`.
NOT_NAMES = {"manifest.crc32"}
FULL_NAME = re.compile(r"(?<![\w.])redraft(?:\.[A-Za-z_]\w*)+")
SHORT_NAME = re.compile(r"(?<![\w./-])([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)")
RETIRED_FILE = re.compile(r"(?<![\w./-])(" + "|".join(sorted(RETIRED)) + r")\.py\b")


def library() -> dict[str, Path]:
    """Every module of the library by its dotted name (the generated stubs aside)."""
    out = {}
    for folder in ("proto", "datastore", "decoder"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["redraft", *parts])] = path
    return out


LIBRARY = library()
BASENAMES = {name.rsplit(".", 1)[1]: name for name, path in LIBRARY.items()
             if path.name != "__init__.py"}


def top_level_names() -> set[str]:
    """The functions, classes and UPPER_CASE constants the library defines at module level:
    a dotted word ending in one of them is a name, not a variable's attribute."""
    names = set()
    for path in LIBRARY.values():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper())
    return names


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of what a person reads in `path`: every line of a Markdown page;
    a Python file's comments and its module, class and function docstrings."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), 1))
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    out = [(tok.start[0], tok.string) for tok in tokens if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                first = node.body[0].lineno
                out += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    return sorted(out)


def prose_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("proto", "datastore", "decoder", "tests", "tools"):
        files += [p for p in sorted((ROOT / folder).rglob("*.py"))
                  if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    return files


def stale_names(lines: list[tuple[str, str]], top: set[str]) -> list[str]:
    """What in `lines` ((where, text) pairs) names something that is not there."""
    bad = []
    for where, text in lines:
        for match in FULL_NAME.finditer(text):
            name = match.group(0)
            if name.startswith("redraft.v1"):
                continue  # the gRPC package of draft.proto, no Python module
            try:
                resolve(name)
            except LookupError as exc:
                bad.append(f"{where}: {name}: {exc}")
        for match in SHORT_NAME.finditer(text):
            module, rest = match.group(1), match.group(2)
            if rest[1:].split(".")[0] not in top or match.group(0) in NOT_NAMES:
                continue
            if module in RETIRED:
                bad.append(f"{where}: {match.group(0)}: module {module!r} was renamed")
            elif module in BASENAMES:
                try:
                    resolve(BASENAMES[module] + rest)
                except LookupError as exc:
                    bad.append(f"{where}: {match.group(0)}: {exc}")
        bad += [f"{where}: {m.group(0)}: a retired module's file"
                for m in RETIRED_FILE.finditer(text)]
    return bad


def test_every_name_in_the_docs_comments_and_docstrings_resolves():
    top = top_level_names()
    lines = [(f"{path.relative_to(ROOT)}:{n}", text) for path in prose_files()
             for n, text in prose_lines(path)]
    assert len(lines) > 5000
    bad = stale_names(lines, top)
    assert not bad, "\n".join(bad)


def test_no_retired_module_name_is_a_module_again():
    """A retired name given to a new module leaves RETIRED (the checks would misread it)."""
    assert not RETIRED & set(BASENAMES)


def test_the_prose_check_can_fail():
    top = top_level_names()
    lines = [("a:1", "see redraft.datastore.service.batching and `session.SessionDrafter`"),
             ("a:2", "as `retrieval.SessionDrafter`, in learning.py"),
             ("a:3", "fine: `retrieval.retrieval_tree`, redraft.proto.tree.Tree, batch.reqs, "
                     "manifest.crc32, redraft.v1.Drafter")]
    bad = stale_names(lines, top)
    assert [b.split(": ")[1] for b in bad] == [
        "redraft.datastore.service.batching", "session.SessionDrafter",
        "retrieval.SessionDrafter", "learning.py"], bad
