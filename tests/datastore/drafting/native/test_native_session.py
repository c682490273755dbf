"""The compiled session drafter against the Python one (the reference): identical trees, match
lengths and errors, step after step, on real datastores of both token widths."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import pytest
from redraft.datastore import Reader, build_datastore
from redraft.datastore.drafting.learned_index import LearnedIndex
from redraft.datastore.drafting.native import NativeLearnedIndex, NativeSessionDrafter
from redraft.datastore.drafting.session_drafter import DEFAULT_PARAMS, DraftSettings, SessionDrafter
from redraft.proto.errors import DatastoreCorrupt, DatastoreError, InvalidQuery
from redraft.proto.tree import LEARNED, PLD, REST

ALL = frozenset({REST, PLD, LEARNED})

SETTINGS = {
    "default": DraftSettings(),
    "small": DraftSettings(DEFAULT_PARAMS.replace(budget=8, max_depth=4), rest_max_occurrences=3),
    "large": DraftSettings(DEFAULT_PARAMS.replace(budget=200, max_depth=40),
                           rest_max_occurrences=256, rest_calibration=(1.0, 1.0)),
    "match-3-5": DraftSettings(DEFAULT_PARAMS.replace(min_match_len=3, max_match_len=5)),
    "match-1": DraftSettings(DEFAULT_PARAMS.replace(max_match_len=1)),
    "rest-1-32": DraftSettings(DEFAULT_PARAMS.replace(budget=32), rest_min_match=1,
                               rest_max_match=32, rest_calibration=(0.3, 2.0)),
    "corpus-a": DraftSettings(DEFAULT_PARAMS.replace(corpora=("a",))),
    "corpora-b-a": DraftSettings(DEFAULT_PARAMS.replace(corpora=("b", "a"), budget=24,
                                                        max_depth=8)),
    "rest-only": DraftSettings(DEFAULT_PARAMS.replace(sources=frozenset({REST})),
                               rest_max_occurrences=5),
    "pld-only": DraftSettings(DEFAULT_PARAMS.replace(sources=frozenset({PLD}), max_depth=24)),
    "learned-only": DraftSettings(DEFAULT_PARAMS.replace(sources=frozenset({LEARNED}),
                                                         budget=16)),
    "rest-learned": DraftSettings(DEFAULT_PARAMS.replace(sources=frozenset({REST, LEARNED}),
                                                         max_depth=1)),
    # probabilities above 1: a child can outrank its parent (the reference then drops it)
    "over-confident": DraftSettings(rest_calibration=(2.5, 0.5)),
}
LEARNED_CORPUS_ONLY = DEFAULT_PARAMS.replace(corpora=("learned",))
BUDGETS = (None, None, None, 0, 1, 3, 16, 64)


def prompt_and_source(rng: random.Random, store) -> tuple[list[int], list[int]]:
    """A prompt and the tokens that follow it: from a document (deleted ones included), a
    repetitive sequence (prompt lookup's case), random ids, or nothing."""
    kind = rng.random()
    if kind < 0.6:
        doc = rng.choice(store.docs)
        cut = rng.randrange(len(doc))
        head = doc[max(0, cut - rng.randint(0, 40)):cut]
        tail = doc[cut:] + rng.choice(store.docs)
        return head, tail
    if kind < 0.8:
        phrase = [rng.choice(store.alphabet) for _ in range(rng.randint(1, 6))]
        seq = phrase * 30
        return seq[:rng.randint(0, 20)], seq[20:] + [rng.choice(store.alphabet)] + seq
    if kind < 0.95:
        seq = [rng.choice(store.alphabet) for _ in range(120)]
        return seq[:rng.randint(1, 30)], seq[30:]
    return [], rng.choice(store.docs) * 2


def accepted_tokens(rng: random.Random, source: list[int], store) -> list[int]:
    """The next 1-4 tokens, sometimes with one the corpus does not predict."""
    k = rng.randint(1, 4)
    out = [source.pop(0) if source else rng.choice(store.alphabet) for _ in range(k)]
    if rng.random() < 0.1:
        out[-1] = rng.choice(store.alphabet)
    return out


def replay(reader, store, settings, rng, same, *, sessions=20, steps=40, learned=None,
           tenants=("", "t1", "t2")) -> int:
    """Runs the same sessions through both drafters and compares every step; returns the
    number of non-empty trees compared."""
    py_learned, native_learned = learned or (None, None)
    drafted = 0
    for _ in range(sessions):
        tenant = rng.choice(tenants)
        prompt, source = prompt_and_source(rng, store)
        a = SessionDrafter(prompt, settings, reader, py_learned, tenant)
        b = NativeSessionDrafter(prompt, settings, reader, native_learned, tenant)
        accepted: list[int] = []
        for _ in range(steps):
            budget = rng.choice(BUDGETS)
            a.extend(accepted)
            want = a.propose(budget)
            if rng.random() < 0.5:  # extend and propose in one call, or in two
                got = b.step(accepted, budget)
            else:
                b.extend(accepted)
                got = b.propose(budget)
            same(want, got)
            assert (b.rest_match_len, b.pld_match_len, b.learned_match_len) == \
                (a.rest_match_len, a.pld_match_len, a.learned_match_len)
            drafted += len(want) > 0
            accepted = accepted_tokens(rng, source, store)
        assert b.context == a.context
        if rng.random() < 0.8:  # some generations are never closed
            a.close()
            b.close()
    return drafted


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("width", ["narrow", "wide"])
def test_trees_are_identical(request, width, name, same, journals):
    store = request.getfixturevalue(f"{width}_store")
    rng = random.Random(f"{width}-{name}")
    learned = (LearnedIndex(max_tokens=600, journal=journals[0]),
               NativeLearnedIndex(max_tokens=600, journal=journals[1]))
    with Reader(store.path) as reader:
        assert reader.token_width == (2 if width == "narrow" else 4)
        assert len(reader.shard_arrays()) >= 6 and len(reader.segments) >= 4
        assert reader.deleted
        drafted = replay(reader, store, SETTINGS[name], rng, same, learned=learned)
    assert drafted > 60  # the comparison saw real trees
    assert learned[1].stats() == learned[0].stats()
    assert journals[1].events == journals[0].events


def test_learned_outputs_shared_by_every_tenant_and_evicted_early(narrow_store, same, journals):
    rng = random.Random(3)
    learned = (LearnedIndex(max_tokens=150, shared=True, journal=journals[0]),
               NativeLearnedIndex(max_tokens=150, shared=True, journal=journals[1]))
    with Reader(narrow_store.path) as reader:
        replay(reader, narrow_store, DraftSettings(DEFAULT_PARAMS.replace(budget=32)), rng, same,
               sessions=25, steps=25, learned=learned, tenants=("x", "y"))
    assert learned[1].stats() == learned[0].stats()
    assert journals[1].events == journals[0].events and journals[0].events


def test_without_a_reader_or_a_learned_index(narrow_store, same):
    rng = random.Random(4)
    replay(None, narrow_store, DraftSettings(), rng, same, sessions=8)


def test_sessions_interleaved_share_the_learned_index(narrow_store, same):
    """Steps of several open sessions alternate, as on a server: each learns at once what
    the others then draft."""
    rng = random.Random(8)
    py, native = LearnedIndex(max_tokens=2000), NativeLearnedIndex(max_tokens=2000)
    s = DraftSettings(DEFAULT_PARAMS.replace(budget=24, max_depth=8))
    with Reader(narrow_store.path) as reader:
        pairs = []
        for i in range(6):
            prompt, source = prompt_and_source(rng, narrow_store)
            tenant = "t" if i % 2 else "u"
            pairs.append((SessionDrafter(prompt, s, reader, py, tenant),
                          NativeSessionDrafter(prompt, s, reader, native, tenant), source))
        for _ in range(200):
            a, b, source = rng.choice(pairs)
            accepted = accepted_tokens(rng, source, narrow_store)
            a.extend(accepted)
            b.extend(accepted)
            same(a.propose(), b.propose())
    assert native.stats() == py.stats()


def test_standard_library_text_with_the_real_tokenizer(tmp_path, same):
    """Real code: a datastore of standard-library modules, drafted for this project's own
    sources (held out), with the default tokenizer."""
    from redraft.proto.models import load_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("[a-m]*.py"))[:40]
    build_datastore(files, tmp_path / "ds", tokenizer="smollm2-135m", corpus="stdlib")
    tok = load_tokenizer("smollm2-135m")
    root = Path(__file__).resolve().parents[4]
    held_out = [ids for p in sorted((root / "datastore").glob("*.py"))
                if len(ids := tok(p.read_text(), add_special_tokens=False)["input_ids"]) > 400]
    rng = random.Random(9)
    settings = DraftSettings()
    py, native = LearnedIndex(), NativeLearnedIndex()
    drafted = 0
    with Reader(tmp_path / "ds") as reader:
        for _ in range(10):
            doc = rng.choice(held_out)
            pos = rng.randrange(64, len(doc) - 200)
            a = SessionDrafter(doc[pos - 64:pos], settings, reader, py, "t")
            b = NativeSessionDrafter(doc[pos - 64:pos], settings, reader, native, "t")
            for _ in range(50):
                k = rng.randint(1, 4)
                a.extend(doc[pos:pos + k])
                b.extend(doc[pos:pos + k])
                pos += k
                want = a.propose()
                same(want, b.propose())
                drafted += a.rest_match_len > 0
            a.close()
            b.close()
    assert drafted > 200


# ---- errors: the reference's exception, and the session goes on -----------------------

def both(reader, settings, prompt, learned=True):
    pair = (LearnedIndex(), NativeLearnedIndex()) if learned else (None, None)
    return (SessionDrafter(prompt, settings, reader, pair[0], "t"),
            NativeSessionDrafter(prompt, settings, reader, pair[1], "t"))


def raises_alike(call_a, call_b):
    with pytest.raises(DatastoreError) as want:
        call_a()
    with pytest.raises(type(want.value)) as got:
        call_b()
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("settings, budget", [
    (DraftSettings(), -1),
    (DraftSettings(DEFAULT_PARAMS.replace(max_depth=2000)), None),
    (DraftSettings(DEFAULT_PARAMS.replace(max_depth=0)), None),
    (DraftSettings(rest_max_occurrences=0), None),
    (DraftSettings(DEFAULT_PARAMS.replace(corpora=("nope",))), None),
    (DraftSettings(DEFAULT_PARAMS.replace(corpora=("a", "nope"))), None),
])
def test_refused_settings_raise_what_the_reference_raises(narrow_store, same, settings,
                                                          budget):
    prompt = narrow_store.docs[0][:10]
    with Reader(narrow_store.path) as reader:
        a, b = both(reader, settings, prompt)
        raises_alike(lambda: a.propose(budget), lambda: b.propose(budget))
        assert (b.rest_match_len, b.pld_match_len) == (0, 0)


def test_ids_outside_the_vocabulary_fail_the_step_only(narrow_store, same):
    vocab = narrow_store.vocab
    with Reader(narrow_store.path) as reader:
        a, b = both(reader, DraftSettings(), narrow_store.docs[1][:10] + [vocab])
        raises_alike(a.propose, b.propose)
        for t in ([vocab + 7], sum(narrow_store.docs[1:4], [])[:30]):
            a.extend(t)
            b.extend(t)
            if t[0] >= vocab:
                raises_alike(a.propose, b.propose)
        same(a.propose(), b.propose())  # the bad id has left the matched tail
    with pytest.raises(ValueError, match="outside"):
        b.extend([-1])
    with pytest.raises(ValueError, match="outside"):
        b.extend([2**32])


def test_the_learned_corpus_is_refused_as_by_the_reference(narrow_store):
    with Reader(narrow_store.path) as reader:
        with pytest.raises(InvalidQuery) as want:
            SessionDrafter([1, 2], DraftSettings(LEARNED_CORPUS_ONLY), reader)
        with pytest.raises(InvalidQuery) as got:
            NativeSessionDrafter([1, 2], DraftSettings(LEARNED_CORPUS_ONLY), reader)
    assert str(got.value) == str(want.value)


def test_a_closed_reader_refuses_as_the_reference_does(narrow_store, same):
    reader = Reader(narrow_store.path)
    a, b = both(reader, DraftSettings(), narrow_store.docs[2][:12])
    same(a.propose(), b.propose())
    reader.close()
    raises_alike(a.propose, b.propose)
    empty_a, empty_b = both(reader, DraftSettings(), [])  # no retrieval: no error
    same(empty_a.propose(), empty_b.propose())


def test_a_python_learned_index_is_refused(narrow_store):
    with pytest.raises(TypeError, match="NativeLearnedIndex"):
        NativeSessionDrafter([1, 2], DraftSettings(), None, LearnedIndex())


def test_token_arrays_are_read_as_lists_are(narrow_store, same):
    import numpy as np

    doc = sum(narrow_store.docs[:3], [])
    s = DraftSettings()
    with Reader(narrow_store.path) as reader:
        a = NativeSessionDrafter(doc[:20], s, reader, NativeLearnedIndex())
        b = NativeSessionDrafter(np.asarray(doc[:20], np.int64), s, reader, NativeLearnedIndex())
        for i, dtype in enumerate([np.int32, np.uint16, np.uint32, np.int64, np.uint64, np.int8]):
            chunk = doc[20 + 3 * i:23 + 3 * i]
            a.extend(chunk)
            same(a.propose(), b.step(np.asarray(chunk, dtype)))
        assert b.context == a.context
        with pytest.raises(TypeError, match="integers"):
            b.extend(np.asarray([1.5, 2.0]))
        with pytest.raises(ValueError, match="outside"):
            b.extend(np.asarray([-1], np.int64))
        assert b.context == a.context


def test_a_newer_snapshot_swapped_in_between_steps(tmp_path, narrow_store, same):
    """A server following its datastore's commits swaps the Reader between two steps: a
    new corpus and deletions in the next snapshot, and both drafters follow alike."""
    import shutil

    from redraft.datastore import append_corpus, delete_documents

    path = tmp_path / "ds"
    shutil.copytree(narrow_store.path, path)
    rng = random.Random(21)
    s = DraftSettings()
    first = Reader(path)
    pairs = []
    for _ in range(6):
        prompt, source = prompt_and_source(rng, narrow_store)
        pairs.append((SessionDrafter(prompt, s, first), NativeSessionDrafter(prompt, s, first),
                      source))
    for a, b, _ in pairs:
        same(a.propose(), b.propose())
    extra = [[rng.choice(narrow_store.alphabet) for _ in range(30)] * 2 for _ in range(20)]
    append_corpus(None, path, documents=extra, fingerprint="native-test-300", corpus="c",
                  shard_tokens=700)
    delete_documents(path, [0, 1, 2, 3])
    second = Reader(path)
    assert set(second.segments) != set(first.segments)
    for step in range(30):
        for a, b, source in pairs:
            if step == 5:
                a.use_reader(second)
                b.use_reader(second)
            if step == 6:
                first.close()  # the old snapshot retired: the sessions read the new one
            accepted = accepted_tokens(rng, source, narrow_store)
            a.extend(accepted)
            b.extend(accepted)
            same(a.propose(), b.propose())
    second.close()


def test_the_implementation_is_chosen_by_setting(narrow_store, monkeypatch):
    from redraft.datastore import drafting

    with Reader(narrow_store.path) as reader:
        monkeypatch.setenv(drafting.DRAFTING_ENV, "python")
        assert type(drafting.new_learned_index(10)) is LearnedIndex
        assert type(drafting.new_session_drafter([1], DraftSettings(), reader)) is SessionDrafter
        monkeypatch.setenv(drafting.DRAFTING_ENV, "native")
        index = drafting.new_learned_index(10)
        assert type(index) is NativeLearnedIndex
        assert type(drafting.new_session_drafter([1], DraftSettings(), reader)) is \
            NativeSessionDrafter
        # a session follows the kind of its learned index, whatever the setting
        monkeypatch.setenv(drafting.DRAFTING_ENV, "python")
        assert type(drafting.new_session_drafter([1], DraftSettings(), reader, index)) is \
            NativeSessionDrafter
        # auto (a server's default) follows the environment; an explicit choice does not
        assert type(drafting.new_learned_index(10, choice="auto")) is LearnedIndex
        assert type(drafting.new_learned_index(10, choice="native")) is NativeLearnedIndex
        monkeypatch.setenv(drafting.DRAFTING_ENV, "fast")
        with pytest.raises(ValueError, match="REDRAFT_DRAFTING"):
            drafting.new_learned_index(10)


def test_damage_only_the_core_reads_is_datastore_corrupt_not_a_runtime_error(
        core_only_damage):
    """Before: RuntimeError ("the compiled core refused a step ... that the reference
    drafts"), which the service passed on as UNKNOWN, never marking the datastore damaged."""
    path, docs, i = core_only_damage
    settings = DraftSettings(DEFAULT_PARAMS.replace(budget=16, max_depth=16,
                                                    sources=frozenset({REST})))
    with Reader(path) as r:
        with pytest.raises(DatastoreCorrupt, match="damaged token arrays"):
            NativeSessionDrafter(docs[i][:28], settings, r).propose()
        SessionDrafter(docs[i][:28], settings, r).propose()  # the reference reads no damage
