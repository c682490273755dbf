"""Corruption fuzzer for heads files: `redraft generate --drafters medusa --medusa-heads F` on
a damaged copy of the committed heads gives exit 0 with the output of the untouched heads, or
exit 2 with one line; never a signal, a traceback, a hang or unbounded memory.

Damage: single-byte flips at random offsets and at structural ones (the header's length, its
JSON, the metadata, the first and last bytes of every tensor), truncations, and metadata
edits (a value of another type or out of range, a key removed). Each command runs in a fork
of one process that loaded the model once (a fresh interpreter per command would cost
seconds), its address space capped at 1 GB beyond what the fork starts with.
REDRAFT_FUZZ_CASES (default 60) and REDRAFT_FUZZ_SEED scale and vary the campaign.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator

import numpy as np
import pytest

from ...conftest import ForkServer, private_cache, structural_flip
from ..conftest import have_default_model
from .test_heads_file import COMMITTED, committed, rewrite

CASES = int(os.environ.get("REDRAFT_FUZZ_CASES", "60"))
SEED = int(os.environ.get("REDRAFT_FUZZ_SEED", "0"))
TIMEOUT_S = 120.0  # per command: a hang, not a slow machine
MEMORY = 1 << 30


def argv(heads) -> list[str]:
    return ["generate", "--prompt", "Write a Python function that adds two numbers.",
            "--max-new-tokens", "12", "--drafters", "medusa", "--medusa-heads", str(heads),
            "--tree-nodes", "16", "--threads", "1", "--json"]


WARM_UP = """
import contextlib, io, torch
torch.set_num_threads(1)  # no thread pool: forks stay safe
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    main({argv!r})  # the model, the tokenizer, packed kernels: loaded once, inherited by forks
"""


def structural_offsets(data: bytes) -> dict[str, list[int]]:
    """Offsets of the file's structure, by kind."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta_at = data.index(b'"__metadata__"')
    out = {"header length": list(range(8)), "header json": list(range(8, 8 + n)),
           "metadata": list(range(meta_at, 8 + n)), "tensor ends": []}
    for name, e in header.items():
        if name != "__metadata__":
            start, end = e["data_offsets"]
            out["tensor ends"] += [8 + n + start, 8 + n + end - 1]
    return out


def _paths(value, prefix=()) -> Iterator[tuple]:
    """Every key path of a JSON value (dict keys and list indices)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


REPLACEMENTS = [None, "x", -1, 0, 1, 10**30, 1e308, float("nan"), 2.5, True, [], {}, [[0.5]],
                [0.0], "DELETE"]


def edit_metadata(meta: dict, rng) -> tuple[str, dict]:
    """A copy of the metadata with one value replaced or one key removed."""
    paths = [p for p in _paths(meta) if p[0] != "crc32" or rng.random() < 0.1]
    path = paths[int(rng.integers(len(paths)))]
    new = REPLACEMENTS[int(rng.integers(len(REPLACEMENTS)))]
    meta = copy.deepcopy(meta)
    parent = meta
    for k in path[:-1]:
        parent = parent[k]
    if new == "DELETE":
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    else:
        parent[path[-1]] = new
    return f"metadata {'.'.join(map(str, path))} = {new!r}", meta


def cases(clean: bytes, rng, n: int, tmp_path) -> Iterator[tuple[str, str]]:
    """n damaged copies (their descriptions and paths), one at a time."""
    offsets = structural_offsets(clean)
    meta, tensors = committed()
    path = tmp_path / "damaged.safetensors"
    for i in range(n):
        data = bytearray(clean)
        r = i % 10
        if r < 4:
            what = structural_flip(data, offsets, i, rng)
            path.write_bytes(bytes(data))
            yield what, str(path)
        elif r < 6:
            off = int(rng.integers(len(data)))
            data[off] ^= int(rng.integers(1, 256))
            path.write_bytes(bytes(data))
            yield f"random flip at {off}", str(path)
        elif r < 8:
            what, edited = edit_metadata(meta, rng)
            yield what, rewrite(path, edited, tensors)
        else:
            n_header = int.from_bytes(clean[:8], "little")
            keep = int(rng.choice([0, 7, 8, 8 + n_header // 2, 8 + n_header,
                                   int(rng.integers(len(data))), len(data) - 1]))
            path.write_bytes(bytes(data[:keep]))
            yield f"truncation to {keep}", str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared_converted):
    if not have_default_model():
        pytest.skip("default model package not installed (make install)")
    root = tmp_path_factory.mktemp("heads-fuzz")
    server = ForkServer(root, WARM_UP.format(argv=argv(COMMITTED)), TIMEOUT_S, MEMORY,
                        env={"REDRAFT_CACHE": str(private_cache(root / "cache", shared_converted))})
    try:
        yield server
    finally:
        server.close()


def test_damaged_heads_files_never_crash_generate(server, tmp_path):
    rc, out, err = server.run(*argv(COMMITTED))
    assert rc == 0 and err == "", err
    expected = json.loads(out)
    rng = np.random.default_rng(SEED)
    outcomes = {0: 0, 2: 0}
    for what, path in cases(COMMITTED.read_bytes(), rng, CASES, tmp_path):
        rc, out, err = server.run(*argv(path))
        assert rc is not None, f"{what}: hung"
        assert rc in (0, 2), f"{what}: exit {rc}\n{err}"
        if rc == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("redraft generate: error: ") \
                and out == "", f"{what}: {err!r} {out!r}"
        else:
            assert err == "", f"{what}: {err!r}"
            got = json.loads(out)
            assert (got["tokens"], got["text"]) == (expected["tokens"], expected["text"]), what
        outcomes[rc] += 1
    print(f"{CASES} damaged heads files: {outcomes[0]} exit 0 with the untouched output, "
          f"{outcomes[2]} exit 2 with one line")
    assert outcomes[0] > 0 and outcomes[2] > 0
