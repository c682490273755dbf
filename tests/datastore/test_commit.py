"""Segments and the commit point: what each write touches, learned outputs and their marks,
merges, leftovers of killed writers, legacy single-file datastores and their upgrade."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from redraft.datastore import (
    CommitConflict,
    DatastoreCorrupt,
    InvalidQuery,
    Reader,
    TokenizerMismatch,
    append_corpus,
    build_datastore,
    commit_stamp,
    delete_documents,
    learned_marks,
    persist_learned,
    tiers,
    upgrade_datastore,
)
from redraft.datastore import format as fmt
from redraft.datastore import manifest as mf
from redraft.datastore.drafting import retrieval_tree
from redraft.decoder.cli import main

VOCAB = 50


def _docs(rng, n_tokens: int, doc_len: int = 500) -> list[list[int]]:
    return [rng.integers(0, VOCAB, size=doc_len).tolist() for _ in range(n_tokens // doc_len)]


def _inodes(store) -> dict[str, int]:
    return {s["file"]: os.stat(store / s["file"]).st_ino for s in mf.read(store)[0]["segments"]}


@pytest.fixture(scope="module")
def three_tier1_segments(tmp_path_factory):
    """A datastore of three segments too big for small commits to merge (tier 1)."""
    rng = np.random.default_rng(5)
    per_segment = tiers.FLOOR_TOKENS // 500 + 10  # documents of 500 tokens
    docs = _docs(rng, 3 * per_segment * 500)
    out = tmp_path_factory.mktemp("big") / "ds"
    build_datastore(None, out, documents=docs, fingerprint="f", vocab_size=VOCAB,
                    segment_tokens=per_segment * 501)
    return out, docs


def test_append_writes_only_new_segments_and_delete_only_the_ones_it_changes(
        three_tier1_segments, tmp_path, files):
    src, docs = three_tier1_segments
    store = tmp_path / "ds"
    shutil.copytree(src, store)
    before = _inodes(store)
    assert len(before) == 3
    names = list(before)
    append_corpus(None, store, documents=[[1, 2, 3, 4]] * 3, fingerprint="f", corpus="more")
    after = _inodes(store)
    assert {k: after[k] for k in names} == before and len(after) == 4  # untouched, one more
    with Reader(store) as r:
        first2 = r.manifest["segments"][1]["first_doc"]
        names_before = [r.doc_name(i) for i in range(r.n_docs_total)]
    victim = first2 + 2  # a document of the second segment
    m = delete_documents(store, [victim])
    after_delete = _inodes(store)
    assert [s["file"] for s in m["segments"]][0::2] == [names[0], names[2]]
    assert names[1] not in after_delete and not (store / names[1]).exists()
    assert after_delete[names[0]] == before[names[0]] and after_delete[names[2]] == before[
        names[2]]
    with Reader(store, verify=True) as r:
        assert [r.doc_name(i) for i in range(r.n_docs_total)] == names_before  # ids unchanged
        assert sorted(r.deleted) == [victim] and r.n_docs == len(docs) + 3 - 1
        assert r.count(docs[victim][100:110]) == 0 or r.count(docs[victim][100:110]) == sum(
            1 for i, d in enumerate(docs) if i != victim and _occurs(d, docs[victim][100:110]))
        assert r.find([1, 2, 3, 4], limit=5) == [(len(docs) + k, 0) for k in range(3)]
    assert sorted(os.listdir(store)) == sorted([fmt.WRITE_LOCK, mf.MANIFEST_FILE,
                                                *after_delete])


def _occurs(doc: list[int], pat: list[int]) -> bool:
    n = len(pat)
    return any(doc[i:i + n] == pat for i in range(len(doc) - n + 1))


def test_verbs_across_segments_match_a_single_segment(three_tier1_segments, tmp_path):
    """Global ids are first_doc + local ids: every verb answers as one segment would."""
    src, docs = three_tier1_segments
    single = tmp_path / "single"
    build_datastore(None, single, documents=docs, fingerprint="f", vocab_size=VOCAB)
    rng = np.random.default_rng(9)
    with Reader(src) as a, Reader(single) as b:
        assert len(a.segments) == 3 and len(b.segments) == 1
        assert a.n_docs_total == b.n_docs_total and a.n_tokens == b.n_tokens
        for _ in range(60):
            d = docs[int(rng.integers(len(docs)))]
            p = int(rng.integers(len(d) - 8))
            pat = d[p:p + int(rng.integers(1, 6))]
            assert a.count(pat) == b.count(pat)
            assert a.find(pat, limit=10**6) == b.find(pat, limit=10**6)
            assert a.next_token_counts(pat) == b.next_token_counts(pat)
            assert a.longest_match(d[p:p + 12] + [1]) == b.longest_match(d[p:p + 12] + [1])
        assert [a.doc_name(i) for i in (0, len(docs) // 2, len(docs) - 1)] == [
            b.doc_name(i) for i in (0, len(docs) // 2, len(docs) - 1)]
        ids = [i for i, _, _ in a.documents("default", newest_first=True)]
        assert ids == list(range(len(docs) - 1, -1, -1))
        for _ in range(20):  # the retrieval tree, every occurrence sampled: the same tree
            d = docs[int(rng.integers(len(docs)))]
            p = int(rng.integers(len(d) - 8))
            ta, tb = (retrieval_tree(x, d[p:p + 8], budget=32, max_occurrences=10**6)
                      for x in (a, b))
            assert (ta.tokens, ta.parents, ta.match_len) == (tb.tokens, tb.parents, tb.match_len)
            assert ta.probs == pytest.approx(tb.probs)


def test_a_hundred_small_appends_stay_proportional(tmp_path):
    """Issue 21.4: 100 appends of ~100 tokens to a 1.4 MB datastore (the default model's
    vocabulary: every shard holds a 196 KB first-token table) used to grow it to 21 MB,
    each one rewriting the whole file. Now the size follows the data, no append writes
    more than a bounded segment, and the segments stay few (timings: the benchmark)."""
    rng = np.random.default_rng(21)
    vocab = 49152
    base = [rng.integers(0, vocab, size=1000).tolist() for _ in range(200)]
    store = tmp_path / "ds"
    build_datastore(None, store, documents=base, fingerprint="f", vocab_size=vocab)
    with Reader(store) as r:
        start = r.files_bytes
    assert 1_000_000 < start < 2_000_000
    most_segments, most_written = 0, 0
    for _ in range(100):
        names = set(os.listdir(store))
        m = append_corpus(None, store, documents=[rng.integers(0, vocab, size=100).tolist()],
                          fingerprint="f", corpus="learned")
        written = sum((store / f).stat().st_size for f in set(os.listdir(store)) - names)
        most_written = max(most_written, written)
        most_segments = max(most_segments, m["n_segments"])
    with Reader(store, verify=True) as r:
        end = r.files_bytes
        assert r.corpora["learned"] == {"n_docs": 100, "n_tokens": 10_000}
        assert len(r.segments) == 2  # the corpus, and every append merged into one
    assert end < start + 400_000  # 10,000 tokens more: 60 KB of arrays, one table, pages
    assert most_segments <= 2
    assert most_written < start / 2  # never the whole datastore again


def test_persist_learned_commits_documents_and_marks_together(make_store):
    store = make_store([[1, 2, 3]], vocab=8)
    assert learned_marks(store) == {}
    m = persist_learned(store, [("learned:a", [4, 5, 6]), ("learned:b", [])],
                        {"log-1": {"watermark": 7}}, fingerprint="test-vocab-8")
    assert m["learned"] == learned_marks(store) == {"log-1": {"watermark": 7}}
    with Reader(store) as r:
        assert [(n, t) for _, n, t in r.documents("learned")] == [("learned:a", [4, 5, 6])]
        assert r.manifest["build"]["history"][-1]["op"] == "learned"
    # compare-and-swap: marks changed since they were read -> nothing written
    stamp = commit_stamp(store)
    with pytest.raises(CommitConflict, match="learned marks changed"):
        persist_learned(store, [("learned:a", [7])], {"log-1": {"watermark": 8}},
                        fingerprint="test-vocab-8", expect={"log-1": {"watermark": 6}})
    assert commit_stamp(store) == stamp
    # marks only, no documents: a commit all the same
    m = persist_learned(store, [], {"log-1": {"watermark": 9}}, fingerprint="test-vocab-8",
                        expect={"log-1": {"watermark": 7}})
    assert learned_marks(store) == {"log-1": {"watermark": 9}} and commit_stamp(store) != stamp
    with pytest.raises(TokenizerMismatch):
        persist_learned(store, [("x", [1])], {}, fingerprint="other")
    with pytest.raises(InvalidQuery, match="not JSON-able"):
        persist_learned(store, [("x", [1])], {"w": float("nan")}, fingerprint="test-vocab-8")
    with pytest.raises(InvalidQuery, match="must be a dict"):
        persist_learned(store, [("x", [1])], [1], fingerprint="test-vocab-8")
    assert learned_marks(store) == {"log-1": {"watermark": 9}}


def test_commit_stamp_tells_every_commit_apart(make_store, files):
    store = make_store([[1, 2, 3]], vocab=8)
    stamps = {commit_stamp(store)}
    for i in range(5):  # marks of one size: same manifest size, maybe the same inode
        persist_learned(store, [], {"w": i}, fingerprint="test-vocab-8")
        stamps.add(commit_stamp(store))
    assert len(stamps) == 6
    assert commit_stamp(store / mf.MANIFEST_FILE) == commit_stamp(store)
    assert commit_stamp(store / "nowhere") == ("missing",)
    files.as_legacy(store)
    assert commit_stamp(store)[0] == "legacy"


def test_the_next_writer_removes_what_killed_writers_left(make_store, files):
    store = make_store([[1, 2, 3]], vocab=8)
    junk = [f"{fmt.TMP_PREFIX}{mf.segment_name(2)}", f"{fmt.TMP_PREFIX}manifest-99.json",
            mf.segment_name(2), f"{fmt.LEGACY_TMP_PREFIX}1234"]
    for name in junk:
        (store / name).write_bytes(b"half-written")
    (store / "notes.txt").write_text("mine")  # not redraft's: never touched
    with Reader(store, verify=True) as r:  # readers never look at them
        assert r.count([1, 2]) == 1
    append_corpus(None, store, documents=[[4]], fingerprint="test-vocab-8")
    assert sorted(os.listdir(store)) == sorted(
        [fmt.WRITE_LOCK, mf.MANIFEST_FILE, "notes.txt", *(p.name for p in
                                                           files.segment_files(store))])


# ---- the single-file layout of format 2 ---------------------------------------------------
def test_a_legacy_datastore_reads_and_any_write_converts_it(make_store, files):
    for write in ("append", "delete", "learned"):
        store = make_store([[1, 2, 3], [2, 3, 4]], vocab=8)
        legacy = files.as_legacy(store)
        data = legacy.read_bytes()
        with Reader(store, verify=True) as r:
            assert r.layout == "legacy" and r.manifest["legacy"] and r.count([2, 3]) == 2
            assert r.segments == [fmt.DATA_FILE] and r.doc_name(1) == "doc1"
        if write == "append":
            append_corpus(None, store, documents=[[5]], fingerprint="test-vocab-8")
        elif write == "delete":
            delete_documents(store, [0])
        else:
            persist_learned(store, [("l", [6])], {"w": 1}, fingerprint="test-vocab-8")
        assert not legacy.exists() and (store / mf.MANIFEST_FILE).exists()
        with Reader(store, verify=True) as r:
            assert r.layout == "segments" and r.count([2, 3]) == (1 if write == "delete" else 2)
            assert [h["op"] for h in r.manifest["build"]["history"]][-2] == "upgrade"
        assert data  # the old bytes went into a segment (linked or copied), nothing else


def test_upgrade_command(make_store, files, capsys):
    store = make_store([[1, 2, 3], [2, 3, 4]], vocab=8)
    files.as_legacy(store)
    assert main(["index", "--upgrade", str(store)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"upgraded {store} to segments: 1 segment(s), 2 documents")
    (seg,) = files.segment_files(store)
    assert sorted(os.listdir(store)) == sorted([fmt.WRITE_LOCK, mf.MANIFEST_FILE, seg.name])
    assert main(["index", "--upgrade", str(store)]) == 0  # idempotent
    assert "already stored as segments" in capsys.readouterr().out
    assert upgrade_datastore(store)[1] is False
    with Reader(store, verify=True) as r:
        assert r.count([2, 3]) == 2


def test_upgrade_refuses_a_damaged_legacy_datastore(make_store, files, capsys):
    store = make_store([[1, 2, 3, 4, 5, 6, 7] * 30], vocab=8)
    legacy = files.as_legacy(store)
    with Reader(store) as r:
        off, n = r._segments[0].lm.locate(fmt.shard_key(0, "sa"))
    data = bytearray(legacy.read_bytes())
    data[off + n // 2] ^= 0x40
    legacy.write_bytes(bytes(data))
    assert main(["index", "--upgrade", str(store)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refusing to modify a damaged datastore" in err[0]
    assert legacy.read_bytes() == bytes(data) and not (store / mf.MANIFEST_FILE).exists()
    assert sorted(os.listdir(store)) == [fmt.WRITE_LOCK, fmt.DATA_FILE]
    with pytest.raises(DatastoreCorrupt):
        append_corpus(None, store, documents=[[1]], fingerprint="test-vocab-8")


def test_an_upgrade_killed_at_either_step_leaves_a_datastore_that_opens(make_store, files):
    """The two steps: link the file under a segment name, then publish manifest.json (then
    remove datastore.lmdb). Killed after the first, the directory is still the legacy one;
    after the second, the segmented one; the next writer removes what is left over."""
    store = make_store([[1, 2, 3]], vocab=8)
    legacy = files.as_legacy(store)
    os.link(legacy, store / mf.segment_name(1))  # killed after the link
    with Reader(store, verify=True) as r:
        assert r.layout == "legacy" and r.count([1, 2]) == 1
    upgrade_datastore(store)
    (seg,) = files.segment_files(store)
    os.link(seg, legacy)  # killed after the commit, before removing the legacy file
    with Reader(store, verify=True) as r:
        assert r.layout == "segments" and r.count([1, 2]) == 1
    append_corpus(None, store, documents=[[4]], fingerprint="test-vocab-8")
    assert not legacy.exists()
    assert sorted(os.listdir(store)) == sorted(
        [fmt.WRITE_LOCK, mf.MANIFEST_FILE, *(p.name for p in files.segment_files(store))])


def test_stats_shows_the_segments(three_tier1_segments, capsys):
    src, _ = three_tier1_segments
    assert main(["stats", "--no-verify", str(src)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["n_segments"] == 3 and [s["kind"] for s in stats["segments"]] == ["corpus"] * 3
    assert stats["segments"][1]["first_doc"] == stats["segments"][0]["n_docs"]
    assert {sh["segment"] for sh in stats["shards"]} == {s["file"] for s in stats["segments"]}


# ---- writers killed at any moment ---------------------------------------------------------
_WRITER = """
import sys, time
import numpy as np
from redraft.datastore import append_corpus, delete_documents

store, op = sys.argv[1], sys.argv[2]
more = [np.random.default_rng(1).integers(0, 50, size=500).tolist() for _ in range(40)]
print("go", flush=True)
t0 = time.perf_counter()
if op == "append":  # a new segment, merged with the small one before it
    append_corpus(None, store, documents=more, fingerprint="f", corpus="more")
else:  # rewrites a segment of each tier
    delete_documents(store, [3, 150])
print(time.perf_counter() - t0, flush=True)
"""


def _writer(store, op: str):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(store), op],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "go"
    return proc


def _state(store) -> tuple[int, int]:
    with Reader(store, verify=True) as r:
        return r.n_docs, r.count([1, 2])


@pytest.mark.parametrize("op", ["append", "delete"])
def test_a_writer_killed_at_any_moment_leaves_a_datastore_that_opens(tmp_path, op):
    """SIGKILL at random moments of a real writer process (writing segments, merging,
    publishing, unlinking): the directory opens, verified, as the commit before or the one
    after; the next writer removes what was left and finds nothing else wrong."""
    import signal
    import time

    rng = np.random.default_rng(23 if op == "append" else 24)
    base = tmp_path / "base"
    build_datastore(None, base, documents=_docs(rng, tiers.FLOOR_TOKENS + 10_000),
                    fingerprint="f", vocab_size=VOCAB, segment_tokens=tiers.FLOOR_TOKENS + 500)
    append_corpus(None, base, documents=_docs(rng, 20_000), fingerprint="f")
    before = _state(base)
    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    proc = _writer(probe, op)
    took = float(proc.stdout.readline())
    assert proc.wait(60) == 0
    after = _state(probe)
    assert after != before
    outcomes = set()
    for trial in range(10):
        store = tmp_path / f"t{trial}"
        shutil.copytree(base, store)
        proc = _writer(store, op)
        time.sleep(float(rng.uniform(0, took * 1.3)))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        state = _state(store)
        assert state in (before, after), (trial, state)
        outcomes.add(state == after)
        append_corpus(None, store, documents=[[1, 2]], fingerprint="f")  # the next writer
        named = {s["file"] for s in mf.read(store)[0]["segments"]}
        assert set(os.listdir(store)) == named | {fmt.WRITE_LOCK, mf.MANIFEST_FILE}
        assert _state(store)[0] == state[0] + 1
    print(f"{op}: killed 10 times, outcomes {outcomes}")
