"""`redraft index / query / stats`: outputs, and one clear line (exit 2) for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from redraft.datastore import build_datastore
from redraft.datastore import format as fmt
from redraft.decoder.cli import main


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def fails(capsys, *argv, match: str):
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"redraft {argv[0]}: error: ")
    assert match in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
                              "    return a - b\n")
    (src / "b.md").write_text("# Notes\n\nThe add function returns a + b.\n")
    (src / "c.jsonl").write_text(json.dumps({"question": "What is 2 + 3?", "answer": "5"}) + "\n")
    return src


@pytest.fixture
def store(tmp_path, corpus, capsys):
    out = tmp_path / "ds"
    rc, stdout, _ = run(capsys, "index", "--tokenizer", "smollm2-135m", "--out", out,
                        "--corpus", "code", "--quiet", corpus)
    assert rc == 0 and "+3 documents" in stdout
    return out


def test_index_query_stats(store, capsys, tmp_path):
    rc, out, _ = run(capsys, "stats", store)
    stats = json.loads(out)
    assert rc == 0 and stats["n_docs"] == 3 and stats["n_tokens"] > 20
    assert stats["corpora"]["code"]["n_docs"] == 3 and stats["verified"] is True
    assert stats["sizes"]["file_bytes"] == (store / fmt.DATA_FILE).stat().st_size

    rc, out, _ = run(capsys, "query", "--datastore", store, "--text", "def sub(a, b):", "--json")
    q = json.loads(out)
    assert rc == 0 and q["match_len"] == 7  # def, sub, (, a, ",", b, ):
    assert q["tree"] == {"tokens": q["tokens"], "parents": q["parents"], "probs": q["probs"]}
    assert "".join(q["pieces"][:4]) == "\n    return a -"
    assert q["parents"][0] == -1 and all(0 < p <= 1 for p in q["probs"])

    rc, out, _ = run(capsys, "query", "--datastore", store, "--text", "    return a",
                     "--budget", "4")
    assert rc == 0 and out.startswith("match_len: ") and len(out.strip().splitlines()) == 5

    ids = ",".join(map(str, q["tokens"][:1]))
    rc, out, _ = run(capsys, "query", "--datastore", store, "--tokens", ids, "--json",
                     "--min-match-len", "1")
    assert rc == 0 and json.loads(out)["match_len"] == 1


def test_append_filter_and_delete(store, capsys, tmp_path):
    more = tmp_path / "more.txt"
    more.write_text("def sub(a, b):\n    raise NotImplementedError\n")
    rc, out, _ = run(capsys, "index", "--append", "--out", store, "--corpus", "extra", "--quiet",
                     more)
    assert rc == 0 and "appended" in out and "total 4 documents" in out
    ask = ["query", "--datastore", store, "--text", "def sub(a, b):", "--json"]
    both = json.loads(run(capsys, *ask)[1])
    code = json.loads(run(capsys, *ask, "--corpus", "code")[1])
    extra = json.loads(run(capsys, *ask, "--corpus", "extra")[1])
    assert " return" in code["pieces"] and " raise" not in code["pieces"]
    assert " raise" in extra["pieces"] and " return" not in extra["pieces"]
    assert {" raise", " return"} <= set(both["pieces"])
    rc, out, _ = run(capsys, "index", "--out", store, "--delete", "3")
    assert rc == 0 and "3 documents" in out
    after = json.loads(run(capsys, *ask)[1])
    assert after["tokens"] == code["tokens"]
    fails(capsys, *ask, "--corpus", "nope", match="unknown corpora")


def test_bad_inputs_are_one_line_errors(store, capsys, tmp_path, corpus):
    before = (store / fmt.DATA_FILE).read_bytes()
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    fails(capsys, "index", "--out", store, "--quiet", bad, match="latin1.txt: not UTF-8")
    fails(capsys, "index", "--out", store, "--quiet", empty, match="empty corpus")
    fails(capsys, "index", "--out", store, "--quiet", tmp_path / "gone.txt",
          match="gone.txt: no such file")
    fails(capsys, "index", "--out", store, "--quiet", "--tokenizer", "no-such-model", corpus,
          match="unknown model")
    fails(capsys, "index", "--out", store, "--delete", "99", match="out of range")
    fails(capsys, "index", "--out", store, "--delete", "x", match="comma-separated integers")
    assert (store / fmt.DATA_FILE).read_bytes() == before  # nothing above touched it

    fails(capsys, "query", "--datastore", tmp_path / "nope", "--tokens", "1",
          match="no such datastore")
    fails(capsys, "stats", tmp_path, match="missing datastore.lmdb")
    fails(capsys, "query", "--datastore", store, "--tokens", "1,49152",
          match="token id 49152 is out of range")
    fails(capsys, "query", "--datastore", store, "--tokens", "1,a",
          match="comma-separated integers")


def test_corrupt_and_mismatched_stores(tmp_path, capsys, store):
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    data = (store / fmt.DATA_FILE).read_bytes()
    (trunc / fmt.DATA_FILE).write_bytes(data[: len(data) // 2])
    fails(capsys, "stats", trunc, match="truncated")
    fails(capsys, "query", "--datastore", trunc, "--tokens", "1", match="truncated")

    other = tmp_path / "other"
    build_datastore(None, other, tokenizer="smollm2-135m", documents=[[1, 2, 3]],
                    fingerprint="sha256:another", vocab_size=49152)
    fails(capsys, "query", "--datastore", other, "--text", "hello",
          match="does not match the datastore's")
    src = tmp_path / "x.txt"
    src.write_text("hello\n")
    fails(capsys, "index", "--append", "--quiet", "--out", other, src,
          match="does not match the datastore's")


def test_checksum_mismatch_is_reported(store, capsys):
    import lmdb
    import numpy as np

    env = lmdb.open(str(store / fmt.DATA_FILE), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        tokens = bytearray(txn.get(fmt.shard_key(0, "tokens")))
        tokens[0:2] = np.array([7], ">u2").tobytes()
        txn.put(fmt.shard_key(0, "tokens"), bytes(tokens))
    env.close()
    fails(capsys, "stats", store, match="checksum mismatch in shard 0 tokens")
    fails(capsys, "query", "--datastore", store, "--tokens", "1", match="checksum mismatch")


def test_real_process_prints_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "redraft.decoder.cli", "query", "--datastore",
                        str(tmp_path / "missing"), "--tokens", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        f"redraft query: error: {tmp_path / 'missing'}: no such datastore"]


def test_wrong_magic_or_version_is_one_line(tmp_path, capsys):
    import lmdb

    for what in ("magic", "version"):
        out = tmp_path / what
        build_datastore(None, out, documents=[[1, 2, 3]], fingerprint="f", vocab_size=8)
        env = lmdb.open(str(out / fmt.DATA_FILE), subdir=False, lock=False)
        with env.begin(write=True) as txn:
            if what == "magic":
                txn.put(fmt.KEY_MAGIC, b"not-a-datastore")
            else:
                m = json.loads(bytes(txn.get(fmt.KEY_MANIFEST)))
                m["version"] = 99
                fmt.write_header(txn, m)
        env.close()
        match = "wrong magic" if what == "magic" else "format version 99"
        fails(capsys, "stats", out, match=match)
        fails(capsys, "query", "--datastore", out, "--tokens", "1", match=match)
