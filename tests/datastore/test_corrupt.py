"""Damaged or missing datastores: typed errors on open or verify, never a crash."""

from __future__ import annotations

import os

import lmdb
import numpy as np
import pytest
from redraft.datastore import DatastoreCorrupt, DatastoreNotFound, Reader
from redraft.datastore import format as fmt


@pytest.fixture
def store(make_store):
    docs = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3] * 50, [6, 5, 4] * 30]
    return make_store(docs, vocab=8)


def _file(store):
    return store / fmt.DATA_FILE


def _patch(path, old: bytes, new: bytes) -> None:
    """Replace every copy (LMDB may keep stale copies of small values in free pages)."""
    data = path.read_bytes()
    assert old in data and len(old) == len(new)
    path.write_bytes(data.replace(old, new))


def test_missing(tmp_path):
    with pytest.raises(DatastoreNotFound, match="no such datastore"):
        Reader(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatastoreNotFound, match="missing datastore.lmdb"):
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
    env = lmdb.open(str(_file(store)), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        fn(txn)
    env.close()


def test_other_format_version(store):
    import json

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
    import json

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
        return r._lm.locate(key)


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_names_are_checksummed(store):
    off, n = _offset_of(store, fmt.shard_key(0, "names"))
    _flip(_file(store), off + n // 2)
    with Reader(store) as r:  # opening reads no names
        with pytest.raises(DatastoreCorrupt, match="checksum mismatch in shard 0 names"):
            r.doc_name(0)
    with pytest.raises(DatastoreCorrupt, match="checksum mismatch in shard 0 names"):
        Reader(store, verify=True)


def test_writers_refuse_a_damaged_datastore(store):
    from redraft.datastore import append_corpus, delete_documents

    off, n = _offset_of(store, fmt.shard_key(0, "sa"))
    _flip(_file(store), off + n - 3)
    before = _file(store).read_bytes()
    with pytest.raises(DatastoreCorrupt, match="refusing to modify a damaged datastore: .*"
                                               "checksum mismatch in shard 0 sa"):
        append_corpus(None, store, documents=[[1, 2]], fingerprint="test-vocab-8")
    with pytest.raises(DatastoreCorrupt, match="refusing to modify.*shard 0 sa"):
        delete_documents(store, [0])
    assert _file(store).read_bytes() == before


def _as_version_1(store, deleted=()) -> None:
    """Rewrite a datastore as redraft's format 1 wrote it: no crc32 of names, tombstones."""
    import json

    from pyroaring import BitMap

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
    assert m["version"] == 2 and all("names" in sm["crc32"] for sm in m["shards"])
    with Reader(store, verify=True) as r:
        assert r.count([3, 4]) == 2 and [r.doc_name(i) for i in range(3)] == [
            "doc0", "doc1", "doc0"]


def test_version_1_names_are_checked_by_zlib(make_store):
    store = make_store([[1, 2, 3]], vocab=8)
    _as_version_1(store)
    off, n = _offset_of(store, fmt.shard_key(0, "names"))
    _flip(_file(store), off + n - 2)  # inside zlib's adler32 of the names
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
    clean = (ds / fmt.DATA_FILE).read_bytes()
    offsets = [4096 * p + 17 for p, _ in _tree_pages(ds / fmt.DATA_FILE)] + [72 * 4096 + 17]
    for off in offsets:
        damaged = bytearray(clean)
        damaged[off] ^= 0xFF
        (ds / fmt.DATA_FILE).write_bytes(damaged)
        for argv in (["stats", ds], ["query", "--datastore", ds, "--tokens", "1,2"],
                     ["index", "--quiet", "--append", "--out", ds, more],
                     ["index", "--out", ds, "--delete", "1"]):
            p = subprocess.run([*cli, *argv], capture_output=True, text=True, timeout=300)
            assert p.returncode == 2, (off, argv, p.returncode, p.stderr)
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"redraft {argv[0]}: error: "), p.stderr
        assert (ds / fmt.DATA_FILE).read_bytes() == damaged
