"""Damaged or missing datastores: typed errors on open or verify, never a crash."""

from __future__ import annotations

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
