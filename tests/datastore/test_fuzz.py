"""Corruption fuzzer: every datastore command on damaged files gives exit 0 with the right
output or exit 2 with one line, never a signal, a traceback or a hang.

A small datastore (20 shards, so LMDB's tree has a branch level) is damaged by single-byte
flips — at random offsets and at structural ones: meta-page fields, page headers, node
pointers, node headers and keys, overflow-page headers, the starts and ends of arrays, the
manifest — and by truncations. `stats`, `query`, `index --append` and `index --delete` run
on each damaged copy, each in a process of its own: a fork of a server process that has
imported redraft and loaded the tokenizer once (a fresh interpreter per command would cost
seconds). A writer that succeeds must publish the same datastore it publishes from the
undamaged copy; one that fails must leave the damaged file as it was.

REDRAFT_FUZZ_CASES (default 200) and REDRAFT_FUZZ_SEED scale and vary the campaign.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from redraft.datastore import Reader, build_datastore
from redraft.datastore import format as fmt
from redraft.datastore.lmdbfile import NODE_HEADER, P_BRANCH, P_LEAF, PAGE_HEADER, LmdbFile
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint

from ..conftest import ForkServer, structural_flip

CASES = int(os.environ.get("REDRAFT_FUZZ_CASES", "200"))
SEED = int(os.environ.get("REDRAFT_FUZZ_SEED", "0"))
TIMEOUT_S = 120.0  # per command: a hang, not a slow machine

WARM_UP = """
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint
import redraft.datastore.build, redraft.datastore.cli, redraft.datastore.reader
tokenizer_fingerprint(load_tokenizer("smollm2-135m"))  # both remembered across forks
"""


def _normalized(manifest: dict) -> dict:
    """A manifest without what differs from run to run (times, durations)."""
    m = copy.deepcopy(manifest)
    m.pop("path", None)
    for sh in m["shards"]:
        sh.pop("sa_seconds", None)
    for ev in m["build"]["history"]:
        ev.pop("at", None)
        ev.pop("seconds", None)
    return m


def _published(ds: Path) -> dict:
    with Reader(ds, verify=True) as r:
        return _normalized(r.manifest)


class Target:
    """The datastore, the commands, and what each prints on the undamaged file."""

    def __init__(self, root: Path, server: ForkServer) -> None:
        tok = load_tokenizer("smollm2-135m")
        text = "".join(p.read_text() for p in sorted(
            Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py")))
        ids = tok(text, add_special_tokens=False)["input_ids"][:6000]
        docs = [(f"chunk{i}", ids[i:i + 150]) for i in range(0, len(ids), 150)]
        self.clean_dir = root / "clean"
        build_datastore(None, self.clean_dir, tokenizer="smollm2-135m", documents=docs,
                        fingerprint=tokenizer_fingerprint(tok), vocab_size=len(tok),
                        shard_tokens=400)
        self.clean = (self.clean_dir / fmt.DATA_FILE).read_bytes()
        self.ds = root / "ds"
        self.ds.mkdir()
        more = root / "more.py"
        more.write_text("import json\nprint(json.dumps({'a': 1}))\n")
        context = ",".join(map(str, ids[1000:1010]))
        self.commands = {
            "stats": ["stats", self.ds],
            "query": ["query", "--datastore", self.ds, "--tokens", context, "--json"],
            "append": ["index", "--quiet", "--append", "--out", self.ds, more],
            "delete": ["index", "--out", self.ds, "--delete", "3,17"],
        }
        self.server = server
        self.expected = {}
        for name, argv in self.commands.items():
            self.damage(self.clean)
            rc, out, err = server.run(*argv)
            assert rc == 0 and err == "", (name, rc, err)
            self.expected[name] = self._output(name, out)
        with LmdbFile(str(self.clean_dir / fmt.DATA_FILE)) as lm:
            assert lm.depth >= 2, "the fuzzed tree should have a branch level"

    def damage(self, data: bytes) -> None:
        (self.ds / fmt.DATA_FILE).write_bytes(data)
        for f in self.ds.iterdir():
            if f.name.startswith(fmt.TMP_PREFIX):
                f.unlink()

    def _output(self, name: str, out: str):
        if name == "stats":
            return _normalized(json.loads(out))
        if name in ("append", "delete"):  # the line (time left out) and what was published
            return re.sub(r", [0-9.]+ s$", "", out.strip()), _published(self.ds)
        return out

    def check(self, name: str, data: bytes, what: str) -> int:
        """Run one command on the damaged bytes, hold it to the contract; its exit status."""
        self.damage(data)
        argv = self.commands[name]
        rc, out, err = self.server.run(*argv)
        where = f"{name} on {what}"
        assert rc is not None, f"{where}: hung"
        assert rc in (0, 2), f"{where}: exit {rc}\n{err}"
        if rc == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"redraft {argv[0]}: error: ") \
                and out == "", f"{where}: {err!r} {out!r}"
            if name in ("append", "delete"):
                assert (self.ds / fmt.DATA_FILE).read_bytes() == data, f"{where}: file changed"
                assert not [f for f in os.listdir(self.ds) if f.startswith(fmt.TMP_PREFIX)]
        else:
            assert err == "", f"{where}: {err!r}"
            assert self._output(name, out) == self.expected[name], f"{where}: wrong output"
        return rc


def structural_offsets(file: Path) -> dict[str, list[int]]:
    """Offsets of the file's structure, by kind, read with the parser under test."""
    out: dict[str, list[int]] = {"meta": [], "page header": [], "node pointer": [],
                                 "node header": [], "key": [], "overflow header": [],
                                 "array start/end": [], "manifest": []}
    with LmdbFile(str(file)) as lm:
        ps = lm.psize
        for base in (0, ps):
            out["meta"] += [base + o for o in range(0, PAGE_HEADER + 136)]
        todo = [(lm.root, 1)]
        while todo:
            pgno, level = todo.pop()
            kind = P_LEAF if level == lm.depth else P_BRANCH
            off, n, upper = lm._page(pgno, kind)
            out["page header"] += range(off, off + PAGE_HEADER)
            out["node pointer"] += range(off + PAGE_HEADER, off + PAGE_HEADER + 2 * n)
            for i in range(n):
                node, _, _, ksize = lm._node(off, upper, i)
                out["node header"] += range(node, node + NODE_HEADER)
                out["key"] += range(node + NODE_HEADER, node + NODE_HEADER + ksize)
                if kind == P_BRANCH:
                    todo.append((lm._child(off, upper, i), level + 1))
                    continue
                data, size, pages = lm._value(off, upper, i)
                if pages:
                    out["overflow header"] += range(data - PAGE_HEADER, data)
                out["array start/end"] += [data, data + 1, data + size - 1]
        moff, msize = lm.locate(fmt.KEY_MANIFEST)
        coff, csize = lm.locate(fmt.KEY_MANIFEST_CRC)
        out["manifest"] += [moff, moff + msize // 2, moff + msize - 1, *range(coff, coff + csize)]
    return out


def cases(clean: bytes, offsets: dict[str, list[int]], n: int, rng) -> Iterator[tuple[str, bytes]]:
    """n damaged copies, one at a time: structural flips (every kind), random flips and
    truncations."""
    for i in range(n):
        data = bytearray(clean)
        r = i % 10
        if r < 6:
            what = structural_flip(data, offsets, i, rng)
            yield what, bytes(data)
        elif r < 8:
            off = int(rng.integers(len(data)))
            data[off] ^= int(rng.integers(1, 256))
            yield f"random flip at {off}", bytes(data)
        else:
            ps = 4096
            keep = int(rng.choice([rng.integers(len(data)), ps * rng.integers(len(data) // ps),
                                   len(data) - 1, 0, 100, 2 * ps]))
            yield f"truncation to {keep}", bytes(data[:keep])


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    server = ForkServer(root, WARM_UP, TIMEOUT_S)
    try:
        yield Target(root, server)
    finally:
        server.close()


def test_damaged_files_never_crash_a_command(target):
    rng = np.random.default_rng(SEED)
    offsets = structural_offsets(target.clean_dir / fmt.DATA_FILE)
    outcomes = {0: 0, 2: 0}
    for what, data in cases(target.clean, offsets, CASES, rng):
        for name in target.commands:
            outcomes[target.check(name, data, what)] += 1
    print(f"{CASES} damaged files x {len(target.commands)} commands: "
          f"{outcomes[0]} exit 0 with the right output, {outcomes[2]} exit 2 with one line")
    # damage that matters is refused, and damage that does not (unused bytes) is harmless
    assert outcomes[0] > 0 and outcomes[2] > 0
