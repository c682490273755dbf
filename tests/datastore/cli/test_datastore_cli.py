"""`redraft index / query / stats`: outputs, and one clear line (exit 2) for every bad input."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
from redraft.datastore import Reader, build_datastore
from redraft.datastore import format as fmt
from redraft.datastore import manifest as mf
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
    assert stats["layout"] == "segments" and stats["n_segments"] == len(stats["segments"]) == 1
    assert stats["segments"][0]["kind"] == "corpus" and stats["segments"][0]["first_doc"] == 0
    assert stats["sizes"]["file_bytes"] == sum(
        (store / f).stat().st_size for f in (mf.MANIFEST_FILE, stats["segments"][0]["file"]))

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


def test_bad_inputs_are_one_line_errors(store, capsys, tmp_path, corpus, files):
    before = files.directory_bytes(store)
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
    fails(capsys, "index", "--out", store, "--delete", "0", "--wait", "nan",
          match="--wait: expected a finite number")
    fails(capsys, "index", "--upgrade", store, "--delete", "0", match="--upgrade DIR takes no")
    fails(capsys, "index", corpus, match="--out DIR is required")
    assert files.directory_bytes(store) == before  # nothing above touched it

    fails(capsys, "query", "--datastore", tmp_path / "nope", "--tokens", "1",
          match="no such datastore")
    fails(capsys, "stats", tmp_path, match="no datastore here")
    fails(capsys, "query", "--datastore", store, "--tokens", "1,49152",
          match="token id 49152 is out of range")
    fails(capsys, "query", "--datastore", store, "--tokens", "1,a",
          match="comma-separated integers")


def test_corrupt_and_mismatched_stores(tmp_path, capsys, store, files):
    trunc = tmp_path / "trunc"  # a single-file (legacy) datastore, truncated
    trunc.mkdir()
    data = files.only_segment(store).read_bytes()
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


def test_checksum_mismatch_is_reported(store, capsys, files):
    import lmdb
    import numpy as np

    env = lmdb.open(str(files.only_segment(store)), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        tokens = bytearray(txn.get(fmt.shard_key(0, "tokens")))
        tokens[0:2] = np.array([7], ">u2").tobytes()
        txn.put(fmt.shard_key(0, "tokens"), bytes(tokens))
    env.close()
    files.resync(store)
    fails(capsys, "stats", store, match="checksum mismatch in shard 0 tokens")
    fails(capsys, "query", "--datastore", store, "--tokens", "1", match="checksum mismatch")


def test_real_process_prints_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "redraft.decoder.cli", "query", "--datastore",
                        str(tmp_path / "missing"), "--tokens", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        f"redraft query: error: {tmp_path / 'missing'}: no such datastore"]


def test_wrong_magic_or_version_is_one_line(tmp_path, capsys, files):
    import lmdb

    for what in ("magic", "version"):
        out = tmp_path / what
        build_datastore(None, out, documents=[[1, 2, 3]], fingerprint="f", vocab_size=8)
        env = lmdb.open(str(files.only_segment(out)), subdir=False, lock=False)
        with env.begin(write=True) as txn:
            if what == "magic":
                txn.put(fmt.KEY_MAGIC, b"not-a-datastore")
            else:
                m = json.loads(bytes(txn.get(fmt.KEY_MANIFEST)))
                m["version"] = 99
                fmt.write_header(txn, m)
        env.close()
        files.resync(out)
        match = "wrong magic" if what == "magic" else "format version 99"
        fails(capsys, "stats", out, match=match)
        fails(capsys, "query", "--datastore", out, "--tokens", "1", match=match)


# ---- one line instead of a traceback: real processes, real file systems ---------------
def redraft(*argv, **kw) -> subprocess.CompletedProcess:
    """Run the `redraft` command in a new process (argv items may be bytes paths)."""
    return subprocess.run([sys.executable, "-m", "redraft.decoder.cli", *argv],
                          capture_output=True, timeout=300, **kw)


def one_line_error(p: subprocess.CompletedProcess, command: str, match: str) -> str:
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 2, (p.returncode, p.stdout, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"redraft {command}: error: "), err
    assert match in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def tmpfs(path, size_kb: int):
    """A small real file system at `path`, or None where this process may not mount one."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _leftovers(d) -> list[str]:
    return [f for f in os.listdir(d) if f.startswith(fmt.TMP_PREFIX)]


def test_out_under_a_regular_file(tmp_path, corpus):
    (tmp_path / "plain").write_text("x")
    one_line_error(redraft("index", "--quiet", "--out", tmp_path / "plain" / "ds", corpus),
                   "index", "cannot create the directory (Not a directory)")


def test_read_only_file_system(tmp_path, store, corpus, files):
    more = tmp_path / "more.txt"
    more.write_text("def mul(a, b):\n    return a * b\n")
    with tmpfs(tmp_path / "ro", 4096) as ro:
        if ro is not None:  # the real thing: a file system mounted read-only
            shutil.copytree(store, ro / "ds")
            subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
            reason = "Read-only file system"
        elif os.geteuid() != 0:  # no mount: a directory this user may not write
            ro = tmp_path / "ro"
            shutil.copytree(store, ro / "ds")
            (ro / "ds").chmod(0o555)
            ro.chmod(0o555)
            reason = "Permission denied"
        else:
            pytest.skip("root without permission to mount: cannot make anything read-only")
        before = files.directory_bytes(ro / "ds")
        for argv in (["--out", ro / "ds", corpus], ["--append", "--out", ro / "ds", more],
                     ["--out", ro / "ds", "--delete", "0"], ["--out", ro / "new", corpus]):
            one_line_error(redraft("index", "--quiet", *argv), "index", reason)
        assert files.directory_bytes(ro / "ds") == before
        assert not (ro / "new").exists()


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_full_disk_leaves_nothing_behind(tmp_path, store, corpus, files):
    """A disk that fills up mid-write: one line, the old datastore intact, no temporary file
    left, and a new --out removed again."""
    more = tmp_path / "more.txt"
    more.write_text("def mul(a, b):\n    return a * b\n")
    size = files.only_segment(store).stat().st_size
    room = size // 2  # too little for any new file
    with tmpfs(tmp_path / "small", 4 * size // 1024 + 64) as small:
        where = small or tmp_path / "small"
        shutil.copytree(store, where / "ds")
        if small is not None:  # the real thing: fill the file system up to `room`
            with open(where / "filler", "wb") as f:
                f.write(bytes(shutil.disk_usage(where).free - room))
            run = redraft
        else:  # no mount: the OS refuses writes past a file size limit (EFBIG)

            def run(*argv):
                return redraft(*argv, preexec_fn=_limit_file_size(room))
        before = files.directory_bytes(where / "ds")
        for argv in (["--append", "--out", where / "ds", more],
                     ["--out", where / "ds", "--delete", "1"]):
            one_line_error(run("index", "--quiet", *argv), "index", "cannot write the datastore")
            assert files.directory_bytes(where / "ds") == before
            assert _leftovers(where / "ds") == []
        with Reader(where / "ds", verify=True) as r:
            assert r.n_docs == 3
        one_line_error(run("index", "--quiet", "--out", where / "fresh", corpus),
                       "index", "cannot write the datastore")
        assert not (where / "fresh").exists()


def test_file_names_that_are_not_utf8(tmp_path, corpus):
    src = tmp_path / "in"
    src.mkdir()
    odd = os.fsencode(src) + b"/caf\xe9.py"
    with open(odd, "wb") as f:
        f.write(b"def odd():\n    return 1\n")
    p = redraft("index", "--quiet", "--out", tmp_path / "ds", src)
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    with Reader(tmp_path / "ds") as r:
        assert os.fsencode(r.doc_name(0)) == odd  # the name round-trips as the same bytes
    one_line_error(redraft("index", "--quiet", "--out", tmp_path / "ds2", "--corpus",
                           b"caf\xe9", corpus), "index", "not valid UTF-8")
    out = os.fsencode(tmp_path) + b"/d\xe9s"
    p = redraft("index", "--quiet", "--out", out, corpus)
    assert p.returncode == 0 and p.stderr == b"" and b"built" in p.stdout, p.stderr
    assert os.path.isfile(out + b"/" + mf.MANIFEST_FILE.encode())


def test_jsonl_nested_too_deeply(tmp_path, capsys):
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps({"text": "ok"}) + "\n" + "[" * 100_000 + "\n")
    fails(capsys, "index", "--quiet", "--out", tmp_path / "ds", deep,
          match="deep.jsonl:2: JSON nested too deeply")


def test_jsonl_records_may_hold_line_separators(tmp_path, capsys):
    f = tmp_path / "u.jsonl"
    text = "first\u2028second\u2029third\x85fourth\x0cfifth"
    f.write_text(json.dumps({"text": text}, ensure_ascii=False) + "\n"
                 + json.dumps({"text": "next"}) + "\r\n", encoding="utf-8")
    rc, out, _ = run(capsys, "index", "--quiet", "--out", tmp_path / "ds", f)
    assert rc == 0 and "+2 documents" in out
    with Reader(tmp_path / "ds") as r:
        assert [r.doc_name(i) for i in range(2)] == [f"{f}:1", f"{f}:2"]


def test_skip_bad_skips_one_record_and_says_how_many(tmp_path, capsys):
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join([json.dumps({"text": "one"}), "{broken", json.dumps({"text": "two"}),
                            json.dumps({"other": 1}), json.dumps({"text": "three"})]) + "\n")
    fails(capsys, "index", "--quiet", "--out", tmp_path / "ds", f, match="r.jsonl:2: invalid")
    rc, out, err = run(capsys, "index", "--quiet", "--skip-bad", "--out", tmp_path / "ds", f)
    assert rc == 0 and "+3 documents" in out and "skipped 2 bad file(s) or record(s)" in out
    assert [line.split(": ")[1] for line in err.strip().splitlines()] == [f"{f}:2", f"{f}:4"]
    with Reader(tmp_path / "ds") as r:
        assert [r.doc_name(i) for i in range(3)] == [f"{f}:1", f"{f}:3", f"{f}:5"]


def test_delete_counts_each_document_once(store, capsys, files):
    rc, out, _ = run(capsys, "index", "--out", store, "--delete", "1,1,2")
    assert rc == 0 and out.startswith(f"deleted 2 document(s) from {store}: 1 documents")
    assert out.strip().endswith("running servers stop drafting them within 2 s")
    after = files.directory_bytes(store)
    rc, out, _ = run(capsys, "index", "--out", store, "--delete", "2, 2")
    assert rc == 0 and out.startswith("deleted 0 document(s) (1 already deleted)")
    for empty in ("", ",", " , "):
        fails(capsys, "index", "--out", store, "--delete", empty, match="no document ids")
    assert files.directory_bytes(store) == after  # nothing above rewrote a file
    with Reader(store) as r:
        assert r.n_docs == 1 and sorted(r.deleted) == [1, 2]


def test_query_checks_the_whole_context(store, capsys):
    ok = ",".join(["1"] * 20)
    for bad, value in ((f"99999,{ok}", 99999), (f"-1,{ok}", -1), (f"{ok},{10**23}", 10**23)):
        fails(capsys, "query", "--datastore", store, f"--tokens={bad}", "--max-match-len", "4",
              match=f"--tokens: token id {value} is out of range")
    fails(capsys, "query", "--datastore", store, "--tokens", "", match="--tokens: empty context")
    fails(capsys, "query", "--datastore", store, "--text", "", match="--text: empty context")
    rc, out, _ = run(capsys, "query", "--datastore", store, "--tokens", ok, "--json")
    assert rc == 0 and json.loads(out)["context_len"] == 20


_TORCH_FREE = """
import contextlib, io, sys
from redraft.decoder.cli import main

def run(*argv):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            rc = main(list(argv))
        except SystemExit as exc:  # --help
            rc = exc.code
    assert rc == 0, (argv, rc)
    assert "torch" not in sys.modules, f"{argv[0]} imported torch"
    if argv[0] != "serve":
        assert "grpc" not in sys.modules, f"{argv[0]} imported grpc"
    return out.getvalue()

ds, src, more = sys.argv[1:]
run("index", "--quiet", "--out", ds, src)
run("index", "--quiet", "--append", "--out", ds, more)
run("index", "--out", ds, "--delete", "0")
run("stats", ds)
run("query", "--datastore", ds, "--tokens", "1,2,3")
run("query", "--datastore", ds, "--text", "def add(a, b):", "--json")
run("serve", "--help")
"""


def test_datastore_commands_import_neither_torch_nor_grpc(tmp_path, corpus):
    from redraft.proto.models import load_tokenizer

    load_tokenizer("smollm2-135m")  # the converted tokenizer is cached (first use imports torch)
    more = tmp_path / "more.txt"
    more.write_text("def mul(a, b):\n    return a * b\n")
    p = subprocess.run([sys.executable, "-c", _TORCH_FREE, str(tmp_path / "ds"), str(corpus),
                        str(more)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    # the decoder's commands are still there when asked for
    p = subprocess.run([sys.executable, "-m", "redraft.decoder.cli", "--help"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "generate" in p.stdout and "bench" in p.stdout


def test_index_of_a_directory_skips_fifos_and_devices(tmp_path):
    """A FIFO in a walked directory would block the read forever, and a symlink to
    /dev/zero would never end: a walk reads regular files only, saying what it skipped."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("def f():\n    return 1\n")
    os.mkfifo(src / "pipe.txt")
    (src / "zero.txt").symlink_to("/dev/zero")
    p = redraft("index", "--tokenizer", "smollm2-135m", "--out", str(tmp_path / "ds"),
                "--quiet", str(src))
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 0, err
    assert "Traceback" not in err
    skipped = [line for line in err.splitlines() if "not a regular file" in line]
    assert len(skipped) == 2 and any("pipe.txt" in s for s in skipped) \
        and any("zero.txt" in s for s in skipped), err
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["n_docs"] == 1, manifest
    # Named explicitly, a FIFO or a device is refused in one line (no read is tried).
    for name in ("pipe.txt", "zero.txt"):
        q = redraft("index", "--tokenizer", "smollm2-135m", "--out",
                    str(tmp_path / f"ds-{name}"), str(src / name))
        one_line_error(q, "index", "not a regular file")
