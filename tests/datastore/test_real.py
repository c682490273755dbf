"""The real default tokenizer and real text: Python standard-library modules."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
from redraft.datastore import Reader, TokenizerMismatch, append_corpus, build_datastore
from redraft.datastore.drafting import retrieval_tree
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint

STDLIB = Path(sysconfig.get_paths()["stdlib"])
INDEXED = ["bisect.py", "colorsys.py", "keyword.py", "heapq.py"]
HELD_OUT = "queue.py"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def real_store(tmp_path_factory, tok):
    out = tmp_path_factory.mktemp("real") / "ds"
    build_datastore([STDLIB / f for f in INDEXED], out, tokenizer="smollm2-135m",
                    corpus="stdlib")
    docs = [tok((STDLIB / f).read_text(), add_special_tokens=False)["input_ids"]
            for f in INDEXED]
    return out, docs


def test_manifest_records_the_tokenizer(real_store, tok):
    out, docs = real_store
    with Reader(out, verify=True) as r:
        assert r.tokenizer_fingerprint == tokenizer_fingerprint(tok)
        assert r.tokenizer_name == "smollm2-135m" and r.vocab_size == 49152
        assert r.manifest["token_dtype"] == "uint16"
        assert r.n_tokens == sum(map(len, docs)) and r.n_docs == len(INDEXED)
        assert [Path(r.doc_name(i)).name for i in range(4)] == INDEXED
        r.check_tokenizer(tok)
        with pytest.raises(TokenizerMismatch, match="does not match"):
            r.check_tokenizer("sha256:0000")


def test_fingerprint_follows_the_vocabulary(tok):
    import copy

    more = copy.deepcopy(tok)
    assert tokenizer_fingerprint(more) == tokenizer_fingerprint(tok)
    more.add_tokens(["<redraft-test-token>"])
    assert tokenizer_fingerprint(more) != tokenizer_fingerprint(tok)


def test_real_sequences_match_brute_force(real_store, tok, helpers):
    out, docs = real_store
    ref = helpers.Ref(docs)
    rng = np.random.default_rng(0)
    held = tok((STDLIB / HELD_OUT).read_text(), add_special_tokens=False)["input_ids"]
    contexts = []
    for source in (held, docs[3], docs[0]):
        for p in rng.integers(16, len(source), size=8):
            contexts.append(source[p - 16:p])
    with Reader(out) as r:
        hits = 0
        for ctx in contexts:
            assert r.longest_match(ctx, max_len=16, min_len=1) == ref.longest(ctx, 16, 1)
            L, want = ref.propose_masses(ctx, max_occurrences=10**6, min_support=4)
            d = retrieval_tree(r, ctx, budget=10**5, max_occurrences=10**6, min_support=4)
            d.validate()
            assert d.match_len == L
            assert helpers.draft_paths(d) == pytest.approx(want, rel=1e-9)
            hits += bool(want)
            tail = ctx[-3:]
            assert r.count(tail) == ref.count(tail)
            assert r.next_token_counts(tail) == ref.next_counts(tail)
        assert hits >= 10


def test_append_refuses_another_tokenizer(tmp_path):
    out = tmp_path / "ds"
    # a datastore that claims the default model's name but holds another vocabulary
    build_datastore(None, out, tokenizer="smollm2-135m", documents=[[1, 2, 3]],
                    fingerprint="sha256:another", vocab_size=49152)
    src = tmp_path / "x.txt"
    src.write_text("def f(): pass\n")
    with pytest.raises(TokenizerMismatch, match="does not match the datastore's"):
        append_corpus([src], out, corpus="more")
    with Reader(out) as r:
        assert r.n_docs == 1
