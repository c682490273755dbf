"""Shared by the compiled core's tests: real datastores of both token widths, several shards,
two corpora, a learned corpus and deleted documents; and the tree comparison."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from redraft.datastore import append_corpus, build_datastore, delete_documents, tiers


def same_tree(want, got) -> None:
    """Node for node: tokens, parents, probs to the bit, sources, match length."""
    assert got.tokens == want.tokens
    assert got.parents == want.parents
    assert [p.hex() for p in got.probs] == [p.hex() for p in want.probs]
    assert got.sources == want.sources
    assert got.match_len == want.match_len


def phrase_docs(rng: random.Random, alphabet: list[int], n_docs: int, n_phrases: int = 12,
                phrase_len: tuple[int, int] = (2, 7), doc_phrases: tuple[int, int] = (3, 14),
                noise: float = 0.15) -> list[list[int]]:
    """Documents made of recurring phrases with some noise: long matches, many occurrences,
    rare ones, and continuations that disagree."""
    phrases = [[rng.choice(alphabet) for _ in range(rng.randint(*phrase_len))]
               for _ in range(n_phrases)]
    docs = []
    for _ in range(n_docs):
        doc: list[int] = []
        for _ in range(rng.randint(*doc_phrases)):
            doc += rng.choice(phrases)
            if rng.random() < noise:
                doc.append(rng.choice(alphabet))
        docs.append(doc)
    return docs


def make_datastore(path, rng: random.Random, vocab: int, alphabet: list[int],
                   shard_tokens: int) -> SimpleNamespace:
    """Corpora `a` (built, two segments) and `b` (appended), a `learned` corpus, some deleted
    documents: several segments of several shards each (the merge policy's floor lowered so
    that these small segments stay apart, as big ones do)."""
    fp = f"native-test-{vocab}"
    docs_a = phrase_docs(rng, alphabet, 60)
    docs_b = phrase_docs(rng, alphabet, 40)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiers, "FLOOR_TOKENS", 64)
        build_datastore(None, path, documents=docs_a, fingerprint=fp, vocab_size=vocab,
                        corpus="a", shard_tokens=shard_tokens,
                        segment_tokens=sum(map(len, docs_a)) // 2 + 10)
        append_corpus(None, path, documents=docs_b, fingerprint=fp, corpus="b",
                      shard_tokens=shard_tokens)
        learned = phrase_docs(rng, alphabet, 5)
        append_corpus(None, path, documents=[(f"learned:{i}", d) for i, d in enumerate(learned)],
                      fingerprint=fp, corpus="learned", shard_tokens=shard_tokens)
        deleted = sorted(rng.sample(range(len(docs_a) + len(docs_b)), 12))
        delete_documents(path, deleted)
    return SimpleNamespace(path=path, docs=docs_a + docs_b, vocab=vocab, alphabet=alphabet,
                           deleted=deleted)


class RecordingJournal:
    """An OutputJournal (learned_index.OutputJournal) that keeps what it is told, in order: two
    indexes given the same writes must tell their journals the same."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._next = 0

    def begin(self, tenant: str) -> int:
        self._next += 1
        self.events.append(("begin", self._next, tenant))
        return self._next

    def append(self, output: int, tokens) -> None:
        self.events.append(("append", output, [int(t) for t in tokens]))

    def end(self, output: int) -> None:
        self.events.append(("end", output))


@pytest.fixture(scope="session")
def narrow_store(tmp_path_factory):
    """uint16 tokens, several shards."""
    rng = random.Random(5)
    return make_datastore(tmp_path_factory.mktemp("native") / "narrow", rng, 300,
                          list(range(1, 120)), shard_tokens=700)


@pytest.fixture(scope="session")
def wide_store(tmp_path_factory):
    """uint32 tokens (a vocabulary over 65,535), ids spread over the whole range."""
    rng = random.Random(6)
    alphabet = sorted(rng.sample(range(70_000), 110)) + [69_999, 65_536, 65_535, 256]
    return make_datastore(tmp_path_factory.mktemp("native") / "wide", rng, 70_000, alphabet,
                          shard_tokens=900)


@pytest.fixture
def same():
    return same_tree


@pytest.fixture
def journals():
    """Two recording journals, one for each implementation under comparison."""
    return RecordingJournal(), RecordingJournal()
