"""Corruption fuzzer: every datastore command on damaged files gives exit 0 with the right
output or exit 2 with one line, never a signal, a traceback or a hang.

A small datastore of two segments (10 shards each, so each LMDB tree has a branch level) and
its manifest.json are damaged: a segment by single-byte flips — at random offsets and at
structural ones: meta-page fields, page headers, node pointers, node headers and keys,
overflow-page headers, the starts and ends of arrays, its own manifest — and by
truncations; manifest.json by flips and truncations; the directory by a missing segment,
two segments swapped, a segment renamed. `stats`, `query`, `index --append` and `index
--delete` run on each damaged copy, each in a process of its own: a fork of a server
process that has imported redraft and loaded the tokenizer once (a fresh interpreter per
command would cost seconds). A writer that succeeds must publish the same datastore it
publishes from the undamaged copy; one that fails must leave every file as it was, and no
file of its own.

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
from redraft.datastore import manifest as mf
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
    """A manifest without what differs from run to run (times, durations, the random names
    of new segment files and the crc32 of their own manifests, which hold the times)."""
    m = copy.deepcopy(manifest)
    m.pop("path", None)
    m.pop("crc32", None)
    names = {s["file"]: f"segment {i}" for i, s in enumerate(m["segments"])}
    for seg in m["segments"]:
        seg["file"] = names[seg["file"]]
        seg.pop("crc32")
        seg.pop("bytes")  # LMDB's page use follows the size of what it stored (times too)
    for sh in m["shards"]:
        sh.pop("sa_seconds", None)
        sh["segment"] = names[sh["segment"]]
    m["sizes"] = {k: v for k, v in m.get("sizes", {}).items()
                  if k not in ("file_bytes", "bytes_per_token")}
    for ev in m["build"]["history"]:
        ev.pop("at", None)
        ev.pop("seconds", None)
    return m


def _published(ds: Path) -> dict:
    with Reader(ds, verify=True) as r:
        return _normalized(r.manifest)


def _files(d: Path) -> dict[str, bytes]:
    return {f: (d / f).read_bytes() for f in sorted(os.listdir(d)) if f != fmt.WRITE_LOCK}


class Target:
    """The datastore, the commands, and what each prints on the undamaged files."""

    def __init__(self, root: Path, server: ForkServer) -> None:
        tok = load_tokenizer("smollm2-135m")
        text = "".join(p.read_text() for p in sorted(
            Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py")))
        ids = tok(text, add_special_tokens=False)["input_ids"][:6000]
        docs = [(f"chunk{i}", ids[i:i + 150]) for i in range(0, len(ids), 150)]
        self.clean_dir = root / "clean"
        build_datastore(None, self.clean_dir, tokenizer="smollm2-135m", documents=docs,
                        fingerprint=tokenizer_fingerprint(tok), vocab_size=len(tok),
                        shard_tokens=400, segment_tokens=3020)
        self.clean = _files(self.clean_dir)
        self.segments = [s["file"] for s in mf.read(self.clean_dir)[0]["segments"]]
        assert len(self.segments) == 2
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
        for seg in self.segments:
            with LmdbFile(str(self.clean_dir / seg)) as lm:
                assert lm.depth >= 2, "the fuzzed trees should have a branch level"

    def damage(self, files: dict[str, bytes]) -> None:
        """Make the directory hold exactly these files."""
        for f in os.listdir(self.ds):
            if f not in files and f != fmt.WRITE_LOCK:
                (self.ds / f).unlink()
        for f, data in files.items():
            (self.ds / f).write_bytes(data)

    def _output(self, name: str, out: str):
        if name == "stats":
            return _normalized(json.loads(out))
        if name in ("append", "delete"):  # the line (time left out) and what was published
            return re.sub(r", [0-9.]+ s$", "", out.strip()), _published(self.ds)
        return out

    def check(self, name: str, files: dict[str, bytes], what: str) -> int:
        """Run one command on the damaged files, hold it to the contract; its exit status."""
        self.damage(files)
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
                assert _files(self.ds) == files, f"{where}: files changed"
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


def _flip_or_truncate(clean: bytes, offsets: dict[str, list[int]] | None, i: int,
                      rng) -> tuple[str, bytes]:
    """One damaged copy of a file: structural flips (every kind), random flips,
    truncations."""
    data = bytearray(clean)
    r = i % 10
    if r < 6 and offsets:
        what = structural_flip(data, offsets, i, rng)
        return what, bytes(data)
    if r < 8:
        off = int(rng.integers(len(data)))
        data[off] ^= int(rng.integers(1, 256))
        return f"random flip at {off}", bytes(data)
    ps = 4096
    keep = int(rng.choice([rng.integers(len(data)), ps * rng.integers(max(1, len(data) // ps)),
                           len(data) - 1, 0, 100, 2 * ps]))
    return f"truncation to {keep}", bytes(data[:keep])


def cases(clean: dict[str, bytes], segments: list[str], offsets: dict[str, dict], n: int,
          rng) -> Iterator[tuple[str, dict[str, bytes]]]:
    """n damaged copies of the directory, one at a time: mostly a segment's bytes, then
    manifest.json's bytes, then files missing, swapped or renamed."""
    for i in range(n):
        files = dict(clean)
        r = i % 20
        if r < 13:
            seg = segments[i % len(segments)]
            what, files[seg] = _flip_or_truncate(clean[seg], offsets[seg], i // 2, rng)
            yield f"{seg}: {what}", files
        elif r < 18:
            what, files[mf.MANIFEST_FILE] = _flip_or_truncate(
                clean[mf.MANIFEST_FILE], None, 6 + i % 4, rng)
            yield f"{mf.MANIFEST_FILE}: {what}", files
        elif r == 18:
            seg = segments[int(rng.integers(len(segments)))]
            del files[seg]
            yield f"{seg} missing", files
        else:
            a, b = segments
            files[a], files[b] = clean[b], clean[a]
            yield "the two segments swapped", files


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
    offsets = {seg: structural_offsets(target.clean_dir / seg) for seg in target.segments}
    outcomes = {0: 0, 2: 0}
    for what, files in cases(target.clean, target.segments, offsets, CASES, rng):
        for name in target.commands:
            outcomes[target.check(name, files, what)] += 1
    print(f"{CASES} damaged files x {len(target.commands)} commands: "
          f"{outcomes[0]} exit 0 with the right output, {outcomes[2]} exit 2 with one line")
    # damage that matters is refused, and damage that does not (unused bytes) is harmless
    assert outcomes[0] > 0 and outcomes[2] > 0
