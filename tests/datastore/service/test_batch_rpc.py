"""The batched RPC against real `redraft serve` processes: many sequences opened, stepped and
closed in one call draft the trees a Session drafts for the same contexts (with the compiled
core and with the Python reference); a bad entry fails alone, with the status a session would
end with; idle sequences are swept; closed sequences' outputs are learned for their tenant;
SequenceBatch reopens what the server lost."""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time

import grpc
import numpy as np
import pytest
from redraft.datastore import append_corpus, build_datastore
from redraft.datastore.service.batch_client import SequenceBatch
from redraft.datastore.service.client import (
    DraftClient,
    DraftParams,
    IncompatibleTokenizer,
    InvalidRequest,
    LimitExceeded,
    PackedSteps,
    SequenceEnd,
    SequenceOpen,
    SequenceStep,
    UnknownSequence,
)
from redraft.proto import draft_pb2, draft_pb2_grpc
from redraft.proto.tree import Chain, best_chain

FP = "sha256:batch-test"
VOCAB = 512
RNG = random.Random(22)
BANK = [[RNG.randrange(1, VOCAB) for _ in range(RNG.randrange(3, 10))] for _ in range(14)]


def phrase_docs(rng: random.Random, n_docs: int) -> list[list[int]]:
    """Documents stitched from shared phrases, so suffixes recur across documents."""
    docs = []
    for _ in range(n_docs):
        doc: list[int] = []
        while len(doc) < 100:
            doc += rng.choice(BANK) if rng.random() < 0.8 else [rng.randrange(1, VOCAB)]
        docs.append(doc)
    return docs


DOCS = phrase_docs(random.Random(1), 40)


def make_store(path: str) -> str:
    build_datastore(None, path, documents=DOCS[:25], fingerprint=FP, vocab_size=VOCAB,
                    corpus="a")
    append_corpus(None, path, documents=DOCS[25:], fingerprint=FP, corpus="b")
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return make_store(str(tmp_path_factory.mktemp("batch") / "ds"))


def contexts(rng: random.Random, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, the tokens that follow it) per sequence: from a document, or random ids."""
    out = []
    for _ in range(n):
        if rng.random() < 0.8:
            doc = rng.choice(DOCS)
            cut = rng.randrange(1, len(doc))
            out.append((doc[max(0, cut - rng.randint(1, 30)):cut], doc[cut:] + rng.choice(DOCS)))
        else:
            out.append(([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))],
                        [rng.randrange(1, VOCAB) for _ in range(200)]))
    return out


def same_tree(got, want) -> None:
    """Node for node: the same float32 probabilities, bit for bit."""
    assert got.tokens == want.tokens
    assert got.parents == want.parents
    assert [p.hex() for p in got.probs] == [p.hex() for p in want.probs]
    assert got.sources == want.sources
    assert got.match_len == want.match_len


def run_batch(client: DraftClient, seqs, steps: int, params: DraftParams, rng: random.Random,
              chain: int = 0, packed: bool = True, client_id: str = "engine") -> list[list]:
    """Opens every sequence in one call, then steps them all `steps` times (1-4 accepted
    tokens each, some with a budget of their own), packed or as step entries; per call, its
    results as trees (or chains), and the contexts they were drafted for."""
    out = []
    entries = [SequenceOpen(str(i), p) for i, (p, _) in enumerate(seqs)]
    ctxs = [list(p) for p, _ in seqs]
    tails = [list(t) for _, t in seqs]
    budgets = [None] * len(seqs)
    for _ in range(steps + 1):
        r = client.batch(entries, params, FP, chain=chain, client_id=client_id, packed=packed)
        assert r.errors == [None] * len(seqs)
        assert r.context_lens == [len(c) for c in ctxs]
        out.append([(list(c), r.chain(i) if chain else r.tree(i), b)
                    for i, (c, b) in enumerate(zip(ctxs, budgets))])
        entries = []
        for i in range(len(seqs)):
            k = rng.randint(1, 4)
            acc, tails[i] = tails[i][:k], tails[i][k:]
            ctxs[i] += acc
            budgets[i] = rng.choice([0, 0, 5, 17])
            entries.append(SequenceStep(str(i), acc, budgets[i]))
    return out


def session_trees(client: DraftClient, calls, params: DraftParams) -> list[list]:
    """The trees a Session drafts for each sequence's contexts, step after step."""
    per_seq = list(zip(*calls))
    trees = [[None] * len(per_seq[0]) for _ in per_seq]
    for i, steps in enumerate(per_seq):
        with client.session(steps[0][0], params, FP) as s:
            trees[i][0] = s.draft
            for j in range(1, len(steps)):
                prev, (ctx, _, budget) = steps[j - 1][0], steps[j]
                trees[i][j] = s.step(ctx[len(prev):], budget or None)
    return trees


@pytest.mark.parametrize("drafting,packed", [("native", True), ("native", False),
                                              ("python", True)])
def test_batched_trees_are_the_session_trees(store, servers, drafting, packed):
    """Many sequences per call, their steps packed or as entries; each tree equals the
    Session RPC's for the same context on the same server, and the compiled core's server
    equals the Python reference's."""
    params = DraftParams(budget=48, max_depth=12)
    srv = servers.start(store, "--port", "0", "--drafting", drafting, "--max-sessions", "64",
                        "--batch-offload", "8")
    seqs = contexts(random.Random(5), 24)
    with DraftClient(srv.address, timeout=30) as c:
        calls = run_batch(c, seqs, 6, params, random.Random(6), packed=packed)
        want = session_trees(c, calls, params)
        for j, call in enumerate(calls):
            for i, (_, tree, _) in enumerate(call):
                same_tree(tree, want[i][j])
        assert sum(len(tree) > 0 for call in calls for _, tree, _ in call) > 100
        chains = run_batch(c, seqs, 3, params, random.Random(6), chain=5, packed=packed)
        for j, call in enumerate(chains):
            for i, (_, chain, _) in enumerate(call):
                assert chain == best_chain(want[i][j], 5)
        stats = c.stats()
        assert stats["batch_steps"] == 24 * 7 + 24 * 4 and stats["batch_calls"] == 7 + 4
        assert stats["sessions_active"] == 24  # opened again: the earlier ones ended
        c.batch([SequenceEnd(str(i)) for i in range(24)], client_id="engine")
        assert c.stats()["sessions_active"] == 0


def test_the_core_server_drafts_what_the_reference_server_drafts(tmp_path, servers):
    """REDRAFT_DRAFTING=python in the server's environment runs the reference everywhere.
    Each server has a datastore of its own: servers of one datastore share what they learn,
    and the learned outputs drafted here must be each server's own."""
    params = DraftParams(budget=64, max_depth=16, sources=("rest", "pld", "learned"))
    core = servers.start(make_store(str(tmp_path / "core")), "--port", "0",
                         env={"REDRAFT_DRAFTING": "native"})
    ref = servers.start(make_store(str(tmp_path / "ref")), "--port", "0",
                        env={"REDRAFT_DRAFTING": "python"})
    seqs = contexts(random.Random(9), 30)
    with DraftClient(core.address, timeout=30) as a, DraftClient(ref.address, timeout=30) as b:
        got = run_batch(a, seqs, 8, params, random.Random(10))
        want = run_batch(b, seqs, 8, params, random.Random(10))
    for call_got, call_want in zip(got, want):
        for (ctx, tree, _), (ctx2, tree2, _) in zip(call_got, call_want):
            assert ctx == ctx2
            same_tree(tree, tree2)


@pytest.fixture()
def limited(store, servers, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("token-a\ntoken-b\n")
    return servers.start(store, "--port", "0", "--token-file", str(tokens), "--max-context",
                         "40", "--max-budget", "100", "--max-sessions", "8",
                         "--tenant-sessions", "8")


def test_a_bad_entry_fails_alone_with_a_sessions_status(limited):
    good = DOCS[0][:10]
    with DraftClient(limited.address, token="token-a", timeout=30) as a:
        first = a.batch([SequenceOpen("held", good)], None, FP, client_id="e")
        assert first.errors == [None]
        entries = [
            SequenceOpen("ok", good),
            SequenceStep("never-opened", [1, 2]),
            SequenceOpen("bad-token", [1, VOCAB + 3]),
            SequenceOpen("too-long", list(range(1, 42))),
            SequenceOpen("ok", good),  # the same id twice in one call
            SequenceStep("held", [5], budget=101),
            SequenceOpen("bad-tenant", good, tenant="a\nb"),
            SequenceOpen("bad-params", good, DraftParams(corpora=("nope",))),
            SequenceStep("held-2", [3]),
        ]
        r = a.batch(entries, None, FP, client_id="e")
        kinds = [type(e).__name__ if e else None for e in r.errors]
        assert kinds == [None, "UnknownSequence", "InvalidRequest", "LimitExceeded",
                         "InvalidRequest", "InvalidRequest", "InvalidRequest", "InvalidRequest",
                         "UnknownSequence"], r.errors
        assert r.errors[1].code == grpc.StatusCode.NOT_FOUND and "never opened" in str(r.errors[1])
        assert "open.prompt: token id 515 is outside the vocabulary [0, 512)" in str(r.errors[2])
        assert "prompt of 41 tokens exceeds max_context_len 40" in str(r.errors[3])
        assert "appears twice in one batch" in str(r.errors[4])
        assert "step.budget 101 exceeds the server's max_budget 100" in str(r.errors[5])
        assert "unknown corpora ['nope']" in str(r.errors[7])
        assert len(r.tree(0)) > 0 and r.context_lens[0] == 10
        assert [len(r.tree(i)) for i in range(1, 9)] == [0] * 8
        # a failed step ends its sequence, as a failed session step ends the session
        assert isinstance(a.batch([SequenceStep("held", [5])], client_id="e").errors[0],
                          UnknownSequence)
        # over max_context_len after steps: the sequence ends with RESOURCE_EXHAUSTED
        r = a.batch([SequenceStep("ok", list(range(1, 30))), SequenceStep("ok", [1])],
                    client_id="e")
        assert r.errors[0] is None and isinstance(r.errors[1], InvalidRequest)
        r = a.batch([SequenceStep("ok", [1, 2])], client_id="e")
        assert isinstance(r.errors[0], LimitExceeded)
        assert "context would reach 41 tokens, over max_context_len 40" in str(r.errors[0])
        assert isinstance(a.batch([SequenceStep("ok", [1])], client_id="e").errors[0],
                          UnknownSequence)
        r = a.batch([SequenceOpen("x", good), SequenceOpen("y", good)], None, FP,
                    client_id="e")
        assert r.errors == [None, None]
        # a call whose tokenizer is not the datastore's fails as a whole
        with pytest.raises(IncompatibleTokenizer):
            a.batch([SequenceOpen("z", good)], None, "sha256:other", client_id="e")
        with DraftClient(limited.address, token="token-b", timeout=30) as b:
            # another token's caller never reaches these sequences, even with the same ids
            r = b.batch([SequenceStep("x", [1]), SequenceOpen("w", good)], None, FP,
                        client_id="e")
            assert isinstance(r.errors[0], UnknownSequence) and r.errors[1] is None
        r = a.batch([SequenceStep("x", [1]), SequenceStep("y", [2])], client_id="e")
        assert r.errors == [None, None] and r.context_lens == [11, 11]


def test_ids_are_bounded_in_length(limited):
    """The server holds every open sequence's id (and recently swept ones'): an id over 256
    UTF-8 bytes is refused, so what it keeps per sequence is bounded."""
    good = DOCS[0][:10]
    with DraftClient(limited.address, token="token-a", timeout=30) as a:
        r = a.batch([SequenceOpen("s" * 256, good), SequenceOpen("s" * 257, good),
                     SequenceOpen("\u00e9" * 129, good)], None, FP, client_id="ids")
        assert r.errors[0] is None
        for err in r.errors[1:]:
            assert isinstance(err, InvalidRequest) and "at most 256" in str(err), r.errors
        assert "sequence id of 257 bytes" in str(r.errors[1])
        assert "sequence id of 258 bytes" in str(r.errors[2])  # 129 two-byte characters
        with pytest.raises(InvalidRequest, match="client id of 300 bytes; at most 256"):
            a.batch([SequenceOpen("x", good)], None, FP, client_id="c" * 300)
        assert a.batch([SequenceEnd("s" * 256)], client_id="ids").errors == [None]


def test_packed_steps_draft_the_entry_forms_trees_with_learning(tmp_path, servers):
    """With learned outputs drafted (so each tree depends on what every sequence of the
    call learned first), packed steps and step entries give the same trees, chains and
    results, call by call. A datastore per server: servers of one share what they learn."""
    params = DraftParams(budget=64, max_depth=16, sources=("rest", "pld", "learned"))
    seqs = contexts(random.Random(21), 20)
    got = []
    for packed in (True, False):
        srv = servers.start(make_store(str(tmp_path / f"ds-{packed}")), "--port", "0",
                            "--batch-offload", "8")
        with DraftClient(srv.address, timeout=30) as c:
            got.append(run_batch(c, seqs, 6, params, random.Random(22), packed=packed)
                       + run_batch(c, seqs, 2, params, random.Random(23), chain=4,
                                   packed=packed, client_id="chains"))
        srv.stop()
    for call_packed, call_entries in zip(*got):
        for (ctx, tree, _), (ctx2, tree2, _) in zip(call_packed, call_entries):
            assert ctx == ctx2
            if isinstance(tree, Chain):
                assert tree == tree2
            else:
                same_tree(tree, tree2)


def _outcomes(r) -> list:
    return [(e.code, str(e)) if e else (None, r.context_lens[i], r.tree(i).tokens)
            for i, e in enumerate(r.errors)]


def test_a_bad_packed_step_fails_alone_as_its_step_entry_does(limited):
    """Every kind of bad step, packed, gets exactly the status and message (and leaves the
    sequences as) its step entry gets; the other steps draft."""
    good = DOCS[0][:10]
    opens = [SequenceOpen(s, good) for s in ("held", "held-2", "long", "ok", "ok-2")]
    steps = [
        SequenceStep("never-opened", [1, 2]),
        SequenceStep("held", [5, VOCAB + 3, 7]),
        SequenceStep("held-2", [5], budget=101),
        SequenceStep("long", list(range(1, 32))),
        SequenceStep("ok", DOCS[0][10:12], budget=7),
        SequenceStep("ok", [3]),  # the same id twice in one call
        SequenceStep("ok-2", []),
    ]
    outcomes = []
    with DraftClient(limited.address, token="token-a", timeout=30) as a:
        for packed in (False, True):
            cid = f"e-{packed}"
            assert a.batch(opens, None, FP, client_id=cid).errors == [None] * 5
            r = a.batch(steps, client_id=cid, packed=packed)
            again = a.batch([SequenceStep(s, [9]) for s in ("held", "held-2", "long", "ok")],
                            client_id=cid, packed=packed)
            outcomes.append((_outcomes(r), _outcomes(again)))
            # a step entry and a packed step of one sequence in one call: the second fails
            mixed = a.batch([SequenceOpen("x", good)], None, FP, client_id=cid,
                            steps=PackedSteps(["x", "ok-2"], [[1], [4]]))
            assert mixed.errors[0] is None and mixed.errors[2] is None
            assert "sequence 'x' appears twice in one batch" in str(mixed.errors[1])
    assert outcomes[0] == outcomes[1]
    first, again = outcomes[1]
    codes = [o[0] for o in first]
    assert codes == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                     grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                     None, grpc.StatusCode.INVALID_ARGUMENT, None]
    assert "step.accepted: token id 515 is outside the vocabulary [0, 512)" in first[1][1]
    assert "step.budget 101 exceeds the server's max_budget 100" in first[2][1]
    assert "context would reach 41 tokens, over max_context_len 40" in first[3][1]
    assert first[4][1] == 12 and 0 < len(first[4][2]) <= 7 and first[6][1] == 10
    # the failed steps ended their sequences; the good one went on
    assert [o[0] for o in again] == [grpc.StatusCode.NOT_FOUND] * 3 + [None]


def _raw_batch(address: str, steps: draft_pb2.PackedSteps) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        stub = draft_pb2_grpc.DrafterStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Batch(draft_pb2.BatchRequest(client="e", steps=steps), timeout=30)
    return info.value


def test_a_malformed_packing_fails_the_whole_call(store, servers):
    srv = servers.start(store, "--port", "0")
    u32 = lambda *v: np.array(v, "<u4").tobytes()  # noqa: E731
    cases = [
        (dict(sequences=["a", "b"], accepted=u32(1, 2), counts=u32(2)),
         "steps.counts holds 1 counts for 2 sequences"),
        (dict(sequences=["a", "b"], accepted=u32(1, 2), counts=u32(2, 1)),
         "steps.counts add up to 3 tokens, steps.accepted holds 2"),
        (dict(sequences=["a"], accepted=u32(1, 2)[:7], counts=u32(2)),
         "steps.accepted holds 7 bytes, not a whole number of uint32"),
        (dict(sequences=["a"], accepted=u32(1), counts=u32(1) + b"\0"),
         "steps.counts holds 5 bytes, not a whole number of uint32"),
        (dict(sequences=["a"], accepted=u32(1), counts=u32(1), budgets=u32(3, 4)),
         "steps.budgets holds 2 budgets for 1 sequences"),
        (dict(sequences=["a"], accepted=u32(1), counts=u32(1), budgets=b"\1\0"),
         "steps.budgets holds 2 bytes, not a whole number of uint32"),
    ]
    for fields, message in cases:
        err = _raw_batch(srv.address, draft_pb2.PackedSteps(**fields))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert err.details() == message
    with DraftClient(srv.address, timeout=30) as c:  # and the server serves on
        assert c.batch([SequenceOpen("a", [1, 2])], None, FP, client_id="e").errors == [None]


def test_a_second_call_on_a_sequence_being_drafted_is_aborted(store, servers):
    """ABORTED, with a real race: one call's big step (130,000 tokens: indexed on a thread)
    drafts while other calls step the same sequence; their other sequences draft, and the
    busy sequence is left as it was. Tried on fresh sequences until a call meets one busy."""
    srv = servers.start(store, "--port", "0")
    rng = random.Random(30)
    big = [rng.randrange(1, VOCAB) for _ in range(130_000)]
    prompt = DOCS[2][:10]
    aborted = []
    with DraftClient(srv.address, timeout=120) as c:
        for attempt in range(20):
            busy, other = f"busy-{attempt}", f"other-{attempt}"
            assert c.batch([SequenceOpen(busy, prompt), SequenceOpen(other, prompt)], None,
                           FP, client_id="e").errors == [None, None]
            first = {}

            def step_big(busy=busy, first=first) -> None:
                first["r"] = c.batch([SequenceStep(busy, big)], client_id="e")

            thread = threading.Thread(target=step_big)
            thread.start()
            while thread.is_alive():
                r = c.batch([SequenceStep(busy, []), SequenceStep(other, [])], client_id="e")
                assert r.errors[1] is None and r.context_lens[1] == 10
                if r.errors[0] is not None:
                    aborted.append(r.errors[0])
            thread.join()
            assert first["r"].errors == [None] and first["r"].context_lens == [10 + len(big)]
            r = c.batch([SequenceStep(busy, [1])], client_id="e")
            assert r.errors == [None] and r.context_lens == [11 + len(big)]
            c.batch([SequenceEnd(busy), SequenceEnd(other)], client_id="e")
            if aborted:
                break
    assert aborted, "no call met the sequence while it was drafted"
    assert all(e.code == grpc.StatusCode.ABORTED for e in aborted)
    assert f"sequence '{busy}' is being drafted by another call; send one call at a time " \
        "per sequence" in str(aborted[0])


def test_sessions_and_sequences_share_max_sessions(limited, until):
    good = DOCS[1][:12]
    with DraftClient(limited.address, token="token-a", timeout=30) as a:
        with a.session(good, DraftParams(), FP):
            r = a.batch([SequenceOpen(str(i), good) for i in range(9)], None, FP, client_id="e")
            assert r.errors[:7] == [None] * 7
            assert isinstance(r.errors[7], LimitExceeded) and isinstance(r.errors[8],
                                                                         LimitExceeded)
            assert "max_sessions=8 sessions and sequences open" in str(r.errors[7])
            with pytest.raises(LimitExceeded):
                a.session(good, DraftParams(), FP).open()
        until(lambda: a.stats()["sessions_active"] == 7)
        r = a.batch([SequenceEnd("0"), SequenceOpen("7", good), SequenceOpen("8", good)],
                    None, FP, client_id="e")
        assert r.errors == [None, None, None]


def test_one_tokens_call_cannot_take_every_slot(store, servers, tmp_path):
    """Two tokens, max_sessions 8: each may hold its share, 4. One token's single call
    opening 9 sequences gets 4 (the rest RESOURCE_EXHAUSTED, saying it is the token's
    share); the other token still opens its 4, and is refused only when the server is full;
    an ended sequence gives its token the slot back."""
    tokens = tmp_path / "tokens"
    tokens.write_text("token-a\ntoken-b\n")
    srv = servers.start(store, "--port", "0", "--token-file", str(tokens),
                        "--max-sessions", "8")
    good = DOCS[1][:12]
    with DraftClient(srv.address, token="token-a", timeout=30) as a, \
            DraftClient(srv.address, token="token-b", timeout=30) as b:
        r = a.batch([SequenceOpen(str(i), good) for i in range(9)], None, FP, client_id="e")
        assert r.errors[:4] == [None] * 4
        assert all(isinstance(e, LimitExceeded) for e in r.errors[4:])
        assert "this token holds its share of 4 sessions and sequences (of " \
            "max_sessions=8)" in str(r.errors[4])
        with pytest.raises(LimitExceeded, match="its share of 4"):
            a.session(good, DraftParams(), FP).open()
        r = b.batch([SequenceOpen(str(i), good) for i in range(3)], None, FP, client_id="e")
        assert r.errors == [None] * 3
        with b.session(good, DraftParams(), FP):  # b's fourth: the server is now full
            assert b.stats()["sessions_active"] == 8
            r = b.batch([SequenceOpen("x", good)], None, FP, client_id="e")
            assert "server has max_sessions=8 sessions and sequences open" in str(r.errors[0])
        assert b.stats()["refused_tenant_sessions"] == 6
        r = a.batch([SequenceEnd("0"), SequenceOpen("again", good)], None, FP, client_id="e")
        assert r.errors == [None, None]


def test_tenant_sessions_sets_the_share(store, servers, tmp_path):
    """--tenant-sessions overrides the fair share; without auth it bounds every caller."""
    srv = servers.start(store, "--port", "0", "--max-sessions", "8", "--tenant-sessions", "3")
    good = DOCS[1][:12]
    with DraftClient(srv.address, timeout=30) as c:
        r = c.batch([SequenceOpen(str(i), good) for i in range(5)], None, FP, client_id="e")
        assert r.errors[:3] == [None] * 3
        assert "its share of 3 sessions and sequences (of max_sessions=8)" in str(r.errors[3])
        assert c.stats()["sessions_active"] == 3


def test_sequence_batch_refuses_a_context_over_the_limit_as_the_server_would(limited):
    """A context past --max-context is not sent: its key's error is the one the server gives
    such an open (the same type, code and message); the other keys draft."""
    long, good = list(range(41)), DOCS[0][:10]
    with DraftClient(limited.address, token="token-a", timeout=30) as a:
        sent = a.batch([SequenceOpen("x", long)], None, FP, client_id="e").errors[0]
        drafts = SequenceBatch(a, DraftParams(budget=8), FP).draft({"k": long, "ok": good})
        got = drafts.errors["k"]
        assert type(got) is type(sent) is LimitExceeded
        assert (got.code, str(got)) == (sent.code, str(sent))
        assert "prompt of 41 tokens exceeds max_context_len 40" in str(got)
        assert "ok" not in drafts.errors and len(drafts["ok"])


def test_sequence_batch_ends_before_it_opens_so_freed_slots_serve_the_same_call(store, servers):
    """An engine step that finishes one request and admits another at a full server: the
    end goes first in the call, so the new sequence gets the slot at once."""
    srv = servers.start(store, "--port", "0", "--max-sessions", "2")
    seqs = contexts(random.Random(4), 3)
    with DraftClient(srv.address, timeout=30) as c:
        batch = SequenceBatch(c, DraftParams(budget=32), FP)
        ctxs = {f"req-{i}": list(p) for i, (p, _) in enumerate(seqs)}
        first = batch.draft({k: ctxs[k] for k in ("req-0", "req-1")})
        assert not first.errors
        swapped = batch.draft({k: ctxs[k] for k in ("req-1", "req-2")}, end=["req-0"])
        assert not swapped.errors, swapped.errors
        assert c.stats()["sessions_active"] == 2
        with pytest.raises(LimitExceeded):  # and the server is still full
            c.session(ctxs["req-0"], DraftParams(budget=32), FP).open()
        batch.close()
        assert c.stats()["sessions_active"] == 0


def test_sequence_batch_steps_packed_draft_the_session_trees(store, servers):
    """SequenceBatch over numpy rows (as an engine hands them), with budgets per key and
    sequences joining and leaving: every tree is the Session's for the same context."""
    srv = servers.start(store, "--port", "0")
    rng = random.Random(40)
    seqs = contexts(rng, 12)
    params = DraftParams(budget=32, max_depth=10)
    with DraftClient(srv.address, timeout=30) as c:
        batch = SequenceBatch(c, params, FP)
        ctxs = {f"r{i}": np.array(p, np.int64) for i, (p, _) in enumerate(seqs)}
        tails = {f"r{i}": t for i, (_, t) in enumerate(seqs)}
        history = []
        for step in range(5):
            live = {k: v for i, (k, v) in enumerate(ctxs.items()) if i >= step}
            budgets = {k: rng.choice([0, 5, 20]) for k in live}
            drafts = batch.draft(live, budgets, end=[f"r{step - 1}"] if step else ())
            assert not drafts.errors and len(batch) == len(live)
            history += [(v.tolist(), budgets[k], drafts[k]) for k, v in live.items()]
            for k in live:
                n = rng.randint(0, 3)
                ctxs[k] = np.concatenate([ctxs[k], np.array(tails[k][:n], np.int64)])
                tails[k] = tails[k][n:]
        for ctx, budget, tree in history:
            want = c.propose(ctx, DraftParams(budget or 32, 10))
            same_tree(tree, want)
        batch.close()
        assert c.stats()["sessions_active"] == 0


def test_steps_sent_without_waiting_leave_the_server_where_drafting_calls_would(store,
                                                                                servers):
    """`send` (an engine step that wants no drafts): the server opens, steps and ends the
    same sequences as `draft` would, so the next `draft` reopens nothing and its trees are
    the ones for the whole contexts."""
    srv = servers.start(store, "--port", "0")
    seqs = contexts(random.Random(41), 6)
    with DraftClient(srv.address, timeout=30) as c:
        batch = SequenceBatch(c, DraftParams(budget=32), FP)
        ctxs = {f"r{i}": np.array(p, np.int64) for i, (p, _) in enumerate(seqs[:5])}
        batch.draft(ctxs)
        for step in range(3):
            for i, (k, v) in enumerate(ctxs.items()):
                ctxs[k] = np.concatenate([v, np.array(seqs[i][1][step:step + 1], np.int64)])
            if step == 1:
                ctxs["r5"] = np.array(seqs[5][0], np.int64)  # opened by a send
            if step == 2:
                del ctxs["r0"]  # ended by a send
            batch.send({k: v.copy() for k, v in ctxs.items()}, end=["r0"] if step == 2 else ())
        drafts = batch.draft(ctxs)
        assert not drafts.errors and batch.reopened == 0 and len(batch) == 5
        for k, v in ctxs.items():
            same_tree(drafts[k], c.propose(v.tolist(), DraftParams(budget=32)))
        stats = c.stats()
        assert stats["sessions_opened"] == 6 and stats["sessions_active"] == 5
        batch.close()


def test_idle_sequences_are_swept_and_sequence_batch_reopens_them(store, servers):
    srv = servers.start(store, "--port", "0", "--idle-timeout", "1")
    seqs = contexts(random.Random(3), 6)
    with DraftClient(srv.address, timeout=30) as c:
        batch = SequenceBatch(c, DraftParams(budget=32), FP)
        ctxs = {f"req-{i}": list(p) for i, (p, _) in enumerate(seqs)}
        first = batch.draft(ctxs)
        assert not first.errors and len(batch) == 6
        time.sleep(2.5)  # the sweeper runs every quarter of the timeout
        assert c.stats()["sessions_idle_closed"] == 6
        raw = c.batch([SequenceStep("0", [1])], client_id=batch.client_id)
        assert isinstance(raw.errors[0], UnknownSequence)
        assert "was closed after idling more than 1 s; open it again" in str(raw.errors[0])
        for key, (_, tail) in zip(ctxs, seqs):
            ctxs[key] += tail[:3]
        again = batch.draft(ctxs)
        assert not again.errors and batch.reopened == 6
        with c.session(ctxs["req-2"], DraftParams(budget=32), FP) as s:
            same_tree(again["req-2"], s.draft)
        ctxs["req-2"] += [7]
        third = batch.draft({"req-2": ctxs["req-2"]})
        assert batch.reopened == 6 and third["req-2"] is not None
        batch.close()
        assert c.stats()["sessions_active"] == 0


def test_closed_sequences_outputs_are_drafted_for_their_tenant(store, servers):
    srv = servers.start(store, "--port", "0")
    rng = random.Random(8)
    prompt = [rng.randrange(1, VOCAB) for _ in range(20)]
    secret = [rng.randrange(1, VOCAB) for _ in range(40)]
    learned_only = DraftParams(budget=16, max_depth=8, sources=("learned",))
    with DraftClient(srv.address, timeout=30) as c:
        r = c.batch([SequenceOpen("s", prompt)], None, FP, tenant="alice", client_id="e")
        assert r.errors == [None]
        assert c.batch([SequenceStep("s", secret[:20])], client_id="e").errors == [None]
        assert c.batch([SequenceEnd("s", secret[20:])], client_id="e").errors == [None]
        assert c.stats()["sessions_active"] == 0
        # the tail the close carried is learned too
        assert c.propose(prompt + secret[:26], learned_only, tenant="alice").tokens[:6] == \
            secret[26:32]
        assert c.propose(prompt + secret[:26], learned_only, tenant="bob").tokens == []
        # and a sequence of the same tenant drafts it
        r = c.batch([SequenceOpen("t", prompt + secret[:10], learned_only)], None, FP,
                    tenant="alice", client_id="e")
        assert r.tree(0).tokens[:4] == secret[10:14] and "learned" in r.tree(0).sources[0]


def test_a_call_without_fingerprint_cannot_open(store, servers):
    srv = servers.start(store, "--port", "0")
    with DraftClient(srv.address, timeout=30) as c:
        r = c.batch([SequenceOpen("a", [1, 2, 3])], client_id="e")
        assert isinstance(r.errors[0], IncompatibleTokenizer)
        assert r.errors[0].code == grpc.StatusCode.FAILED_PRECONDITION
        assert "tokenizer_fingerprint is required" in str(r.errors[0])


def test_held_sequences_draft_from_a_commit_made_while_they_are_open(tmp_path, servers, until):
    """The server follows its datastore's commits: an open sequence drafts from a corpus
    appended after it opened, at its next step, without being reopened."""
    store = make_store(str(tmp_path / "ds"))
    srv = servers.start(store, "--port", "0", "--reload-seconds", "0.2")
    rng = random.Random(12)
    extra = [rng.randrange(1, VOCAB) for _ in range(60)]  # tokens no document has in order
    rest_only = DraftParams(budget=16, sources=("rest",))
    with DraftClient(srv.address, timeout=30) as c:
        r = c.batch([SequenceOpen("s", extra[:5], rest_only)], None, FP, client_id="e")
        assert r.errors == [None] and r.tree(0).tokens[:3] != extra[5:8]
        append_corpus(None, store, documents=[extra], fingerprint=FP, corpus="new")
        until(lambda: "new" in c.info().corpora)
        r = c.batch([SequenceStep("s", extra[5:10])], client_id="e")
        assert r.errors == [None] and r.context_lens == [10]
        assert r.tree(0).tokens[:3] == extra[10:13]


def test_a_step_of_many_tokens_drafts_what_a_session_drafts(store, servers):
    """A step that adds more than the server indexes inline (65,536 tokens) drafts on a
    thread, and still drafts the session's tree."""
    srv = servers.start(store, "--port", "0")
    rng = random.Random(4)
    prompt = DOCS[3][:20]
    big = [t for _ in range(700) for t in rng.choice(DOCS)][:70_000]
    params = DraftParams(budget=32)
    with DraftClient(srv.address, timeout=60) as c:
        assert c.batch([SequenceOpen("big", prompt, params)], None, FP,
                       client_id="e").errors == [None]
        r = c.batch([SequenceStep("big", big), SequenceOpen("small", prompt, params)], None, FP,
                    client_id="e")
        assert r.errors == [None, None] and r.context_lens == [70_020, 20]
        with c.session(prompt, params, FP) as s:
            same_tree(r.tree(1), s.draft)
            same_tree(r.tree(0), s.step(big))


def test_long_prompts_draft_what_a_session_drafts(store, servers, until):
    """Opens of long prompts, beside short opens and steps of the same call, draft the
    Session's trees, and a bad long prompt fails alone with its open's status."""
    srv = servers.start(store, "--port", "0", "--max-context", "40000")
    rng = random.Random(50)
    long = [t for _ in range(400) for t in rng.choice(DOCS)][:30_000]
    params = DraftParams(budget=32)
    with DraftClient(srv.address, timeout=60) as c:
        assert c.batch([SequenceOpen("short", DOCS[4][:20], params)], None, FP,
                       client_id="e").errors == [None]
        r = c.batch([SequenceOpen("long", long, params),
                     SequenceOpen("bad", long[:20_000] + [VOCAB + 1], params),
                     SequenceOpen("too-long", long + long[:10_001], params),
                     SequenceStep("short", DOCS[4][20:23])], None, FP, client_id="e")
        assert r.errors[0] is None and r.errors[3] is None
        assert r.context_lens[0] == 30_000 and r.context_lens[3] == 23
        assert "open.prompt: token id 513 is outside the vocabulary [0, 512)" in str(r.errors[1])
        assert isinstance(r.errors[2], LimitExceeded)
        assert "prompt of 40001 tokens exceeds max_context_len 40000" in str(r.errors[2])
        step = c.batch([SequenceStep("long", DOCS[5][:3])], client_id="e")
        assert step.errors == [None] and step.context_lens == [30_003]
        assert isinstance(c.batch([SequenceStep("bad", [1])], client_id="e").errors[0],
                          UnknownSequence)
        with c.session(long, params, FP) as s:
            same_tree(r.tree(0), s.draft)
            same_tree(step.tree(0), s.step(DOCS[5][:3]))
        # the Session's slot is given back when the server sees its stream end: soon, not
        # before `session` returns
        until(lambda: c.stats()["sessions_active"] == 2, timeout=10)


def test_what_sequences_open_at_shutdown_learned_outlives_the_server(tmp_path, servers, until):
    """SIGTERM ends every open sequence (its output final), the server exits 0, and a
    restarted server drafts what they learned for the same tenant only."""
    store = make_store(str(tmp_path / "ds"))
    rng = random.Random(15)
    prompt = [rng.randrange(1, VOCAB) for _ in range(12)]
    secret = [rng.randrange(1, VOCAB) for _ in range(30)]
    learned_only = DraftParams(budget=16, max_depth=8, sources=("learned",))
    a = servers.start(store, "--port", "0", "--learn-persist-seconds", "300")
    with DraftClient(a.address, timeout=30) as c:
        assert c.batch([SequenceOpen("s", prompt)], None, FP, tenant="carol",
                       client_id="e").errors == [None]
        assert c.batch([SequenceStep("s", secret)], client_id="e").errors == [None]
    assert a.stop() == 0
    b = servers.start(store, "--port", "0")
    with DraftClient(b.address, timeout=30) as c:
        until(lambda: c.stats()["learned_docs"] == 1)  # reloaded in the background
        got = c.propose(prompt + secret[:10], learned_only, tenant="carol").tokens
        assert got[:5] == secret[10:15]
        assert c.propose(prompt + secret[:10], learned_only, tenant="dave").tokens == []


@pytest.mark.parametrize("accepted,budgets,message", [
    ([[1, -2]], None, "accepted: token ids must be in [0, 2^31)"),
    ([np.array([1, 1 << 31])], None, "accepted: token ids must be in [0, 2^31)"),
    ([np.array([1.5])], None, "accepted: token ids must be integers"),
    ([[1]], [-1], "budget must be a non-negative integer, got -1"),
    ([[1]], [1.5], "budget must be a non-negative integer, got 1.5"),
    ([[1], [2]], None, "packed steps: 1 sequences, 2 accepted lists, no budgets"),
])
def test_packed_steps_refuse_what_step_entries_refuse_before_sending(accepted, budgets,
                                                                     message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        PackedSteps(["a"], accepted, budgets).to_proto(draft_pb2.PackedSteps())


def test_oversized_batch_calls_are_refused_fast_without_stalling_or_memory(store, servers):
    """A hostile Batch call (200k closes of unknown ids; 2 M packed steps naming one empty
    id) is refused whole with RESOURCE_EXHAUSTED before any entry is looked at: another
    caller's steps keep being answered meanwhile, and the server's memory stays small."""
    import psutil

    srv = servers.start(store, "--port", "0")
    closes = draft_pb2.BatchRequest(client="e", entries=[
        draft_pb2.BatchEntry(sequence=str(i), close=draft_pb2.SequenceClose())
        for i in range(200_000)])
    n = 2_000_000
    packed = draft_pb2.BatchRequest(client="e", steps=draft_pb2.PackedSteps(
        sequences=[""] * n, accepted=b"", counts=bytes(4 * n)))
    longest = [0.0]
    stop = threading.Event()

    def other_caller() -> None:
        with DraftClient(srv.address, timeout=30) as c:
            c.batch([SequenceOpen("o", DOCS[0][:10])], None, FP, client_id="other")
            while not stop.is_set():
                t = time.perf_counter()
                assert c.batch([SequenceStep("o", [1])], client_id="other").errors == [None]
                longest[0] = max(longest[0], time.perf_counter() - t)
                c.batch([SequenceEnd("o")], client_id="other")
                c.batch([SequenceOpen("o", DOCS[0][:10])], None, FP, client_id="other")

    worker = threading.Thread(target=other_caller)
    worker.start()
    try:
        with grpc.insecure_channel(srv.address, options=[
                ("grpc.max_send_message_length", 64 << 20)]) as channel:
            stub = draft_pb2_grpc.DrafterStub(channel)
            for request, size in ((closes, 200_000), (packed, n)):
                t = time.perf_counter()
                with pytest.raises(grpc.RpcError) as info:
                    stub.Batch(request, timeout=60)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"batch of {size} entries and packed steps exceeds the server's " \
                       "max_batch_entries 4096" in info.value.details()
                assert time.perf_counter() - t < 5
    finally:
        stop.set()
        worker.join(60)
    assert longest[0] < 2.0, longest  # 5.5 s before the bound
    rss = psutil.Process(srv.pid).memory_info().rss
    with open(f"/proc/{srv.pid}/status") as f:  # the peak, on Linux
        peak = next((int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM")), rss)
    assert rss < 300 << 20 and peak < 300 << 20, (rss, peak)


def test_a_reply_over_the_message_limit_fails_only_the_entries_past_it(store, servers):
    """Sequences whose trees would take the reply past --max-message-bytes fail alone with
    RESOURCE_EXHAUSTED (and are not held), the ones before them get their trees, and the
    reply is sent: before, the whole call failed gRPC's size limit after every sequence was
    drafted and left held."""
    limit = 256 << 10
    srv = servers.start(store, "--port", "0", "--max-message-bytes", str(limit),
                        "--max-sessions", "200", "--tenant-sessions", "200")  # all for one
    opens = [SequenceOpen(str(i), DOCS[i % 40][:30]) for i in range(200)]
    with DraftClient(srv.address, timeout=30) as c:
        r = c.batch(opens, DraftParams(budget=1000, max_depth=16), FP, client_id="e")
        ok = [i for i, e in enumerate(r.errors) if e is None]
        assert ok and ok == list(range(len(ok))) and len(ok) < len(opens)
        assert all(isinstance(e, LimitExceeded) and "would not fit the server's "
                   f"max_message_bytes {limit} reply" in str(e) for e in r.errors[len(ok):])
        assert len(r.tokens) * 13 > limit // 2, len(r.tokens)  # filled, not emptied
        assert c.stats()["sessions_active"] == len(ok)
        again = c.batch([SequenceStep("0", [1]), SequenceStep(str(len(ok)), [1])],
                        client_id="e")
        assert again.errors[0] is None and isinstance(again.errors[1], UnknownSequence)


def test_without_auth_tenant_sessions_bounds_each_declared_tenant_not_the_server(
        store, servers):
    """Before: every anonymous caller shared one share, so `--tenant-sessions 3` capped the
    whole server at 3 of 8, and the refusal spoke of "this token"."""
    srv = servers.start(store, "--port", "0", "--max-sessions", "8", "--tenant-sessions", "3")
    good = DOCS[1][:12]
    with DraftClient(srv.address, timeout=30) as c:
        r = c.batch([SequenceOpen(str(i), good) for i in range(5)], None, FP, client_id="e")
        assert r.errors[:3] == [None] * 3
        assert "this tenant holds its share of 3 sessions and sequences (of max_sessions=8)" \
            in str(r.errors[3])
        r = c.batch([SequenceOpen(str(i), good) for i in range(3)], None, FP, client_id="f",
                    tenant="bob")  # another declared tenant: its own share
        assert r.errors == [None] * 3
        with c.session(good, DraftParams(), FP, tenant="carol"), \
                c.session(good, DraftParams(), FP, tenant="carol"):  # the server's 7th and 8th
            assert c.stats()["sessions_active"] == 8
            with pytest.raises(LimitExceeded, match="server has max_sessions=8"):
                c.session(good, DraftParams(), FP, tenant="dave").open()
        with pytest.raises(LimitExceeded, match="this tenant holds its share of 3"):
            c.session(good, DraftParams(), FP, tenant="bob").open()
        with c.session(good, DraftParams(), FP, tenant="dave"):
            assert c.stats()["sessions_active"] == 7


def test_limits_that_leave_a_token_no_slot_are_said_at_start(store, servers, tmp_path,
                                                              until):
    tokens = tmp_path / "tokens"
    tokens.write_text("token-a\ntoken-b\ntoken-c\n")
    srv = servers.start(store, "--port", "0", "--token-file", str(tokens),
                        "--max-sessions", "2")
    until(lambda: "warning" in srv.stderr)
    assert srv.stop() == 0
    (said,) = [line for line in srv.stderr.splitlines() if "warning" in line]
    assert "--max-sessions 2 is fewer than the 3 tokens" in said
    fair = servers.start(store, "--port", "0", "--token-file", str(tokens))
    assert fair.stop() == 0 and "warning" not in fair.stderr


def test_without_auth_one_tenants_call_cannot_take_every_slot(store, servers):
    """Before: one anonymous engine's single call took all 16 slots, and a client declaring
    another tenant was refused. Now a tenant alone stops at 14 (16 less an eighth, kept for
    tenants to come); the tenants holding slots share those 14 equally, so a newcomer finds
    the kept ones at once and the first tenant's share shrinks as the others come."""
    srv = servers.start(store, "--port", "0", "--max-sessions", "16")
    good = DOCS[1][:12]
    with DraftClient(srv.address, timeout=30) as c:
        r = c.batch([SequenceOpen(str(i), good) for i in range(16)], None, FP, client_id="e")
        assert r.errors[:14] == [None] * 14
        assert "this tenant holds its share of 14 sessions and sequences (of max_sessions=16" \
            in str(r.errors[14]) and isinstance(r.errors[15], LimitExceeded)
        r = c.batch([SequenceOpen(str(i), good) for i in range(3)], None, FP, client_id="f",
                    tenant="bob")  # the two kept slots, then the server is full
        assert r.errors[:2] == [None, None]
        assert "server has max_sessions=16 sessions and sequences open" in str(r.errors[2])
        # two tenants hold slots: a share is 14 / 2 = 7; the anonymous one holds 4 after
        # its ends, so 3 of its 4 opens are taken
        r = c.batch([SequenceEnd(str(i)) for i in range(10)]
                    + [SequenceOpen(f"n{i}", good) for i in range(4)], None, FP, client_id="e")
        assert r.errors[:13] == [None] * 13
        assert "this tenant holds its share of 7 sessions and sequences (of max_sessions=16: " \
            "14 shared by 2 tenants now, 2 kept for tenants to come); close some or try " \
            "later" in str(r.errors[13])
        r = c.batch([SequenceOpen(f"b{i}", good) for i in range(6)], None, FP, client_id="f",
                    tenant="bob")
        assert r.errors[:5] == [None] * 5 and "its share of 7" in str(r.errors[5])
        assert c.stats()["sessions_active"] == 14
        with c.session(good, DraftParams(), FP, tenant="carol"), \
                c.session(good, DraftParams(), FP, tenant="dave"):  # the kept two
            assert c.stats()["sessions_active"] == 16
            with pytest.raises(LimitExceeded, match="server has max_sessions=16"):
                c.session(good, DraftParams(), FP, tenant="erin").open()


def test_without_auth_one_tenants_sessions_cannot_take_every_slot(store, servers, until):
    """Session streams alike: before, 8 anonymous sessions filled --max-sessions 8 and a
    session declaring a tenant was refused; now the anonymous ones stop at 7 (the default
    tenant's share, one slot kept) and the declared tenant opens."""
    srv = servers.start(store, "--port", "0", "--max-sessions", "8")
    good = DOCS[2][:12]
    with DraftClient(srv.address, timeout=30) as c, contextlib.ExitStack() as held:
        for _ in range(7):
            held.enter_context(c.session(good, DraftParams(), FP))
        with pytest.raises(LimitExceeded, match=re.escape(
                "this tenant holds its share of 7 sessions and sequences (of max_sessions=8: "
                "7 shared by 1 tenant now, 1 kept for tenants to come)")):
            c.session(good, DraftParams(), FP).open()
        until(lambda: c.stats()["sessions_active"] == 7)
        with c.session(good, DraftParams(), FP, tenant="bob") as s:
            assert c.stats()["sessions_active"] == 8
            s.step(DOCS[2][12:14])
