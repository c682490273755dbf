"""The batched step: many sessions extended, then drafted, in one call (on one thread or
several), each tree identical to the Python reference's after the same extensions; a
failing sequence fails alone."""

from __future__ import annotations

import random

import numpy as np
import pytest
from redraft.datastore import Reader
from redraft.datastore.drafting import step_batch, step_flat
from redraft.datastore.drafting.learned_index import LearnedIndex
from redraft.datastore.drafting.native import NativeLearnedIndex, NativeSessionDrafter
from redraft.datastore.drafting.session_drafter import DEFAULT_PARAMS, DraftSettings, SessionDrafter
from redraft.proto.errors import InvalidQuery
from redraft.proto.tree import LEARNED, PLD, REST, SOURCE_BITS, best_chain, source_bits

ALL = frozenset({REST, PLD, LEARNED})


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_a_batch_step_is_every_session_step(narrow_store, same, threads):
    rng = random.Random(12)
    settings = [DraftSettings(), DraftSettings(DEFAULT_PARAMS.replace(budget=8, max_depth=4)),
                DraftSettings(DEFAULT_PARAMS.replace(corpora=("b",),
                                                     sources=frozenset({REST, PLD})))]
    py_learned, native_learned = LearnedIndex(3000), NativeLearnedIndex(3000)
    docs = narrow_store.docs
    with Reader(narrow_store.path) as reader:
        refs, natives, sources = [], [], []
        for i in range(24):
            doc = docs[i] + docs[i + 1] + docs[i + 2]
            s, tenant = settings[i % 3], f"t{i % 2}"
            refs.append(SessionDrafter(doc[:8], s, reader, py_learned, tenant))
            natives.append(NativeSessionDrafter(doc[:8], s, reader, native_learned, tenant))
            sources.append(doc[8:])
        nodes = 0
        for _ in range(40):
            accepted, budgets = [], []
            for src in sources:
                k = rng.choice([0, 1, 2, 3])
                accepted.append(None if k == 0 else [src.pop(0) for _ in range(min(k, len(src)))])
                budgets.append(rng.choice([None, 4, 16, 64]))
            step = step_batch(natives, accepted, budgets, threads=threads)
            assert len(step) == len(natives) and not step.errors
            assert step.offsets[-1] == len(step.tokens) == len(step.parents) == len(step.bits)
            for ref, acc in zip(refs, accepted):  # every sequence learns, then all draft
                if acc is not None:
                    ref.extend(acc)
            for i, (ref, native) in enumerate(zip(refs, natives)):
                want = ref.propose(budgets[i])
                same(want, step.tree(i))
                a, b = step.offsets[i], step.offsets[i + 1]
                assert step.bits[a:b].tolist() == [source_bits(x) for x in want.sources]
                assert step.match_lens[i].tolist() == \
                    [ref.rest_match_len, ref.pld_match_len, ref.learned_match_len]
                assert (native.rest_match_len, native.pld_match_len,
                        native.learned_match_len) == tuple(step.match_lens[i].tolist())
                nodes += len(want)
        assert nodes > 2000
    assert native_learned.stats() == py_learned.stats()


def test_arrays_of_one_session_are_its_tree(narrow_store, same):
    with Reader(narrow_store.path) as reader:
        a = NativeSessionDrafter(narrow_store.docs[3][:20], DraftSettings(), reader,
                                 NativeLearnedIndex())
        b = NativeSessionDrafter(narrow_store.docs[3][:20], DraftSettings(), reader,
                                 NativeLearnedIndex())
        tokens, parents, probs, bits = a.propose_arrays()
        want = b.propose()
        assert (tokens.dtype, parents.dtype, probs.dtype, bits.dtype) == \
            (np.uint32, np.int32, np.float64, np.uint8)
        assert tokens.tolist() == want.tokens and parents.tolist() == want.parents
        assert probs.tolist() == want.probs
        assert bits.tolist() == [source_bits(s) for s in want.sources]
        assert set(bits.tolist()) <= {1, 2, 3, 4, 5, 6, 7} and SOURCE_BITS[REST] == 1
        # the reference gives the same arrays (what the server's Session replies carry)
        ref = SessionDrafter(narrow_store.docs[3][:20], DraftSettings(), reader, LearnedIndex())
        for got, native in zip(ref.propose_arrays(), (tokens, parents, probs, bits)):
            assert got.dtype == native.dtype and got.tolist() == native.tolist()


def test_a_failing_sequence_fails_alone(narrow_store, same):
    vocab = narrow_store.vocab
    docs = narrow_store.docs
    s = DraftSettings()
    with Reader(narrow_store.path) as reader:
        ref = [SessionDrafter(docs[i][:10], s, reader) for i in range(4)]
        natives = [NativeSessionDrafter(docs[i][:10], s, reader) for i in range(4)]
        accepted = [docs[0][10:12], [vocab + 1], [-5], None]
        step = step_batch(natives, accepted, [None] * 4)
        assert sorted(step.errors) == [1, 2]
        assert isinstance(step.errors[1], InvalidQuery)
        ref[1].extend([vocab + 1])
        try:
            ref[1].propose()
        except InvalidQuery as exc:
            assert str(step.errors[1]) == str(exc)
        assert isinstance(step.errors[2], ValueError) and "outside" in str(step.errors[2])
        assert natives[2].context == docs[2][:10]  # refused before anything changed
        ref[0].extend(docs[0][10:12])
        for i in (0, 3):
            same(ref[i].propose(), step.tree(i))
        assert len(step.tree(1)) == 0 and len(step.tree(2)) == 0
        same(ref[2].propose(), natives[2].propose())  # and it drafts on at the next step
        assert step.offsets[2] == step.offsets[3]


def test_threads_work_in_a_forked_child(narrow_store, same):
    """A server forks its workers: a child has none of its parent's drafting threads and
    must start its own (not wait for the parent's)."""
    s = DraftSettings()
    with Reader(narrow_store.path) as reader:
        natives = [NativeSessionDrafter(d[:12], s, reader) for d in narrow_store.docs[:8]]
        step_batch(natives, [[1]] * 8, threads=3)  # the parent's threads exist now
        refs = [SessionDrafter(d[:12] + [1], s, reader) for d in narrow_store.docs[:8]]
        step_in_a_child(natives, refs, threads=3)


def step_in_a_child(natives: list, refs: list, threads: int) -> None:
    """Forks a child that steps `natives` on `threads` threads and exits 0 only if the batch
    completes and drafts the references' trees; waits (a minute at most) for it, which must
    exit 0 (not hang)."""
    import os
    import signal
    import time
    import warnings

    with warnings.catch_warnings():  # forking a threaded process is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = step_batch(natives, [None] * len(natives), threads=threads)
            code = 0 if all(out.tree(i).tokens == r.propose().tokens
                            for i, r in enumerate(refs)) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child's batched step hung")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_child_forked_during_a_batch_drafts_on_threads(narrow_store):
    """A fork while another thread runs a batch on threads: the child inherits the batch's
    lock held and the threads' state mid-step, and must start afresh (not wait forever)."""
    import threading

    s = DraftSettings()
    docs = narrow_store.docs
    with Reader(narrow_store.path) as reader:
        busy = [NativeSessionDrafter(d[:12], s, reader) for d in docs[:16]]
        natives = [NativeSessionDrafter(d[:12], s, reader) for d in docs[16:24]]
        refs = [SessionDrafter(d[:12], s, reader) for d in docs[16:24]]
        stop = threading.Event()

        def batches() -> None:
            while not stop.is_set():
                step_batch(busy, [None] * 16, threads=2)

        worker = threading.Thread(target=batches)
        worker.start()
        try:
            for _ in range(5):
                step_in_a_child(natives, refs, threads=2)
        finally:
            stop.set()
            worker.join()


@pytest.mark.parametrize("chain", [1, 3, 16])
def test_best_chains_are_the_reference_chains(narrow_store, same, chain):
    """chain=k: each sequence's best chain of at most k nodes (proto.tree.best_chain of the
    reference's tree), from the compiled batch and from the reference's batch alike."""
    s = DraftSettings(DEFAULT_PARAMS.replace(budget=48, max_depth=12))
    docs = narrow_store.docs
    with Reader(narrow_store.path) as reader:
        refs = [SessionDrafter(docs[i][:6], s, reader, None, "t") for i in range(16)]
        twins = [SessionDrafter(docs[i][:6], s, reader, None, "t") for i in range(16)]
        natives = [NativeSessionDrafter(docs[i][:6], s, reader, None, "t") for i in range(16)]
        long_chains = 0
        for step in range(20):
            accepted = [docs[i][6 + step:7 + step] or None for i in range(16)]
            got = step_batch(natives, accepted, chain=chain, threads=2)
            also = step_batch(twins, accepted, chain=chain)  # the reference's batch
            for i, ref in enumerate(refs):
                if accepted[i] is not None:
                    ref.extend(accepted[i])
                tree = ref.propose()
                want = best_chain(tree, chain).tree(tree.match_len)
                same(want, got.tree(i))
                same(want, also.tree(i))
                assert got.expected[i] == also.expected[i] == want.expected_accepted
                long_chains += len(want) > 1
        assert chain == 1 or long_chains > 30


def test_expected_and_sources_of_each_tree(narrow_store):
    docs = narrow_store.docs
    s = DraftSettings()
    learned = NativeLearnedIndex()
    with Reader(narrow_store.path) as reader:
        natives = [NativeSessionDrafter(docs[i][:9], s, reader, learned, "t") for i in range(8)]
        out = step_batch(natives, [docs[i][9:12] for i in range(8)])
        for i in range(8):
            tree = out.tree(i)
            assert out.expected[i] == tree.expected_accepted
            used = 0
            for label in tree.sources:
                used |= source_bits(label)
            assert out.used[i] == used


def test_a_batch_of_python_drafters_is_the_reference(narrow_store, same):
    """With the Python reference (REDRAFT_DRAFTING=python), the batch is the same step."""
    docs = narrow_store.docs
    s = DraftSettings(DEFAULT_PARAMS.replace(budget=24))
    with Reader(narrow_store.path) as reader:
        py = [SessionDrafter(docs[i][:7], s, reader, LearnedIndex(), "t") for i in range(6)]
        nat = [NativeSessionDrafter(docs[i][:7], s, reader, NativeLearnedIndex(), "t")
               for i in range(6)]
        for step in range(10):
            accepted = [docs[i][7 + 2 * step:9 + 2 * step] for i in range(6)]
            budgets = [None, 4, 8, 16, 64, 0]
            a = step_batch(py, accepted, budgets)
            b = step_batch(nat, accepted, budgets)
            for i in range(6):
                same(a.tree(i), b.tree(i))
            assert a.match_lens.tolist() == b.match_lens.tolist()
            assert a.expected.tolist() == b.expected.tolist()
            assert a.used.tolist() == b.used.tolist()


@pytest.mark.parametrize("threads,chain", [(1, 0), (3, 0), (2, 4)])
def test_a_flat_step_is_the_batch_step(narrow_store, threads, chain):
    """step_flat (the service's packed steps: tokens concatenated, counts, budgets as
    arrays) drafts what step_batch drafts, array for array, and gives each context's length;
    a sequence the core refuses (tokens outside the datastore's vocabulary) fails alone."""
    rng = random.Random(31)
    s = DraftSettings()
    docs, vocab = narrow_store.docs, narrow_store.vocab
    with Reader(narrow_store.path) as reader:
        twins = []
        for learned in (NativeLearnedIndex(3000), NativeLearnedIndex(3000)):
            twins.append([NativeSessionDrafter(docs[i][:6], s, reader, learned, f"t{i % 3}")
                          for i in range(20)])
        sources = [docs[i] + docs[i + 1] for i in range(20)]
        pos = [6] * 20
        nodes, failed = 0, []
        for step_no in range(30):
            accepted, budgets = [], []
            for i in range(20):
                k = rng.choice([0, 1, 2, 5])
                accepted.append(sources[i][pos[i]:pos[i] + k])
                pos[i] += k
                budgets.append(rng.choice([0, 4, 16, 64]))
            if step_no == 7:
                accepted[3] = [vocab + 2]
            want = step_batch(twins[0], [a or None for a in accepted],
                              [b or None for b in budgets], chain, threads)
            got = step_flat(twins[1], np.array([t for a in accepted for t in a], np.uint32),
                            np.array([len(a) for a in accepted], np.uint32),
                            np.array(budgets, np.uint32), chain, threads)
            assert got.offsets.tolist() == want.offsets.tolist()
            for name in ("tokens", "parents", "bits", "match_lens", "expected", "used"):
                assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
            assert got.probs.tolist() == want.probs.astype(np.float32).tolist()
            assert got.context_lens.tolist() == [len(d) for d in twins[0]]
            assert sorted(got.errors) == sorted(want.errors)
            for i, err in want.errors.items():
                assert type(got.errors[i]) is type(err) and str(got.errors[i]) == str(err)
            nodes += int(want.offsets[-1])
            failed += [(step_no, i) for i in want.errors]
        # the bad token fails its sequence's retrieval while it stays in the matched suffix
        assert failed[0] == (7, 3) and {i for _, i in failed} == {3} and nodes > 1000
