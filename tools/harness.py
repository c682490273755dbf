"""What every tool shares: `redraft serve` started and stopped (`serving`), the record of
the run (the machine's cores and load, the commit and whether the tree was dirty, Python,
the exact command), and result files that start with that record.

Why: a measured number is only worth what is known of how it was measured. The tools once
recorded the machine each in its own way (or not at all), and started servers each their
own way; now a result says, the same way everywhere, under "run":

    {"run": {"command": "python -m tools.bench_service --datastore data/stdlib",
             "commit": "be5fc60...", "dirty": false, "cores": 16, "cores_usable": 2,
             "load_average": [1.9, 1.2, 0.8], "load_average_end": [2.1, 1.5, 0.9],
             "python": "3.11.9", "platform": "Linux-...", "started": "2026-12-03T17:00:00Z",
             "seconds": 42.1},
     ...the tool's own figures...}
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from redraft.datastore.service.spawn import ServeFailed, ServeProcess, free_port

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "Run", "ServeFailed", "ServeProcess", "free_port", "load_average",
           "machine", "serving"]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def command() -> str:
    """The command line this process was started with, as typed (`python -m tools.x ...`)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    if argv:
        argv[0] = os.path.basename(argv[0])
    return shlex.join(argv)


def load_average() -> list[float]:
    """The load average over 1, 5 and 15 minutes (rounded: 0.01 is below its noise)."""
    return [round(x, 2) for x in os.getloadavg()]


def tool_name() -> str:
    """The running tool's module name (`bench_service`), for its error lines."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = spec.name if spec is not None else Path(sys.argv[0]).stem
    name = name.rsplit(".", 1)[-1]
    return name if name and not name.startswith("-") else "tool"  # `python -c`: no name


def machine() -> dict[str, Any]:
    """The machine and the code now: cores (all, and those this process may use), load
    average (1, 5, 15 minutes), commit, whether tracked files differ from it, Python, the
    platform, the command."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": command(),
        "commit": commit.strip() if commit else None,
        "dirty": bool(status.strip()) if status is not None else None,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "load_average": load_average(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


class Run:
    """One run of a tool: the machine recorded when it starts, the load again when a result
    is written (a run that shared its cores says so), its results with that header."""

    def __init__(self) -> None:
        self.header = machine()
        self._t0 = time.monotonic()

    def record(self) -> dict[str, Any]:
        """The header as of now."""
        return {**self.header, "load_average_end": load_average(),
                "seconds": round(time.monotonic() - self._t0, 2)}

    def result(self, results: dict[str, Any] | list) -> dict[str, Any]:
        """`results` under the header (a list goes under "results")."""
        body = results if isinstance(results, dict) else {"results": results}
        return {"run": self.record(), **body}

    def write(self, path: str | Path, results: dict[str, Any] | list, indent: int = 1) -> Path:
        """A result file: the header, then `results`; its folder made if need be."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.result(results), indent=indent) + "\n")
        return path

    def print(self, results: dict[str, Any] | list, indent: int = 2) -> None:
        """The result as JSON on stdout (a tool's --json)."""
        print(json.dumps(self.result(results), indent=indent), flush=True)


@contextlib.contextmanager
def serving(store: str | Path, *extra: str, timeout: float = 120.0,
            log: str | Path | None = None, env: dict | None = None
            ) -> Iterator[ServeProcess]:
    """`redraft serve --datastore store *extra` once every worker listens (a free port
    unless `extra` names one); stopped at the end of the block whatever happens: an
    exception, Ctrl-C, or SIGTERM to the tool (turned into SystemExit while it serves)."""
    args: Sequence[str] = extra if "--port" in extra else ("--port", "0", *extra)
    previous = signal.getsignal(signal.SIGTERM)
    # Ours unless the tool set its own: SIG_IGN too (a launcher's ignored SIGTERM is inherited
    # through exec, and a tool ignoring it would leave its servers running when stopped).
    ours = _in_main_thread() and not callable(previous)
    if ours:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with ServeProcess(str(store), args, env=env, timeout=timeout, log=log) as serve:
            yield serve
    except ServeFailed as exc:  # one line, exit status 2, as the CLIs fail
        print(f"{tool_name()}: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _in_main_thread() -> bool:
    import threading  # lazy: only to know whether signal handlers may be set

    return threading.current_thread() is threading.main_thread()


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)
