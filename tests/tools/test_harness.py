"""tools.harness, run as the tools run (`python -m` from the repository root): the record
every result starts with says the commit, whether the tree was dirty, the machine's cores and
load, Python and the exact command; a server started through it is gone when the block ends,
however it ends (an exception, or SIGTERM to the tool), and one that cannot start is one line
and exit status 2."""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from redraft.datastore import build_datastore

REPO = Path(__file__).resolve().parents[2]
FP = "sha256:harness-test"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("harness") / "ds")
    build_datastore(None, path, documents=[[1, 2, 3, 4, 5] * 8], fingerprint=FP,
                    vocab_size=16, corpus="c")
    return path


def tool(code: str, *args: str, **kw) -> subprocess.Popen:
    """`python -c code` from the repository root, as `python -m tools.x` would run."""
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=True).stdout


def gone(pids: list[int], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_result_starts_with_the_run_record(tmp_path):
    code = ("import sys; from tools import harness; run = harness.Run(); "
            "run.write(sys.argv[1], {'x': 1}); run.print([1, 2])")
    p = tool(code, str(tmp_path / "out" / "r.json"))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    written = json.loads((tmp_path / "out" / "r.json").read_text())
    printed = json.loads(out)
    assert list(written) == ["run", "x"] and written["x"] == 1
    assert printed["results"] == [1, 2]
    rec = written["run"]
    assert rec["commit"] == git("rev-parse", "HEAD").strip()
    assert rec["dirty"] == bool(git("status", "--porcelain", "--untracked-files=no").strip())
    assert rec["cores"] == os.cpu_count() and 1 <= rec["cores_usable"] <= rec["cores"]
    assert len(rec["load_average"]) == 3 and len(rec["load_average_end"]) == 3
    assert rec["python"] == platform.python_version()
    assert rec["command"] == shlex.join([os.path.basename(sys.executable), "-c", code,
                                         str(tmp_path / "out" / "r.json")])
    assert rec["seconds"] >= 0 and rec["started"].endswith("Z")


def test_the_server_is_gone_when_the_block_raises(store):
    code = ("import sys; from tools import harness\n"
            "try:\n"
            "    port = str(harness.free_port())\n"
            "    with harness.serving(sys.argv[1], '--port', port, '--workers', '2') as s:\n"
            "        import psutil; p = psutil.Process(s.pid)\n"
            "        print(' '.join(str(x.pid) for x in [p, *p.children(True)]), flush=True)\n"
            "        raise RuntimeError('the tool failed')\n"
            "except RuntimeError:\n"
            "    print('raised', flush=True)\n")
    p = tool(code, store)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    pids_line, said = out.splitlines()
    pids = [int(x) for x in pids_line.split()]
    assert len(pids) >= 3 and said == "raised"
    assert gone(pids, timeout=1)  # already gone when the block was left


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_sigterm_to_the_tool_stops_its_servers(store, inherited):
    """Also when the tool was started with SIGTERM ignored (a launcher's SIG_IGN passes
    through exec: a CI runner's did, and the tool slept on with its servers)."""
    code = ("import sys, time; from tools import harness\n"
            "with harness.serving(sys.argv[1]) as a, harness.serving(sys.argv[1]) as b:\n"
            "    print(a.pid, b.pid, flush=True)\n"
            "    time.sleep(300)\n")
    p = tool(code, store, preexec_fn=lambda: signal.signal(signal.SIGTERM, inherited))
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2, p.stderr.read() if p.poll() is not None else ""
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 128 + signal.SIGTERM
        assert gone(pids)
    finally:
        p.kill()
        p.wait()


def test_a_server_that_cannot_start_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "none"
    p = tool("import sys; from tools import harness\n"
             "with harness.serving(sys.argv[1]):\n    pass\n", str(missing))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2
    assert err == (f"tool: serve did not start (exited): redraft serve: error: {missing}: no "
                   "such datastore\n")


# A tool that needs an optional package imports only where it is installed.
NEEDS = {"bench_llama_cpp": "llama_cpp"}


def test_every_tool_imports_as_a_module_without_touching_sys_path():
    """The tools import each other as `tools.x` (a stale `from bench_service import ...`
    fails here) and none puts a folder on sys.path."""
    import importlib.util

    names = sorted(p.stem for p in (REPO / "tools").glob("*.py") if p.stem != "__init__")
    for name in names:
        source = (REPO / "tools" / f"{name}.py").read_text()
        assert "sys.path" not in source, f"tools/{name}.py edits sys.path"
    wanted = [n for n in names
              if n not in NEEDS or importlib.util.find_spec(NEEDS[n]) is not None]
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    p = tool(code, *(f"tools.{n}" for n in wanted))
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-3000:]
    assert len(wanted) >= 15
