"""The session drafter: its sources computed independently, and the learned corpus kept out
of retrieval."""

from __future__ import annotations

import random

import pytest
from redraft.datastore import Reader, append_corpus, build_datastore
from redraft.datastore.drafting import REST_CALIBRATION, calibrate, retrieval_tree
from redraft.datastore.drafting.learned_index import PROMPT_TAIL, LearnedIndex
from redraft.datastore.drafting.prompt_lookup import PromptLookup
from redraft.datastore.drafting.session_drafter import DEFAULT_PARAMS, DraftSettings, SessionDrafter
from redraft.proto.errors import InvalidQuery
from redraft.proto.tree import merge

FP = "sha256:session-test"
VOCAB = 400
RNG = random.Random(11)
PHRASES = [[RNG.randrange(1, 200) for _ in range(RNG.randrange(3, 8))] for _ in range(10)]
DOCS = [sum((RNG.choice(PHRASES) for _ in range(12)), []) for _ in range(25)]
SECRET = [RNG.randrange(200, VOCAB) for _ in range(60)]  # only in the corpus "learned"


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    path = tmp_path_factory.mktemp("session") / "ds"
    build_datastore(None, path, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    append_corpus(None, path, documents=[("learned:x", SECRET)], fingerprint=FP,
                  corpus="learned")
    with Reader(path) as r:
        yield r


def test_drafts_equal_the_sources_merged_independently(reader):
    settings = DraftSettings(DEFAULT_PARAMS.replace(budget=24, max_depth=8))
    learned = LearnedIndex()
    earlier = DOCS[3][:40]
    w = learned.writer("t", earlier[:10])
    w.extend(earlier[10:])
    w.close()
    doc = DOCS[3]
    prompt, rest = doc[:10], doc[10:60]
    s = SessionDrafter(prompt, settings, reader, learned, "t")
    pl = PromptLookup()
    pl.extend(prompt)
    ctx = list(prompt)
    learned_hits = 0
    while rest:
        k = RNG.randrange(1, 4)
        accepted, rest = rest[:k], rest[k:]
        budget = RNG.choice([4, 24])
        before = learned.propose("t", ctx + accepted, budget, 8)  # before this session's step
        s.extend(accepted)
        ctx += accepted
        pl.extend(accepted)
        got = s.propose(budget)
        want = merge([
            calibrate(retrieval_tree(reader, ctx[-16:], budget=budget, max_depth=8,
                                     max_occurrences=64, corpora=["c"]), *REST_CALIBRATION),
            pl.propose(budget, 8),
            learned.propose("t", ctx, budget, 8),
        ], budget)
        assert (got.tokens, got.parents, got.sources) == (want.tokens, want.parents,
                                                          want.sources)
        assert got.probs == pytest.approx(want.probs)
        learned_hits += len(before) > 0 and "learned" in "+".join(got.sources)
    assert learned_hits > 3
    s.close()
    # this session's own output was learned as it went
    assert learned.stats()["learned_docs"] == 2


def test_retrieval_never_reads_the_learned_corpus(reader):
    s = SessionDrafter(SECRET[:20],
                       DraftSettings(DEFAULT_PARAMS.replace(sources=frozenset({"rest"}))), reader)
    for i in range(20, 50, 3):
        s.extend(SECRET[i:i + 3])
        assert len(s.propose()) == 0
    assert len(retrieval_tree(reader, SECRET[:20], corpora=["learned"])) > 0  # it is there
    with pytest.raises(InvalidQuery, match="learned"):
        SessionDrafter([1, 2], DraftSettings(DEFAULT_PARAMS.replace(corpora=("learned",))), reader)


def test_sources_not_asked_for_are_not_drafted(reader):
    learned = LearnedIndex()
    w = learned.writer("", [1])
    w.extend(DOCS[0])
    s = SessionDrafter(DOCS[0][:20],
                       DraftSettings(DEFAULT_PARAMS.replace(sources=frozenset({"pld"}))), reader,
                       learned)
    assert set(s.propose().sources) <= {"pld"}
    s.extend(DOCS[0][20:25])  # still learned, though not drafted from
    assert learned.n_tokens == 1 + len(DOCS[0]) + PROMPT_TAIL + 5  # + its prompt's tail
