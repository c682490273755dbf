"""Corpus inputs -> documents: files, directories, globs, .jsonl flavours, bad files."""

from __future__ import annotations

import json

import pytest
from redraft.datastore import CorpusError
from redraft.datastore.corpus import expand_inputs, iter_documents, read_text


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").mkdir()
    (tmp_path / "a" / "one.py").write_text("x = 1\n")
    (tmp_path / "a" / "b" / "two.md").write_text("# two\n")
    (tmp_path / "a" / "b" / "three.txt").write_text("three")
    (tmp_path / "a" / "__pycache__").mkdir()
    (tmp_path / "a" / "__pycache__" / "one.cpython-311.pyc").write_bytes(b"\x00\xff")
    (tmp_path / "a" / ".hidden").write_text("secret")
    (tmp_path / "a" / "empty.txt").write_text("")
    return tmp_path


def _names(docs):
    return [d.name for d in docs]


def test_directories_are_walked_recursively_without_caches(tree):
    docs = list(iter_documents([tree / "a"]))
    assert _names(docs) == [str(tree / "a" / "one.py"), str(tree / "a" / "b" / "three.txt"),
                            str(tree / "a" / "b" / "two.md")]
    assert [d.text for d in docs] == ["x = 1\n", "three", "# two\n"]


def test_globs_files_exclusions_and_duplicates(tree):
    files = expand_inputs([str(tree / "a" / "**" / "*.md"), tree / "a" / "one.py",
                           tree / "a" / "one.py"])
    assert files == [tree / "a" / "b" / "two.md", tree / "a" / "one.py"]
    files = expand_inputs([tree / "a"], exclude=["*/b/*"])
    assert [f.name for f in files] == ["empty.txt", "one.py"]


def test_missing_inputs(tree):
    with pytest.raises(CorpusError, match="no such file"):
        expand_inputs([tree / "nope.txt"])
    with pytest.raises(CorpusError, match="matches no files"):
        expand_inputs([str(tree / "*.zzz")])
    with pytest.raises(CorpusError, match="no input"):
        expand_inputs([])
    with pytest.raises(CorpusError, match="all excluded"):
        expand_inputs([tree / "a"], exclude=["*"])


def test_non_utf8_and_unreadable_files_name_the_file(tree):
    bad = tree / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin1\.txt: not UTF-8"):
        list(iter_documents([tree / "a", bad]))
    with pytest.raises(CorpusError, match=r"cannot read"):
        read_text(tree / "a")  # a directory cannot be read as a file
    skipped = []
    docs = list(iter_documents([bad, tree / "a" / "one.py"], skip_bad=True,
                               on_skip=skipped.append))
    assert _names(docs) == [str(tree / "a" / "one.py")]
    assert len(skipped) == 1 and "latin1.txt" in skipped[0]


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) if not isinstance(r, str) else r
                              for r in records) + "\n")
    return path


def test_jsonl_flavours(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", [
        {"text": "plain"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"turns": ["first", "second"]},
        {"question": "1+1?", "answer": "2"},
        "",
        {"text": ""},
    ])
    docs = list(iter_documents([f]))
    assert [d.text for d in docs] == ["plain", "hi\nyo", "first\nsecond", "1+1?\n2"]
    assert _names(docs) == [f"{f}:1", f"{f}:2", f"{f}:3", f"{f}:4"]


def test_jsonl_field_and_bad_records(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [{"body": "x", "text": "ignored"}, {"body": "y"}])
    assert [d.text for d in iter_documents([f], field="body")] == ["x", "y"]
    with pytest.raises(CorpusError, match=r"d\.jsonl:2: record has no field 'text'"):
        list(iter_documents([f], field="text"))
    g = _jsonl(tmp_path / "e.jsonl", [{"text": "ok"}, "{not json"])
    with pytest.raises(CorpusError, match=r"e\.jsonl:2: invalid JSON"):
        list(iter_documents([g]))
    h = _jsonl(tmp_path / "f.jsonl", [{"other": 1}])
    with pytest.raises(CorpusError, match=r"f\.jsonl:1: record has no 'text'"):
        list(iter_documents([h]))


def test_gsm8k_records_from_the_shared_layout(tmp_path):
    rec = {"question": "Natalia sold clips to 48 friends. How many?",
           "answer": "She sold 48/2 = 24 in May.\n#### 72"}
    f = _jsonl(tmp_path / "train.jsonl", [rec])
    (doc,) = iter_documents([f])
    assert doc.text == rec["question"] + "\n" + rec["answer"]
