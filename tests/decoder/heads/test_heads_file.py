"""The heads file against tampering: every claim of the metadata checked against the header,
the model and the tensors before anything is allocated; a checksum per tensor (version 3);
each refusal one line and exit 2 from `redraft generate --drafters medusa`, under a memory
limit where a claim would once have allocated gigabytes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from redraft.decoder.heads.committed import default_heads_path
from redraft.decoder.heads.heads_file import (
    HeadsError,
    build_heads,
    read_heads,
    read_meta,
    write_heads_file,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

COMMITTED = default_heads_path(None)


def committed() -> tuple[dict, dict[str, torch.Tensor]]:
    """The committed heads' metadata and tensors, as stored (bfloat16)."""
    with safe_open(str(COMMITTED), framework="pt") as f:
        meta = json.loads(f.metadata()["redraft"])
    return meta, load_file(str(COMMITTED))


def rewrite(path, meta: dict, tensors: dict[str, torch.Tensor]) -> str:
    """A heads file with this metadata and these tensors, written as is (checksums
    included: whatever `meta` says)."""
    save_file(tensors, str(path), metadata={"redraft": json.dumps(meta)})
    return str(path)


def edited(tmp_path, edit) -> str:
    """The committed heads with `edit(meta)` applied to a copy of the metadata."""
    meta, tensors = committed()
    meta = copy.deepcopy(meta)
    edit(meta)
    return rewrite(tmp_path / "tampered.safetensors", meta, tensors)


def generate(capsys, heads: str) -> tuple[int, str, str]:
    from redraft.decoder.cli import main

    rc = main(["generate", "--prompt", "hi", "--max-new-tokens", "4", "--drafters", "medusa",
               "--medusa-heads", heads])
    out, err = capsys.readouterr()
    return rc, out, err


def _set(key, value):
    def edit(meta):
        meta[key] = value
    return edit


def _drop_topk(meta):
    del meta["accuracy"]["subset"]["topk"]


def _more_heads(meta):  # in range, accuracy rows to match: only the header can tell
    meta["num_heads"] = 6
    for projection in ("full", "subset"):
        meta["accuracy"][projection]["topk"] += meta["accuracy"][projection]["topk"][:2]


METADATA_EDITS = {
    "accuracy a list": (lambda m: m.update(accuracy=[0.5, 0.6]), "accuracy must be an object"),
    "topk missing": (_drop_topk, "accuracy.subset must be an object with a 'topk' list"),
    "topk a string": (lambda m: m["accuracy"]["full"].update(topk="0.5"),
                      "accuracy.full.topk must be a list of 4 rows (one per head), got '0.5'"),
    "topk above 1": (lambda m: m["accuracy"]["full"]["topk"][1].__setitem__(0, 7.5),
                     "accuracy.full.topk rows must be lists of accuracies in [0, 1]"),
    "hidden_size 'x'": (_set("hidden_size", "x"),
                        "hidden_size must be an integer in 1..65536, got 'x'"),
    "hidden_size 577": (_set("hidden_size", 577),
                        "tensor block.0.weight is BF16 [576, 576]; the metadata (hidden_size "
                        "577) needs [577, 577]"),
    "num_heads 0": (_set("num_heads", 0), "num_heads must be an integer in 1..64, got 0"),
    "num_heads -1": (_set("num_heads", -1), "num_heads must be an integer in 1..64, got -1"),
    "num_heads 2.5": (_set("num_heads", 2.5), "num_heads must be an integer in 1..64"),
    "num_heads 6": (_more_heads, "the metadata (num_heads 6, next_token true) needs tensor "
                                 "block.4.bias, which the file lacks"),
    "next_token 'yes'": (_set("next_token", "yes"), "next_token must be true or false"),
    "projection 'half'": (_set("projection", "half"), "projection must be full or subset"),
    "vocab_subset_size 9": (_set("vocab_subset_size", 9),
                            "tensor vocab_subset is I32 [8192]; the metadata"),
    "crc32 missing": (lambda m: m.pop("crc32"), "crc32 must map every tensor"),
    "head 1 never right": (lambda m: m["accuracy"]["subset"]["topk"].__setitem__(0, [0.0] * 10),
                           "records no accuracy above 0 for the first head (subset "
                           "projection): no tree to draft"),
    "version '3'": (_set("version", "3"), "heads format version '3', this redraft reads"),
}


@pytest.mark.parametrize("case", METADATA_EDITS)
def test_tampered_metadata_is_one_line(capsys, tmp_path, case):
    """Each refused before the model loads, but for a tree no accuracy can shape (which
    needs the model's projection)."""
    edit, message = METADATA_EDITS[case]
    rc, out, err = generate(capsys, edited(tmp_path, edit))
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("redraft generate: error: ") and message in err, err


@pytest.mark.parametrize("bad_id", [-5, 49152, 2**31 - 1])
def test_subset_ids_outside_the_vocabulary_are_refused(capsys, tmp_path, bad_id):
    meta, tensors = committed()
    tensors["vocab_subset"] = tensors["vocab_subset"].clone()
    tensors["vocab_subset"][100] = bad_id
    path = tmp_path / "ids.safetensors"
    write_heads_file(tensors, path, meta)  # checksums of the edited tensors: they hold
    rc, out, err = generate(capsys, str(path))
    assert rc == 2 and out == "" and err == (
        f"redraft generate: error: {path}: vocab_subset holds token id {bad_id}, outside the "
        "vocabulary [0, 49152)\n")


def test_a_flipped_tensor_byte_fails_its_checksum(capsys, tmp_path):
    data = bytearray(COMMITTED.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 + n + 2_000_000] ^= 0x10  # inside a block's weights
    path = tmp_path / "flipped.safetensors"
    path.write_bytes(bytes(data))
    rc, out, err = generate(capsys, str(path))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "checksum mismatch in tensor block.1.embed (a damaged heads file)" in err


def test_the_committed_heads_are_checksummed_and_older_versions_still_load(tmp_path):
    meta, tensors = committed()
    assert meta["version"] == 3 and set(meta["crc32"]) == set(tensors)
    current = build_heads(read_heads(COMMITTED))
    old = copy.deepcopy(meta)
    old["version"] = 2
    del old["crc32"]
    loaded = build_heads(read_heads(rewrite(tmp_path / "v2.safetensors", old, tensors)))
    assert read_meta(tmp_path / "v2.safetensors")["version"] == 2
    for a, b in zip(current.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


_UNDER_A_LIMIT = r"""
import resource, sys
from redraft.decoder.cli import main
import redraft.decoder.heads.heads_file, torch

with open("/proc/self/status") as status:
    vm = next(int(x.split()[1]) for x in status if x.startswith("VmSize:")) * 1024
limit = vm + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("key, value, message", [
    ("num_heads", 300, "num_heads must be an integer in 1..64, got 300"),
    ("num_heads", 10**8, "num_heads must be an integer in 1..64, got 100000000"),
    ("hidden_size", 60_000, "tensor block.0.weight is BF16 [576, 576]; the metadata "
                            "(hidden_size 60000) needs [60000, 60000]"),
])
def test_sizes_that_would_take_gigabytes_are_refused_under_a_memory_limit(tmp_path, key, value,
                                                                          message):
    """In a real process whose address space may grow by 512 MB at most after imports:
    heads claiming 300 or 10^8 blocks, or 60,000-wide ones, are refused from the header
    alone (allocating them first took gigabytes)."""
    path = edited(tmp_path, _set(key, value))
    argv = ["generate", "--prompt", "hi", "--max-new-tokens", "4", "--drafters", "medusa",
            "--medusa-heads", path]
    proc = subprocess.run([sys.executable, "-c", _UNDER_A_LIMIT, str(512 << 20), *argv],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == f"redraft generate: error: {path}: {message}\n"


def test_a_file_that_lies_about_its_header_length_is_one_line(tmp_path):
    data = bytearray(COMMITTED.read_bytes())
    for n in (0, 1 << 60, len(data)):
        data[:8] = n.to_bytes(8, "little")
        path = tmp_path / "lying.safetensors"
        path.write_bytes(bytes(data))
        with pytest.raises(HeadsError, match="not a safetensors heads file \\(header length"):
            read_meta(path)
