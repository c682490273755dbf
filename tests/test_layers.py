"""The layout's import rules, checked on the source of every module under proto/, datastore/
and decoder/ (function-local imports included, so a cycle cannot hide inside a function).

Layers, and what each may not import:

- `proto` (the contract and the shared base): nothing else of redraft.
- `datastore` never imports `decoder`. Inside it, storage (the top-level modules) imports
  neither drafting, the service nor the CLI; `drafting` neither the service nor the CLI; the
  service not the CLI.
- `decoder`: the loop (the top-level modules) imports neither drafters, models, heads, the
  benchmark, the CLI nor anything of the datastore side; `models` neither drafters, heads,
  the benchmark, the CLI nor the datastore side; `heads` neither drafters, the benchmark,
  the CLI nor the datastore side; `drafters` neither the benchmark nor the CLI.
- The benchmark and the CLI are leaves: only the CLI imports the benchmark, only the CLI
  imports itself (the datastore's commands included).
- `engines` (adapters that serving engines load) is a leaf too: nothing of redraft imports it,
  and it imports neither the loop, models, heads, drafters, the benchmark nor the CLI.
- `policy` (`redraft.decoder.policy`: calibration and the budget's rule, shared by the loop
  and the engines) imports nothing of the decoder nor of the datastore side; it and the
  engines import without torch (checked in a process where torch cannot be imported).
- `source` (`redraft.decoder.draft_source`: a generation's retrieval drafts and their
  fallback, shared by the drafters and the engines) imports nothing of the decoder but the
  policy; the loop, models and heads do not import it; it imports without torch too.
- From the datastore side the decoder imports only its public surfaces: `redraft.datastore`,
  `redraft.datastore.drafting`, `redraft.datastore.service.client` and
  `redraft.datastore.service.batch_client` (and its CLI, the `redraft` entry point's).

The package facades exempt from the layer rules are listed in `FACADES`. Besides: no import
cycle between modules, no two modules with one basename, and every function-local import
says why it is one (`# lazy: <why>` on its line or just above it).

Every module (a package's `__init__` aside) is found from its tests by name: it has a test
file named after it in the mirrored folder (`datastore/service/wire.py`:
`tests/datastore/service/test_wire.py`; a compiled `_name.cpp`: `test_name.py`), or it names
the files that test it in one fixed form, a paragraph of its docstring (a C++ file: of its
leading comment) that starts `Tested by:` and lists paths from the repository root
(`Tested by: tests/datastore/service/test_server.py, tests/datastore/service/test_client.py`),
each of which exists.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"proto": "redraft.proto", "datastore": "redraft.datastore",
            "decoder": "redraft.decoder"}

# Package `__init__` facades that re-export from several layers: exempt from the layer rules
# (not from the cycle, basename and lazy-import checks).
FACADES = {"redraft.decoder"}

DATASTORE = {"storage", "drafting", "service", "datastore-cli"}
DECODER = {"loop", "policy", "source", "models", "drafters", "heads", "bench", "cli",
           "engines"}
FORBIDDEN: dict[str, set[str]] = {
    "proto": DATASTORE | DECODER,
    "storage": {"drafting", "service", "datastore-cli"} | DECODER,
    "drafting": {"service", "datastore-cli"} | DECODER,
    "service": {"datastore-cli"} | DECODER,
    "datastore-cli": DECODER,
    "loop": {"source", "models", "drafters", "heads", "bench", "cli"} | DATASTORE,
    "models": {"source", "drafters", "heads", "bench", "cli"} | DATASTORE,
    "heads": {"source", "drafters", "bench", "cli"} | DATASTORE,
    "drafters": {"bench", "cli"},
    "bench": {"cli"},
    "cli": set(),
    "engines": {"loop", "models", "drafters", "heads", "bench", "cli"},
    "policy": (DECODER - {"policy"}) | DATASTORE,
    "source": DECODER - {"source", "policy"},
}
# Who may import a leaf layer at all.
LEAVES = {"bench": {"bench", "cli"}, "cli": {"cli"}, "datastore-cli": {"datastore-cli", "cli"},
          "engines": {"engines"}}
# What the decoder may import from the datastore side.
DATASTORE_SURFACES = {"redraft.datastore", "redraft.datastore.drafting",
                      "redraft.datastore.service.client",
                      "redraft.datastore.service.batch_client"}
CLI_ENTRY_SURFACES = {"redraft.datastore.cli"}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path

    @property
    def where(self) -> str:
        return str(self.path.relative_to(ROOT))


@dataclass(frozen=True)
class Import:
    source: Module
    target: str
    line: int
    local: bool  # inside a function

    @property
    def where(self) -> str:
        return f"{self.source.where}:{self.line}"


def modules() -> dict[str, Module]:
    """Every module: the Python files, and the extensions built from a C++ file of the same
    name (`_core.cpp` is module `_core` of its folder; it imports nothing of redraft)."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted([*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.cpp")]):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = Module(".".join([package, *parts]), path)
    return out


def imports(known: dict[str, Module]) -> list[Import]:
    """Every `import redraft...` / `from redraft... import` of every module, resolved to the
    module it names (`from pkg import name` is `pkg.name` where that is a module)."""
    out = []
    for mod in known.values():
        if mod.path.suffix != ".py":
            continue
        tree = ast.parse(mod.path.read_text(encoding="utf-8"), str(mod.path))
        for node, local in _walk(tree, False):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                           else node.module for a in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                if target.startswith("redraft.") and target != mod.name:
                    out.append(Import(mod, target, node.lineno, local))
    return out


def _walk(node: ast.AST, local: bool):
    for child in ast.iter_child_nodes(node):
        yield child, local
        inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner)


def layer(name: str) -> str:
    for prefix, kind in (("redraft.proto", "proto"), ("redraft.datastore.drafting", "drafting"),
                         ("redraft.datastore.service", "service"),
                         ("redraft.datastore.cli", "datastore-cli"),
                         ("redraft.datastore", "storage"), ("redraft.decoder.drafters", "drafters"),
                         ("redraft.decoder.models", "models"), ("redraft.decoder.heads", "heads"),
                         ("redraft.decoder.bench", "bench"), ("redraft.decoder.cli", "cli"),
                         ("redraft.decoder.engines", "engines"),
                         ("redraft.decoder.policy", "policy"),
                         ("redraft.decoder.draft_source", "source"),
                         ("redraft.decoder", "loop")):
        if name == prefix or name.startswith(prefix + "."):
            return kind
    raise ValueError(name)


KNOWN = modules()
IMPORTS = imports(KNOWN)


def test_every_import_names_a_module_that_exists():
    missing = [f"{i.where}: imports {i.target}, which is no module" for i in IMPORTS
               if i.target not in KNOWN]
    assert not missing, "\n".join(missing)


def test_no_import_goes_against_the_layers():
    bad = []
    for i in IMPORTS:
        if i.source.name in FACADES or i.target not in KNOWN:
            continue
        src, dst = layer(i.source.name), layer(i.target)
        if dst in FORBIDDEN[src]:
            bad.append(f"{i.where}: {src} module {i.source.name} imports {dst} module {i.target}")
        if dst in LEAVES and src not in LEAVES[dst]:
            bad.append(f"{i.where}: {i.target} is a leaf ({dst}); {i.source.name} imports it")
        if src in DECODER and dst in DATASTORE:
            allowed = DATASTORE_SURFACES | (CLI_ENTRY_SURFACES if src == "cli" else set())
            if i.target not in allowed:
                bad.append(f"{i.where}: the decoder imports {i.target}; from the datastore "
                           f"side it may import only {', '.join(sorted(allowed))}")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for i in IMPORTS:
        if i.target in KNOWN:
            edges[i.source.name].setdefault(i.target, i)
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                loop = path[path.index(target):] + [target]
                cycles.append(" -> ".join(
                    f"{a} ({edges[a][b].where})" for a, b in zip(loop, loop[1:])) + f" -> {target}")
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(KNOWN):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_two_modules_share_a_basename():
    by_name = defaultdict(list)
    for mod in KNOWN.values():
        if mod.path.name != "__init__.py":
            by_name[mod.path.name].append(mod.where)
    clashes = [f"{name}: {', '.join(paths)}" for name, paths in sorted(by_name.items())
               if len(paths) > 1]
    assert not clashes, "\n".join(clashes)


def test_every_function_local_import_says_why():
    bad = []
    for mod in KNOWN.values():
        if mod.path.suffix != ".py":
            continue
        text = mod.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node, local in _walk(ast.parse(text, str(mod.path)), False):
            if not local or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            said = lines[node.lineno - 1 : node.end_lineno]
            above = node.lineno - 2
            while above >= 0 and lines[above].strip().startswith("#"):
                said.append(lines[above])
                above -= 1
            if not any("# lazy:" in line for line in said):
                bad.append(f"{mod.where}:{node.lineno}: function-local import without a "
                           "`# lazy: <why>` comment")
    assert not bad, "\n".join(bad)


def test_the_shared_base_imports_neither_torch_nor_grpc():
    code = ("import sys\n"
            "import redraft.proto.errors, redraft.proto.files, redraft.proto.models\n"
            "import redraft.proto.tree\n"
            "heavy = sorted({'torch', 'grpc', 'transformers'} & set(sys.modules))\n"
            "assert not heavy, heavy\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_the_policy_and_the_engines_import_without_torch():
    """The serving engines' adapters may run where torch is not installed: they and the policy
    they share with the loop must import in a process where `import torch` fails."""
    engines = sorted(name for name, mod in KNOWN.items()
                     if layer(name) in ("engines", "policy", "source")
                     and mod.path.suffix == ".py")
    assert "redraft.decoder.policy" in engines and "redraft.decoder.engines.pacing" in engines
    code = ("import importlib, sys\n"
            "sys.modules['torch'] = None  # any import of torch now raises ImportError\n"
            f"for name in {engines!r}:\n"
            "    importlib.import_module(name)\n"
            "heavy = sorted({'transformers'} & set(sys.modules))\n"
            "assert not heavy, heavy\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_every_package_is_installed():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    packages = {name for name, mod in KNOWN.items() if mod.path.name == "__init__.py"}
    assert packages == listed, f"pyproject.toml lists {sorted(listed - packages)} that are no " \
        f"packages and misses {sorted(packages - listed)}"


# Generated from proto/draft.proto (`make proto`): no docstring of ours to carry the line.
GENERATED = {"redraft.proto.draft_pb2": ("tests/datastore/service/test_wire.py",),
             "redraft.proto.draft_pb2_grpc": ("tests/datastore/service/test_wire.py",)}
_TEST_PATH = re.compile(r"tests/[\w/]+\.py")


def own_test_file(mod: Module) -> Path:
    """The test file named after `mod`: tests/<its folder>/test_<its name>.py."""
    rel = mod.path.relative_to(ROOT)
    return ROOT / "tests" / rel.parent / f"test_{rel.stem.lstrip('_')}.py"


def named_tests(path: Path) -> tuple[str, ...] | None:
    """The files a module's `Tested by:` paragraph names, None without one: in a Python
    module's docstring, in a C++ file's leading `//` comment. The paragraph runs on while its
    lines hold nothing but paths."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        lines = (ast.get_docstring(ast.parse(text, str(path))) or "").splitlines()
    else:
        lines = []
        for line in text.splitlines():
            if not line.startswith("//"):
                break
            lines.append(line[2:].strip())
    for i, line in enumerate(lines):
        if line.startswith("Tested by:"):
            named = _TEST_PATH.findall(line)
            for more in lines[i + 1 :]:
                if not more.strip() or _TEST_PATH.sub("", more).strip(" ,"):
                    break
                named += _TEST_PATH.findall(more)
            return tuple(named)
    return None


def test_every_module_has_its_test_file_or_names_the_files_that_test_it():
    bad = []
    for name, mod in sorted(KNOWN.items()):
        if mod.path.name == "__init__.py":
            continue
        named = GENERATED.get(name) or named_tests(mod.path)
        own = own_test_file(mod)
        if named is None and not own.exists():
            bad.append(f"{mod.where}: no {own.relative_to(ROOT)}, and no `Tested by:` line "
                       "naming the files that test it")
        elif named is not None and not named:
            bad.append(f"{mod.where}: its `Tested by:` line names no tests/...py file")
        bad += [f"{mod.where}: `Tested by:` names {f}, which does not exist"
                for f in named or () if not (ROOT / f).is_file()]
    assert not bad, "\n".join(bad)


def test_the_tested_by_line_is_read_as_written(tmp_path):
    """The paragraph's paths on one line or several; prose after it is not read as paths."""
    module = tmp_path / "m.py"
    module.write_text('"""Why.\n\nTested by: tests/a/test_x.py, tests/b/test_y.py,\n'
                      'tests/test_z.py\nMore prose about tests/elsewhere.py.\n"""\n')
    assert named_tests(module) == ("tests/a/test_x.py", "tests/b/test_y.py", "tests/test_z.py")
    module.write_text('"""Why, with no line."""\n')
    assert named_tests(module) is None
    core = tmp_path / "_m.cpp"
    core.write_text("// What.\n// Tested by: tests/test_m.py\n\n// Tested by: tests/no.py\n")
    assert named_tests(core) == ("tests/test_m.py",)
    mapping = Module("redraft.datastore._mapping", ROOT / "datastore" / "_mapping.cpp")
    assert own_test_file(mapping) == ROOT / "tests" / "datastore" / "test_mapping.py"
