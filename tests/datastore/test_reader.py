"""Reader verbs against the brute-force reference: random data, both token widths, shards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from redraft.datastore import InvalidQuery, Reader
from redraft.datastore.drafting import retrieval_tree


def _patterns(rng, docs, n, max_len=6, vocab=5):
    """Patterns that occur (cut from docs) and random ones (mostly absent)."""
    out = []
    for _ in range(n):
        d = docs[int(rng.integers(len(docs)))]
        L = int(rng.integers(1, max_len + 1))
        if len(d) >= L and rng.random() < 0.7:
            o = int(rng.integers(0, len(d) - L + 1))
            out.append(d[o:o + L])
        else:
            out.append(rng.integers(0, vocab, size=L).tolist())
    return out


@pytest.mark.parametrize("vocab,alphabet", [(5, None), (70000, [0, 1, 65534, 65535, 69999])],
                         ids=["uint16", "uint32"])
@pytest.mark.parametrize("shard_tokens", [10_000, 300], ids=["1shard", "shards"])
def test_verbs_match_brute_force(make_store, helpers, vocab, alphabet, shard_tokens):
    rng = np.random.default_rng(vocab + shard_tokens)
    docs = helpers.random_docs(rng, 40, vocab, alphabet=alphabet)
    path = make_store(docs, vocab=vocab, shard_tokens=shard_tokens)
    ref = helpers.Ref(docs)
    with Reader(path) as r:
        assert r.manifest["token_dtype"] == ("uint16" if vocab < 65536 else "uint32")
        assert (r.manifest["n_shards"] > 1) == (shard_tokens == 300)
        assert r.n_tokens == sum(map(len, docs)) and r.n_docs == len(docs)
        pats = _patterns(rng, docs, 60)
        if alphabet:
            pats = [[alphabet[t % len(alphabet)] for t in p] for p in pats]
        for pat in pats:
            assert r.count(pat) == ref.count(pat), pat
            assert r.next_token_counts(pat) == ref.next_counts(pat), pat
            assert r.find(pat, limit=10**6) == sorted(ref.occurrences(pat)), pat
            assert r.find(pat, limit=3) == sorted(ref.occurrences(pat))[:3]
        for _ in range(60):
            ctx = rng.choice(alphabet or np.arange(vocab), size=int(rng.integers(1, 20))).tolist()
            for max_len, min_len in [(16, 1), (4, 2), (20, 3)]:
                assert r.longest_match(ctx, max_len=max_len, min_len=min_len) == ref.longest(
                    ctx, max_len, min_len), (ctx, max_len, min_len)


def test_matches_never_cross_documents(make_store):
    docs = [[1, 2, 3], [4, 5, 6], [3, 4]]
    with Reader(make_store(docs)) as r:
        assert r.count([3, 4]) == 1  # only inside doc 2, not across doc 0 -> doc 1
        assert r.count([2, 3, 4]) == 0
        assert r.find([3, 4]) == [(2, 0)]
        assert r.next_token_counts([3]) == {4: 1}  # doc 0's final 3 is followed by nothing
        assert r.longest_match([1, 2, 3, 4, 5]) == 2  # [4, 5] in doc 1; [3, 4, 5] nowhere
        d = retrieval_tree(r, [7, 1, 2, 3], budget=10, min_support=1)
        assert d.match_len == 3 and len(d) == 0  # doc 0 ends after [1, 2, 3]: nothing follows


def test_corpus_filters_and_unknown_corpora(make_store, helpers, tmp_path):
    from redraft.datastore import append_corpus

    rng = np.random.default_rng(3)
    a = helpers.random_docs(rng, 15, 4)
    b = helpers.random_docs(rng, 15, 4)
    path = make_store(a, vocab=4, corpus="a")
    append_corpus(None, path, documents=b, fingerprint="test-vocab-4", corpus="b")
    ref = helpers.Ref(a + b, corpus_of=["a"] * 15 + ["b"] * 15)
    with Reader(path) as r:
        assert r.corpora == {"a": {"n_docs": 15, "n_tokens": sum(map(len, a))},
                             "b": {"n_docs": 15, "n_tokens": sum(map(len, b))}}
        for pat in _patterns(rng, a + b, 40, max_len=4, vocab=4):
            for corp in (None, ["a"], ["b"], "b", ["a", "b"]):
                c = [corp] if isinstance(corp, str) else corp
                assert r.count(pat, corpora=corp) == ref.count(pat, c)
                assert r.find(pat, corpora=corp) == sorted(ref.occurrences(pat, c))[:100]
                assert r.next_token_counts(pat, corpora=corp) == ref.next_counts(pat, c)
                assert r.longest_match(pat, corpora=corp) == ref.longest(pat, 16, 1, c)
                L, want = ref.propose_masses(pat, min_match_len=1, min_support=1,
                                             max_occurrences=10**6, corpora=c)
                d = retrieval_tree(r, pat, budget=10**4, min_match_len=1, min_support=1,
                              max_occurrences=10**6, corpora=corp)
                helpers.compare_tree(d, L, want, 10**4)
        with pytest.raises(InvalidQuery, match="unknown corpora"):
            r.count([1], corpora=["nope"])
        with pytest.raises(InvalidQuery, match="unknown corpora"):
            retrieval_tree(r, [1, 2], corpora="nope")


def test_deleted_documents_are_invisible_to_every_verb(make_store, helpers):
    from redraft.datastore import delete_documents

    rng = np.random.default_rng(11)
    docs = helpers.random_docs(rng, 40, 4)
    path = make_store(docs, vocab=4, shard_tokens=400)
    gone = [0, 3, 4, 17, 39]
    m = delete_documents(path, gone)
    assert m["n_deleted"] == 5 and m["n_docs"] == 35
    assert m["n_tokens"] == sum(len(d) for i, d in enumerate(docs) if i not in gone)
    ref = helpers.Ref(docs, deleted=gone)
    with Reader(path) as r:
        assert r.n_docs == 35
        for pat in _patterns(rng, docs, 60, max_len=5, vocab=4):
            assert r.count(pat) == ref.count(pat)
            assert r.find(pat, limit=10**6) == sorted(ref.occurrences(pat))
            assert r.next_token_counts(pat) == ref.next_counts(pat)
            assert r.longest_match(pat) == ref.longest(pat)
            L, want = ref.propose_masses(pat, min_match_len=1, min_support=1,
                                         max_occurrences=10**6)
            d = retrieval_tree(r, pat, budget=10**4, min_match_len=1, min_support=1,
                          max_occurrences=10**6)
            helpers.compare_tree(d, L, want, 10**4)
        # a pattern unique to a deleted document is gone everywhere
        only = docs[3] + [3, 3, 3, 2, 1]
        assert r.count(docs[3]) == ref.count(docs[3])
        assert all(doc != 3 for doc, _ in r.find(docs[3]))
        assert r.longest_match(only) == ref.longest(only)


def _contexts(rng, docs, n):
    """Contexts cut from the documents (deleted ones too) and a few random ones."""
    out = []
    for _ in range(n):
        d = docs[int(rng.integers(len(docs)))]
        end = int(rng.integers(1, len(d) + 1))
        ctx = d[max(0, end - int(rng.integers(1, 20))):end]
        if rng.random() < 0.1:
            ctx = rng.integers(0, 6, size=len(ctx)).tolist()
        out.append(ctx)
    return out


def test_deleted_documents_have_no_influence(make_store, helpers):
    """A datastore with documents deleted answers exactly as one built from the documents
    left: same trees (support counts and the shorter-suffix fallback included), counts and
    next-token counts, on thousands of contexts, sampled or not."""
    from redraft.datastore import delete_documents

    rng = np.random.default_rng(21)
    docs = helpers.random_docs(rng, 80, 6, max_len=120)
    docs[1] = docs[1] + [5, 5, 5, 4, 4, 4, 3, 3, 3]  # a rare tail only deleted docs hold
    docs[2] = docs[2] + [5, 5, 5, 4, 4, 4, 3, 3, 3]
    deleted = make_store(docs, vocab=6)
    delete_documents(deleted, [1, 2])
    rebuilt = make_store([d for i, d in enumerate(docs) if i not in (1, 2)], vocab=6)
    variants = [{}, {"min_match_len": 1, "max_occurrences": 40},
                {"min_support": 60, "max_depth": 6}, {"min_support": 2, "budget": 8}]
    with Reader(deleted, verify=True) as a, Reader(rebuilt) as b:
        assert a.n_docs == b.n_docs and a.n_tokens == b.n_tokens
        for ctx in _contexts(rng, docs, 3000):
            for kw in variants:
                assert retrieval_tree(a, ctx, **kw) == retrieval_tree(b, ctx, **kw), (ctx, kw)
            tail = ctx[-3:]
            assert a.count(tail) == b.count(tail) and a.longest_match(ctx) == b.longest_match(ctx)
            assert a.next_token_counts(tail) == b.next_token_counts(tail), tail
        assert a.count([5, 5, 5, 4, 4, 4, 3, 3, 3]) == 0


def test_deleted_documents_are_gone_from_every_shard_and_the_file(make_store, helpers, files):
    from redraft.datastore import delete_documents

    rng = np.random.default_rng(22)
    docs = helpers.random_docs(rng, 60, 6, max_len=60)
    secret = list(range(900, 1000))  # ids no other document holds
    docs[7] = docs[7] + secret
    path = make_store(docs, vocab=1000, shard_tokens=300)
    delete_documents(path, [7, 30, 31])
    live = [d for i, d in enumerate(docs) if i not in (7, 30, 31)]
    ref = helpers.Ref(live)
    with Reader(path, verify=True) as r:
        assert r.manifest["n_shards"] > 3
        assert r.n_tokens == sum(map(len, live)) and r.doc_name(7) == "doc7"
        for ctx in _contexts(rng, docs, 300):
            tail = ctx[-3:]
            assert r.count(tail) == ref.count(tail)
            assert r.next_token_counts(tail) == ref.next_counts(tail)
            assert r.longest_match(ctx) == ref.longest(ctx)
        assert r.count(secret[:2]) == 0
    raw = b"".join(files.directory_bytes(path).values())  # every file, not only the named
    assert np.array(secret[:4], ">u2").tobytes() not in raw  # no stale copy in free pages


def test_delete_validates_ids(make_store):
    from redraft.datastore import delete_documents

    path = make_store([[1, 2], [2, 3]])
    with pytest.raises(InvalidQuery, match="out of range"):
        delete_documents(path, [2])
    delete_documents(path, [1])
    delete_documents(path, [1])  # idempotent
    with Reader(path) as r:
        assert r.n_docs == 1 and r.count([2]) == 1


def test_bad_queries_raise_invalid_query(make_store):
    with Reader(make_store([[1, 2, 3]], vocab=8)) as r:
        for bad in ([1, 8], [-1, 2], [1.5, 2.0], [[1, 2]], ["a"], [2**70]):
            with pytest.raises(InvalidQuery):
                retrieval_tree(r, bad)
            with pytest.raises(InvalidQuery):
                r.count(bad)
        with pytest.raises(InvalidQuery, match="token id 99 is out of range"):
            r.longest_match([0, 99])
        with pytest.raises(InvalidQuery, match=f"token id {10**23} is out of range"):
            r.count([1, 10**23])
        with pytest.raises(InvalidQuery, match="empty"):
            r.count([])
        with pytest.raises(InvalidQuery):
            retrieval_tree(r, [1, 2], min_match_len=3, max_match_len=2)
        with pytest.raises(InvalidQuery):
            retrieval_tree(r, [1, 2], max_depth=0)
        assert retrieval_tree(r, []).tokens == []
        assert retrieval_tree(r, [1, 2], budget=0).tokens == []
        assert retrieval_tree(r, np.array([1, 2], dtype=np.uint32), min_support=1).tokens == [3]


def test_concurrent_threads_get_the_serial_answers(make_store, helpers):
    rng = np.random.default_rng(5)
    docs = helpers.random_docs(rng, 200, 6, max_len=200)
    ctxs = [rng.integers(0, 6, size=12).tolist() for _ in range(300)]
    with Reader(make_store(docs, vocab=6, shard_tokens=5000)) as r:
        serial = [retrieval_tree(r, c, budget=32) for c in ctxs]
        with ThreadPoolExecutor(8) as ex:
            parallel = list(ex.map(lambda c: retrieval_tree(r, c, budget=32), ctxs * 3))
    assert parallel == serial * 3


def test_a_closed_reader_refuses_every_verb_with_one_clear_error(make_store):
    from redraft.datastore import ReaderClosed

    path = make_store([[1, 2, 3], [2, 3, 4]])
    r = Reader(path)
    query = r.suffixes([1, 2])
    match = query.longest(1)
    r.close()
    r.close()  # closing twice is fine
    verbs = {
        "count": lambda: r.count([1]), "find": lambda: r.find([1]),
        "next_token_counts": lambda: r.next_token_counts([1]),
        "longest_match": lambda: r.longest_match([1, 2]), "suffixes": lambda: r.suffixes([1]),
        "doc_name": lambda: r.doc_name(0), "documents": lambda: r.documents("default"),
        "verify": r.verify, "shard_raw": lambda: r.shard_raw(0, "tokens"),
        "shard_documents": lambda: r.shard_documents(0), "shard_names": lambda: r.shard_names(0),
        "check_ids": lambda: r.check_ids([1]),
        "check_tokenizer": lambda: r.check_tokenizer(r.tokenizer_fingerprint),
        "query.longest": lambda: query.longest(1),
        "query.occurrences": lambda: query.occurrences(2),
        "query.continuations": lambda: query.continuations(match, 4, 2),
    }
    for name, verb in verbs.items():
        with pytest.raises(ReaderClosed, match=r"the Reader is closed$"):
            verb()
            pytest.fail(f"{name} answered on a closed Reader")
    with pytest.raises(ReaderClosed, match="the Reader is closed; open a new one"):
        with r:
            pass
    with Reader(path) as again:  # a new Reader on the same path is unaffected
        assert again.count([2, 3]) == 2
