"""The cache root every cache honours, and files replaced whole or not at all."""

from __future__ import annotations

import os

import pytest
from redraft.proto.files import cache_root, read_input, write_atomically, write_cache


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("REDRAFT_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("REDRAFT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "redraft"


@pytest.mark.parametrize("durable", [False, True])
def test_a_file_is_replaced_whole_or_not_at_all(tmp_path, durable):
    path = tmp_path / "data.json"
    path.write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_atomically(path, fail, durable=durable)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "data.json"]
    write_atomically(path, lambda tmp: tmp.write_text("new"), durable=durable)
    assert path.read_text() == "new" and len(list(tmp_path.iterdir())) == 1


def test_a_directory_can_be_written_atomically_and_keeps_its_suffix(tmp_path):
    seen = []

    def write(tmp):
        seen.append(tmp.name)
        tmp.mkdir()
        (tmp / "inside").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(tmp_path / "table.npz", write)
    assert seen[0].endswith(".npz") and not list(tmp_path.iterdir())


def test_a_cache_that_cannot_be_written_is_no_error(tmp_path):
    (tmp_path / "plain").write_text("a file where a folder should be")
    assert not write_cache(tmp_path / "plain" / "entry.json", lambda tmp: tmp.write_text("x"))
    assert write_cache(tmp_path / "a" / "b.json", lambda tmp: tmp.write_text("x"))
    assert (tmp_path / "a" / "b.json").read_text() == "x"


def test_an_input_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    """A FIFO would block the reader until a writer came; a directory is no input either."""
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"{}\n")
    assert read_input(data) == b"{}\n"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        with pytest.raises(OSError, match="not a regular file"):
            read_input(path)
