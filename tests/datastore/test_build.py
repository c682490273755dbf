"""Building: arrays and layout, shards, append, atomic replacement (also under SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from redraft.datastore import (
    CorpusError,
    DatastoreError,
    DatastoreNotFound,
    Reader,
    TokenizerMismatch,
    append_corpus,
    build_datastore,
)
from redraft.datastore import format as fmt
from redraft.datastore import manifest as mf


def _brute_sa(arr: list[int]) -> list[int]:
    return sorted(range(len(arr)), key=lambda p: arr[p:])


@pytest.mark.parametrize("vocab,alphabet", [(6, None), (65535, [0, 5, 65534]),
                                            (65536, [0, 5, 65535]), (10**6, [1, 70000, 999999])])
def test_arrays_are_exact(make_store, helpers, vocab, alphabet):
    rng = np.random.default_rng(vocab)
    docs = helpers.random_docs(rng, 25, vocab, max_len=40, alphabet=alphabet)
    path = make_store(docs, vocab=vocab)
    with Reader(path, verify=True) as r:
        want_dtype = "uint16" if vocab <= 65535 else "uint32"
        assert r.manifest["token_dtype"] == want_dtype
        assert r.separator == vocab
        (sh,) = r._shards
        concat = [t for d in docs for t in d + [vocab]]
        assert sh.tokens.tolist() == concat  # no truncation of wide ids
        assert sh.tokens.dtype.byteorder == ">" and sh.tokens.dtype.itemsize == (
            2 if want_dtype == "uint16" else 4)
        assert sh.sa.tolist() == _brute_sa(concat)
        starts = np.cumsum([0] + [len(d) + 1 for d in docs]).tolist()
        assert sh.docs.tolist() == starts
        counts = np.bincount(np.array(concat), minlength=vocab + 1)
        assert sh.bucket.tolist() == [0] + np.cumsum(counts).tolist()
        assert r.doc_name(3) == "doc3"


def test_shards_are_bounded_and_docs_stay_whole(make_store, helpers):
    rng = np.random.default_rng(1)
    docs = helpers.random_docs(rng, 60, 5, max_len=50)
    with Reader(make_store(docs, vocab=5, shard_tokens=200)) as r:
        shards = r.manifest["shards"]
        assert len(shards) > 5
        assert all(s["length"] <= 200 for s in shards)
        assert sum(s["n_docs"] for s in shards) == 60
        assert [s["first_doc"] for s in shards] == np.cumsum(
            [0] + [s["n_docs"] for s in shards[:-1]]).tolist()


def test_pretokenized_input_is_validated(tmp_path):
    with pytest.raises(CorpusError, match="outside the vocabulary"):
        build_datastore(None, tmp_path / "a", documents=[[1, 2, 9]], fingerprint="f",
                        vocab_size=9)
    with pytest.raises(CorpusError, match="empty corpus"):
        build_datastore(None, tmp_path / "b", documents=[[], []], fingerprint="f",
                        vocab_size=9)
    with pytest.raises(CorpusError, match="not a sequence"):
        build_datastore(None, tmp_path / "c", documents=[["x"]], fingerprint="f",
                        vocab_size=9)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_append_adds_shards_and_keeps_existing_ones(make_store, helpers):
    rng = np.random.default_rng(2)
    a, b, c = (helpers.random_docs(rng, 20, 5) for _ in range(3))
    path = make_store(a, vocab=5, corpus="a")
    with Reader(path) as r:
        before = r.manifest["shards"][0]["crc32"]
        old_file_view = r  # keeps reading its snapshot while the file is replaced
        append_corpus(None, path, documents=b, fingerprint="test-vocab-5", corpus="b")
        append_corpus(None, path, documents=c, fingerprint="test-vocab-5", corpus="a",
                      shard_tokens=300)
        assert old_file_view.count([1]) == helpers.Ref(a).count([1])
    ref = helpers.Ref(a + b + c, corpus_of=["a"] * 20 + ["b"] * 20 + ["a"] * 20)
    with Reader(path, verify=True) as r:
        assert r.manifest["shards"][0]["crc32"] == before
        assert r.n_docs == 60 and r.n_tokens == sum(map(len, a + b + c))
        assert r.corpora["a"]["n_docs"] == 40 and r.corpora["b"]["n_docs"] == 20
        assert [h["op"] for h in r.manifest["build"]["history"]] == ["build", "append", "append"]
        for pat in ([1], [2, 3], [0, 0, 1], [4, 4]):
            assert r.count(pat) == ref.count(pat)
            assert r.count(pat, corpora="a") == ref.count(pat, ["a"])
            assert r.find(pat, limit=10**6) == sorted(ref.occurrences(pat))
    with pytest.raises(TokenizerMismatch):
        append_corpus(None, path, documents=[[1]], fingerprint="other", corpus="x")
    with pytest.raises(DatastoreNotFound):
        append_corpus(None, path / "nope", documents=[[1]], fingerprint="test-vocab-5")


def _listing(path) -> list[str]:
    """What a datastore directory should hold: the lock, the manifest, its segments."""
    named = [s["file"] for s in mf.read(path)[0]["segments"]]
    return sorted([fmt.WRITE_LOCK, mf.MANIFEST_FILE, *named])


def test_rebuild_replaces_atomically_and_readers_keep_their_snapshot(make_store):
    path = make_store([[1, 2, 3]], vocab=8)
    old = Reader(path)
    build_datastore(None, path, documents=[[4, 5], [4, 6]], fingerprint="f2", vocab_size=8)
    assert old.count([1, 2]) == 1 and old.tokenizer_fingerprint == "test-vocab-8"
    old.close()
    with Reader(path) as r:
        assert r.count([1, 2]) == 0 and r.count([4]) == 2
        assert r.tokenizer_fingerprint == "f2"
    assert sorted(os.listdir(path)) == _listing(path) and len(_listing(path)) == 3


def test_failed_rebuild_leaves_the_old_store(make_store, tmp_path, files):
    path = make_store([[1, 2, 3]], vocab=8)
    data = files.directory_bytes(path)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(CorpusError, match="bad.txt"):
        build_datastore([bad], path)
    with pytest.raises(CorpusError, match="outside"):
        build_datastore(None, path, documents=[[1, 2], [99]], fingerprint="f", vocab_size=8)
    assert files.directory_bytes(path) == data
    assert sorted(os.listdir(path)) == _listing(path)


def test_one_writer_at_a_time_and_the_next_one_waits(make_store):
    import fcntl
    import threading

    path = make_store([[1, 2]], vocab=8)
    fd = os.open(path / fmt.WRITE_LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        with pytest.raises(DatastoreError, match=r"another process is writing this datastore "
                                                 r"\(waited 0.3 s\)"):
            append_corpus(None, path, documents=[[3]], fingerprint="test-vocab-8", wait_s=0.3)
        assert time.monotonic() - t0 >= 0.3
        # a writer that may wait long enough gets its turn once the lock is released
        threading.Timer(0.5, os.close, (fd,)).start()
        fd = None
        m = append_corpus(None, path, documents=[[3]], fingerprint="test-vocab-8", wait_s=30)
        assert m["n_docs"] == 2
    finally:
        if fd is not None:
            os.close(fd)


_SLOW_BUILD = textwrap.dedent("""
    import sys, time
    from redraft.datastore import build_datastore

    def docs():  # a slow corpus: the build is still writing shards when it is killed
        for i in range(1_000_000):
            if i % 20 == 0:
                time.sleep(0.005)
            yield [i % 7, (i * 3) % 7, 1, 2]

    build_datastore(None, sys.argv[1], documents=docs(), fingerprint="killed",
                    vocab_size=8, shard_tokens=100)
""")


def _kill_mid_build(path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, str(path)])
    try:
        deadline = time.monotonic() + 60
        tmp = None
        while time.monotonic() < deadline:  # wait until shards are being written
            tmps = [f for f in os.listdir(path) if f.startswith(fmt.TMP_PREFIX)] \
                if path.exists() else []
            if tmps and os.path.getsize(path / tmps[0]) > 64 * 1024:
                tmp = tmps[0]
                break
            time.sleep(0.02)
        assert tmp is not None, "the build never started writing"
        assert proc.poll() is None, "the build finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


def test_killed_build_leaves_previous_store_intact(make_store, files):
    path = make_store([[1, 2, 3], [3, 4]], vocab=8)
    data = files.directory_bytes(path)
    _kill_mid_build(path)
    assert {f: b for f, b in files.directory_bytes(path).items() if f in data} == data
    with Reader(path, verify=True) as r:
        assert r.tokenizer_fingerprint == "test-vocab-8" and r.count([3]) == 2
    # the next write cleans up what the killed one left behind
    append_corpus(None, path, documents=[[5]], fingerprint="test-vocab-8")
    assert sorted(os.listdir(path)) == _listing(path)


def test_killed_first_build_leaves_nothing_that_opens(tmp_path):
    path = tmp_path / "fresh"
    _kill_mid_build(path)
    with pytest.raises(DatastoreNotFound):
        Reader(path)


def test_bytes_per_token(make_store, files):
    rng = np.random.default_rng(0)
    # Zipf-ish ids over a 1,000-token vocabulary, 300k tokens in 300 documents
    docs = [np.minimum(rng.zipf(1.3, size=1000), 999).tolist() for _ in range(300)]
    path = make_store(docs, vocab=1000)
    size = os.path.getsize(files.only_segment(path))
    assert size / 300_000 <= 6.2


def test_arrays_are_views_of_the_file_map(make_store, files):
    """Zero-copy: every array is a view into the Reader's map of the file, at the place the
    file holds it (large ones in LMDB overflow pages, small ones inline in a leaf page)."""
    rng = np.random.default_rng(4)
    docs = [rng.integers(0, 300, size=2000).tolist() for _ in range(20)]
    path = make_store(docs, vocab=300)
    data = files.only_segment(path).read_bytes()
    with Reader(path) as r:
        (sh,) = r._shards
        base = np.frombuffer(r._segments[0].lm.view, np.uint8).ctypes.data
        for arr in (sh.tokens, sh.sa, sh.docs, sh.bucket):
            off = arr.ctypes.data - base
            assert 0 < off and off + arr.nbytes <= len(data)
            assert data[off:off + arr.nbytes] == arr.tobytes()
        assert (sh.sa.ctypes.data - base) % 4096 == 16  # an overflow run: after its header
