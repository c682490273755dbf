"""Damaged or missing datastores: typed errors on open or verify, never a crash.

Two levels: the commit point (manifest.json: its bytes, its crc32, the segments it names) and
each segment file (LMDB structure, its own manifest, arrays, names, bitmaps). Damage inside
a segment is made with `resync` where the commit point would otherwise catch it first (it
records each segment's size and its manifest's crc32), so that both levels are tested.
"""

from __future__ import annotations

import json
import os
import shutil

import lmdb
import numpy as np
import pytest
from redraft.datastore import DatastoreCorrupt, DatastoreNotFound, Reader
from redraft.datastore import format as fmt
from redraft.datastore import manifest as mf
from redraft.datastore.lmdbfile import LmdbFile
from redraft.decoder.cli import main

from ..conftest import flip_byte


@pytest.fixture
def store(make_store):
    docs = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3] * 50, [6, 5, 4] * 30]
    return make_store(docs, vocab=8)


def _file(store):
    """The datastore's one segment file (or its legacy single file)."""
    if (store / fmt.DATA_FILE).exists():
        return store / fmt.DATA_FILE
    (seg,) = mf.read(store)[0]["segments"]
    return store / seg["file"]


def _patch(path, old: bytes, new: bytes) -> None:
    """Replace every copy (LMDB may keep stale copies of small values in free pages)."""
    data = path.read_bytes()
    assert old in data and len(old) == len(new)
    path.write_bytes(data.replace(old, new))


def test_missing(tmp_path):
    with pytest.raises(DatastoreNotFound, match="no such datastore"):
        Reader(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatastoreNotFound, match="no datastore here"):
        Reader(tmp_path / "empty")


def test_not_an_lmdb_file(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / fmt.DATA_FILE).write_bytes(b"hello" * 5000)
    with pytest.raises(DatastoreCorrupt):
        Reader(tmp_path / "ds")


def test_truncated(store):
    data = _file(store).read_bytes()
    for keep in (len(data) // 2, len(data) - 4096, 100):
        _file(store).write_bytes(data[:keep])
        with pytest.raises(DatastoreCorrupt):
            Reader(store)


def test_wrong_magic(store):
    _patch(_file(store), fmt.MAGIC, b"something-else\x00\x00\x00\x00".ljust(len(fmt.MAGIC)))
    with pytest.raises(DatastoreCorrupt, match="wrong magic"):
        Reader(store)


def test_manifest_damage_is_detected(store):
    _patch(_file(store), b'"format":"redraft-datastore"', b'"format":"redraft-datastorf"')
    with pytest.raises(DatastoreCorrupt, match="manifest checksum"):
        Reader(store)


def _rewrite(store, fn) -> None:
    """Edit a segment in place with LMDB itself, then let manifest.json name it as it is."""
    env = lmdb.open(str(_file(store)), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        fn(txn)
    env.close()
    if (store / mf.MANIFEST_FILE).exists():
        _resync(store)


def _resync(store) -> None:
    """Make manifest.json name its segments as they now are (size, crc32 of their own
    manifest): damage the commit point cannot see, left for the per-segment checks."""
    path = store / mf.MANIFEST_FILE
    m = json.loads(path.read_text())
    for s in m["segments"]:
        f = store / s["file"]
        s["bytes"] = f.stat().st_size
        with LmdbFile(str(f)) as lm:
            s["crc32"] = fmt.crc32(lm.get(fmt.KEY_MANIFEST))
    path.write_bytes(mf.encode(m))


def test_other_format_version(store):
    def bump(txn):
        m = json.loads(bytes(txn.get(fmt.KEY_MANIFEST)))
        m["version"] = fmt.FORMAT_VERSION + 1
        fmt.write_header(txn, m)

    _rewrite(store, bump)
    with pytest.raises(DatastoreCorrupt, match="format version 3, this redraft reads 1 and 2"):
        Reader(store)


def test_missing_and_short_arrays(store):
    _rewrite(store, lambda txn: txn.delete(fmt.shard_key(0, "sa")))
    with pytest.raises(DatastoreCorrupt, match="missing shard/000000/sa"):
        Reader(store)


def test_short_array(make_store):
    store = make_store([[1, 2, 3]], vocab=8)
    _rewrite(store, lambda txn: txn.put(fmt.shard_key(0, "tokens"), b"\x00\x01"))
    with pytest.raises(DatastoreCorrupt, match="tokens has 2 bytes"):
        Reader(store)


def test_checksum_mismatch_in_an_array(store):
    tokens_be = np.array([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], dtype=">u2").tobytes()
    _patch(_file(store), tokens_be, np.array([1, 2, 3, 4, 5, 6, 7, 1, 2, 4], ">u2").tobytes())
    with Reader(store) as r:  # opening is O(1): it does not read the arrays
        assert r.n_tokens > 0
    with pytest.raises(DatastoreCorrupt, match="checksum mismatch in shard 0 tokens"):
        Reader(store, verify=True)


def test_checksum_mismatch_in_a_bitmap(make_store):
    store = make_store([[1, 2, 3], [2, 3]], vocab=8, corpus="a")
    from pyroaring import BitMap

    _rewrite(store, lambda txn: txn.put(fmt.corpus_key("a"), BitMap([0]).serialize()))
    with pytest.raises(DatastoreCorrupt, match="checksum mismatch in corpus/a"):
        Reader(store, verify=True)


def test_manifest_with_inconsistent_fields(store):
    def damage(txn):
        m = json.loads(bytes(txn.get(fmt.KEY_MANIFEST)))
        m["shards"][0]["length"] = "many"
        fmt.write_header(txn, m)

    _rewrite(store, damage)
    with pytest.raises(DatastoreCorrupt, match="inconsistent manifest"):
        Reader(store)


# ---- damage the checksums catch, and what writers do with it ----------------------------
def _offset_of(store, key: bytes) -> tuple[int, int]:
    """(offset, length) of a stored value in the file."""
    with Reader(store) as r:
        return r._segments[0].lm.locate(key)


def test_names_are_checksummed(store):
    off, n = _offset_of(store, fmt.shard_key(0, "names"))
    flip_byte(_file(store), off + n // 2, 0xFF)
    with Reader(store) as r:  # opening reads no names
        with pytest.raises(DatastoreCorrupt, match="checksum mismatch in shard 0 names"):
            r.doc_name(0)
    with pytest.raises(DatastoreCorrupt, match="checksum mismatch in shard 0 names"):
        Reader(store, verify=True)


def test_writers_refuse_a_damaged_datastore(store):
    from redraft.datastore import append_corpus, delete_documents

    off, n = _offset_of(store, fmt.shard_key(0, "sa"))
    flip_byte(_file(store), off + n - 3, 0xFF)
    before = _listing(store)
    # the append would merge its small segment with the damaged one: refused as a whole
    with pytest.raises(DatastoreCorrupt, match="refusing to modify a damaged datastore: .*"
                                               "checksum mismatch in shard 0 sa"):
        append_corpus(None, store, documents=[[1, 2]], fingerprint="test-vocab-8")
    with pytest.raises(DatastoreCorrupt, match="refusing to modify.*shard 0 sa"):
        delete_documents(store, [0])
    assert _listing(store) == before


def _listing(store) -> dict[str, bytes]:
    return {f: (store / f).read_bytes() for f in sorted(os.listdir(store))
            if f != fmt.WRITE_LOCK}


def _as_legacy(store) -> None:
    """The single-file layout of format 2: the one segment as datastore.lmdb, no manifest."""
    os.replace(_file(store), store / fmt.DATA_FILE)
    (store / mf.MANIFEST_FILE).unlink()


def _as_version_1(store, deleted=()) -> None:
    """Rewrite a datastore as redraft's format 1 wrote it (one file, no crc32 of names,
    tombstones)."""
    from pyroaring import BitMap

    _as_legacy(store)

    def downgrade(txn):
        m = json.loads(bytes(txn.get(fmt.KEY_MANIFEST)))
        m["version"] = 1
        for sm in m["shards"]:
            del sm["crc32"]["names"]
        raw = BitMap(deleted).serialize()
        txn.put(fmt.KEY_DELETED, raw)
        m["checksums"]["deleted"] = fmt.crc32(raw)
        m["n_deleted"] = len(deleted)
        fmt.write_header(txn, m)

    _rewrite(store, downgrade)


def test_version_1_is_read_and_upgraded_by_a_write(make_store):
    from redraft.datastore import append_corpus

    store = make_store([[1, 2, 3], [2, 3, 4]], vocab=8, shard_tokens=5)
    _as_version_1(store)
    with Reader(store, verify=True) as r:
        assert r.manifest["version"] == 1 and r.count([2, 3]) == 2 and r.doc_name(1) == "doc1"
    m = append_corpus(None, store, documents=[[3, 4]], fingerprint="test-vocab-8")
    assert m["version"] == mf.DIRECTORY_VERSION and not (store / fmt.DATA_FILE).exists()
    with Reader(store, verify=True) as r:
        assert all("names" in sm["crc32"] for sm in r.manifest["shards"])
        assert {s.version for s in r._segments} == {fmt.FORMAT_VERSION}
        assert r.count([3, 4]) == 2 and [r.doc_name(i) for i in range(3)] == [
            "doc0", "doc1", "doc0"]


def test_version_1_names_are_checked_by_zlib(make_store):
    store = make_store([[1, 2, 3]], vocab=8)
    _as_version_1(store)
    off, n = _offset_of(store, fmt.shard_key(0, "names"))
    flip_byte(_file(store), off + n - 2, 0xFF)  # inside zlib's adler32 of the names
    with pytest.raises(DatastoreCorrupt, match="shard 0 names are damaged"):
        Reader(store, verify=True)


def test_version_1_with_tombstones_is_refused(make_store):
    store = make_store([[1, 2, 3], [2, 3, 4]], vocab=8)
    _as_version_1(store, deleted=[1])
    with pytest.raises(DatastoreCorrupt, match="format version 1 with deleted documents"):
        Reader(store)


# ---- damage LMDB itself would fault on (SIGBUS): only ever one line ----------------------
def _tree_pages(path) -> list[tuple[int, int]]:
    """(page number, level) of every branch and leaf page of the current tree."""
    from redraft.datastore.lmdbfile import P_BRANCH, P_LEAF, LmdbFile

    lm = LmdbFile(str(path))
    try:
        out, todo = [], [(lm.root, 1)]
        while todo:
            pgno, level = todo.pop()
            out.append((pgno, level))
            if level < lm.depth:
                off, n, upper = lm._page(pgno, P_BRANCH)
                todo += [(lm._child(off, upper, i), level + 1) for i in range(n)]
            else:
                lm._page(pgno, P_LEAF)
        return out
    finally:
        lm.close()


def test_a_flipped_node_pointer_is_one_line_for_every_command(tmp_path):
    """The reported case: a datastore of the standard library's json package, one byte of a
    leaf page's node pointer flipped; LMDB would read outside the file (SIGBUS)."""
    import subprocess
    import sys
    import sysconfig

    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    ds = tmp_path / "ds"
    cli = [sys.executable, "-m", "redraft.decoder.cli"]
    subprocess.run([*cli, "index", "--quiet", "--out", ds, src], check=True, timeout=300)
    more = tmp_path / "more.py"
    more.write_text("import json\n")
    seg = _file(ds)
    clean = seg.read_bytes()
    offsets = [4096 * p + 17 for p, _ in _tree_pages(seg)] + [72 * 4096 + 17]
    for off in offsets:
        damaged = bytearray(clean)
        damaged[off] ^= 0xFF
        seg.write_bytes(damaged)
        for argv in (["stats", ds], ["query", "--datastore", ds, "--tokens", "1,2"],
                     ["index", "--quiet", "--append", "--out", ds, more],
                     ["index", "--out", ds, "--delete", "1"]):
            p = subprocess.run([*cli, *argv], capture_output=True, text=True, timeout=300)
            assert p.returncode == 2, (off, argv, p.returncode, p.stderr)
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"redraft {argv[0]}: error: "), p.stderr
        assert seg.read_bytes() == damaged


# ---- the commit point: manifest.json and the segments it names --------------------------
def _edit_manifest(store, edit) -> None:
    """Change manifest.json's fields and re-seal it (its crc32 holds over the edit)."""
    m = json.loads((store / mf.MANIFEST_FILE).read_text())
    edit(m)
    (store / mf.MANIFEST_FILE).write_bytes(mf.encode(m))


def _replace_text(store, old: str, new: str) -> None:
    path = store / mf.MANIFEST_FILE
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def _another_segment(store, tmp_path, make_store) -> None:
    """manifest.json names a segment file of another datastore (same tokenizer)."""
    other = make_store([[1, 2, 3, 4] * 40], vocab=8, name="other")
    seg = _file(other)
    shutil.copy(seg, store / seg.name)
    _edit_manifest(store, lambda m: m["segments"][0].update(file=seg.name))


def _same_size_other_crc(store, tmp_path, make_store) -> None:
    _edit_manifest(store, lambda m: m["segments"][0].update(
        crc32=(m["segments"][0]["crc32"] + 1) & 0xFFFFFFFF))


COMMIT_DAMAGE = {
    "a flipped digit": (lambda s, t, mk: _replace_text(s, '"generation": 1', '"generation": 7'),
                        "manifest checksum mismatch"),
    "a changed crc32": (lambda s, t, mk: _replace_text(s, '"crc32": ', '"crc32": 1'),
                        "manifest checksum mismatch"),
    "truncation": (lambda s, t, mk: (s / mf.MANIFEST_FILE).write_bytes(
        (s / mf.MANIFEST_FILE).read_bytes()[:300]), "not valid JSON"),
    "an empty file": (lambda s, t, mk: (s / mf.MANIFEST_FILE).write_bytes(b""),
                      "not valid JSON"),
    "deep nesting": (lambda s, t, mk: (s / mf.MANIFEST_FILE).write_bytes(b"[" * 100_000),
                     "not valid JSON"),
    "not an object": (lambda s, t, mk: (s / mf.MANIFEST_FILE).write_bytes(b"[1, 2]"),
                      "not a redraft datastore manifest"),
    "a missing segment": (lambda s, t, mk: _file(s).unlink(), "missing (manifest.json names it)"),
    "another datastore's segment": (_another_segment, "the datastore's manifest says"),
    "a segment's crc32": (_same_size_other_crc, "not the segment the datastore's manifest names"),
    "a truncated segment": (lambda s, t, mk: os.truncate(_file(s), 8192),
                            "truncated"),
    "a name outside the directory": (
        lambda s, t, mk: _edit_manifest(s, lambda m: m["segments"][0].update(
            file="../seg-000001-00000000.lmdb")), "is not a segment file name"),
    "a gap in the document ids": (
        lambda s, t, mk: _edit_manifest(s, lambda m: m["segments"][0].update(first_doc=3)),
        "document ids out of sequence"),
    "a string where a count belongs": (
        lambda s, t, mk: _edit_manifest(s, lambda m: m["segments"][0].update(n_docs="2")),
        "n_docs must be a non-negative integer"),
    "a string as the shard size": (  # a hand edit: was a 26-line traceback from --append
        lambda s, t, mk: _edit_manifest(s, lambda m: m["build"].update(shard_tokens="x")),
        "build.shard_tokens must be a non-negative integer"),
    "another version": (lambda s, t, mk: _edit_manifest(s, lambda m: m.update(version=4)),
                        "format version 4"),
    "another tokenizer": (
        lambda s, t, mk: _edit_manifest(s, lambda m: m["tokenizer"].update(fingerprint="x")),
        "built with another tokenizer"),
}


@pytest.mark.parametrize("damage", sorted(COMMIT_DAMAGE))
def test_damaged_commit_point_is_one_line_for_every_command(store, tmp_path, make_store,
                                                             capsys, damage):
    make, match = COMMIT_DAMAGE[damage]
    make(store, tmp_path, make_store)
    before = _listing(store)
    more = tmp_path / "more.txt"
    more.write_text("1 2 3\n")
    for argv in (["stats", store], ["query", "--datastore", store, "--tokens", "1,2"],
                 ["index", "--quiet", "--append", "--out", store, more],
                 ["index", "--out", store, "--delete", "1"]):
        rc = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (argv, rc, err)
        assert lines[0].startswith(f"redraft {argv[0]}: error: ") and match in lines[0], lines
    assert _listing(store) == before  # writers changed nothing, not even leftovers


def test_a_reader_keeps_its_snapshot_when_segments_are_replaced_and_unlinked(make_store):
    from redraft.datastore import delete_documents

    store = make_store([[1, 2, 3], [4, 5, 6]], vocab=8)
    old_file = _file(store)
    with Reader(store) as old:
        delete_documents(store, [1])
        assert not old_file.exists()  # replaced, and unlinked right after the commit
        assert old.count([4, 5]) == 1 and old.doc_name(1) == "doc1"  # the map still holds
        old.verify()
        with Reader(store) as new:
            assert new.count([4, 5]) == 0 and new.count([1, 2]) == 1


# ---- damage that only reading meets (a Reader opened without verifying) ----------------------
VOCAB_7 = 3000


def _damage_continuation(store, doc: int, at: int, n: int) -> list[int]:
    """Overwrite n tokens of document `doc` from offset `at` with 0xFFFF (an id past the
    vocabulary) in the segment file itself, recomputing nothing; returns the document."""
    with Reader(store) as r:
        sh = r._shards[0]
        start = int(sh.docs[doc])
        original = r.shard_documents(0)[doc].tolist()
        seg = sh.segment.file
        off, _ = sh.segment.where(fmt.shard_key(0, "tokens"))
    fd = os.open(seg, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff\xff" * n, off + 2 * (start + at))
    finally:
        os.close(fd)
    return original


@pytest.mark.parametrize("choice", ["python", "native"])
def test_ids_past_the_vocabulary_in_unverified_arrays_are_never_drafted(make_store, choice):
    from redraft.datastore.drafting import DraftSettings, new_session_drafter
    from redraft.datastore.drafting.session_drafter import DEFAULT_PARAMS
    rng = np.random.default_rng(7)
    docs = [rng.integers(1, VOCAB_7, 200).tolist() for _ in range(20)]
    store = make_store(docs, vocab=VOCAB_7)
    doc = _damage_continuation(store, 5, 30, 4)
    settings = DraftSettings(DEFAULT_PARAMS.replace(budget=16, sources=("rest",)))
    with Reader(store) as r:  # no verification: opening reads no array
        d = new_session_drafter(doc[:30], settings, r, choice=choice)
        with pytest.raises(DatastoreCorrupt, match="damaged token arrays .*65535"):
            d.propose()
        with pytest.raises(DatastoreCorrupt, match="damaged token arrays"):
            r.next_token_counts(doc[:30])
        with pytest.raises(DatastoreCorrupt, match="damaged token arrays"):
            list(r.documents("default"))  # what a server reloads learned outputs with
        # undamaged continuations still draft, and only ids of the vocabulary
        ok = new_session_drafter(docs[9][:30], settings, r, choice=choice).propose()
        assert ok.tokens[0] == docs[9][30] and max(ok.tokens) < VOCAB_7
    with pytest.raises(DatastoreCorrupt, match="checksum mismatch in shard 0 tokens"):
        Reader(store, verify=True)
