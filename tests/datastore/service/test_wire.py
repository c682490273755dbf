"""The wire conversion (`redraft.datastore.service.wire`) both ways: every value survives
value -> message -> value, every message survives message -> value -> message, and what
does not add up is refused as the server refuses it. The server-side checks are compared
with a real server's answer on a loopback port: the same status and the same message."""

from __future__ import annotations

import json
import random

import grpc
import numpy as np
import pytest
from redraft.datastore import Reader, build_datastore
from redraft.datastore.service import wire
from redraft.datastore.service.client import DraftClient
from redraft.datastore.service.client_errors import (
    InvalidRequest,
    ServiceError,
    UnknownSequence,
)
from redraft.datastore.service.refusals import Refusal
from redraft.datastore.service.server import ServerThread
from redraft.datastore.service.wire import (
    BatchResults,
    Drafted,
    DraftParams,
    PackedSteps,
    SequenceEnd,
    SequenceOpen,
    SequenceStep,
    ServiceInfo,
)
from redraft.proto import draft_pb2, draft_pb2_grpc
from redraft.proto.flat_trees import FlatTrees
from redraft.proto.tree import Tree

FP = "sha256:wire-test"
VOCAB = 400
RNG = random.Random(30)
DOCS = [[RNG.randrange(1, 50) for _ in range(60)] for _ in range(12)]
u32 = lambda *v: np.array(v, "<u4").tobytes()  # noqa: E731


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("wire") / "ds")
    build_datastore(None, path, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    reader = Reader(path)
    with ServerThread(reader) as srv:
        yield srv
    reader.close()


def _call(server, method: str, request):
    """A raw call (no client checks in the way); the reply, or the RpcError it failed with."""
    with grpc.insecure_channel(server.address) as channel:
        try:
            return getattr(draft_pb2_grpc.DrafterStub(channel), method)(request, timeout=30)
        except grpc.RpcError as exc:
            return exc


def _same_refusal(refusal: Refusal, err) -> None:
    assert isinstance(err, grpc.RpcError), f"the server answered {err}"
    assert (err.code(), err.details()) == (refusal.code, refusal.message)


# ---- parameters, drafts, info, stats ----------------------------------------------------


PARAMS = [DraftParams(), DraftParams(budget=7, max_depth=3, sources=("learned", "rest"),
                                     corpora=("c", "d"), min_match_len=2, max_match_len=9),
          DraftParams(sources=(), max_match_len=(1 << 32) - 1)]


@pytest.mark.parametrize("params", PARAMS)
def test_params_round_trip(params):
    msg = wire.params_message(params)
    assert wire.params_value(msg) == params
    assert wire.params_message(wire.params_value(msg)) == msg
    assert params.to_proto() == msg


@pytest.mark.parametrize("bad, match", [
    (DraftParams(budget=-1), "budget must be a non-negative integer"),
    (DraftParams(max_depth=1 << 32), "max_depth must be a non-negative integer"),
    (DraftParams(min_match_len=1.5), "min_match_len must be a non-negative integer"),
    (DraftParams(sources=("rest", "nope")), r"unknown draft sources \['nope'\]"),
])
def test_params_the_wire_cannot_carry_are_refused_before_sending(bad, match):
    with pytest.raises(InvalidRequest, match=match):
        wire.params_message(bad)


def test_an_unknown_source_is_refused_as_the_server_refuses_it(server):
    msg = draft_pb2.DraftParams(sources=[draft_pb2.SOURCE_REST, 8])
    with pytest.raises(Refusal) as info:
        wire.params_value(msg)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    err = _call(server, "Propose", draft_pb2.ProposeRequest(context=[1, 2], params=msg))
    _same_refusal(info.value, err)


DRAFTS = [
    Drafted(Tree()),
    Drafted(Tree([5, 6, 7, 9], [-1, 0, 1, 0], [0.5, 0.25, 0.125, 0.75],
                 ["rest", "pld+rest", "learned", "pld"], match_len=4),
            match_len=4, pld_match_len=3, learned_match_len=2, expected_accepted=1.375),
]


@pytest.mark.parametrize("drafted", DRAFTS)
def test_a_draft_round_trips(drafted):
    msg = draft_pb2.DraftReply()
    wire.put_draft(msg, drafted)
    assert wire.draft_value(msg) == drafted
    assert wire.tree_value(msg) == drafted.tree
    again = draft_pb2.DraftReply()
    wire.put_draft(again, wire.draft_value(msg))
    assert again == msg


def test_a_real_servers_draft_round_trips(server):
    reply = _call(server, "Propose", draft_pb2.ProposeRequest(
        context=DOCS[3][:20], params=draft_pb2.DraftParams(budget=16)))
    assert len(reply.tree.tokens) > 0
    again = draft_pb2.DraftReply()
    wire.put_draft(again, wire.draft_value(reply))
    assert again == reply


@pytest.mark.parametrize("tree", [
    draft_pb2.Tree(tokens=[1, 2], parents=[-1], probs=[0.5, 0.5], sources=[1, 1]),
    draft_pb2.Tree(tokens=[1, 2], parents=[1, -1], probs=[0.5, 0.5], sources=[1, 1]),
    draft_pb2.Tree(tokens=[1], parents=[-1], probs=[], sources=[1]),
])
def test_a_malformed_tree_is_a_service_error_never_filled_in(tree):
    with pytest.raises(ServiceError, match="malformed tree"):
        wire.draft_value(draft_pb2.DraftReply(tree=tree))


def test_info_round_trips(server):
    info = ServiceInfo("sha256:x", "tok", 1000, 500, 9, 2, 3, learn="tenant",
                       corpora={"a": {"n_docs": 4, "n_tokens": 300},
                                "b": {"n_docs": 5, "n_tokens": 200}},
                       limits={k: i + 1 for i, k in enumerate(wire.LIMITS)},
                       manifest={"version": 3, "shards": [{"x": 1}, {"y": [2]}]})
    assert wire.info_value(wire.info_message(info)) == info
    reply = _call(server, "Info", draft_pb2.InfoRequest())  # a real server's
    assert reply.tokenizer_fingerprint == FP and reply.limits.max_budget > 0
    assert wire.info_message(wire.info_value(reply)) == reply


def test_stats_round_trip(server):
    with DraftClient(server.address, timeout=30) as c:
        c.propose(DOCS[0][:10], None, FP)
    reply = _call(server, "Stats", draft_pb2.StatsRequest())
    assert reply.requests >= 1 and reply.uptime_s > 0
    stats = wire.stats_value(reply)
    assert wire.stats_message(stats) == reply
    assert {k: stats[k] for k in wire.STATS_FIELDS} == {
        k: getattr(reply, k) for k in wire.STATS_FIELDS}  # the fields say what the JSON says
    assert wire.stats_value(wire.stats_message(stats)) == stats


# ---- sessions -----------------------------------------------------------------------------


def test_session_requests_round_trip():
    params = wire.params_message(PARAMS[1])
    opening = wire.open_request([1, 2, 3], params, FP, "t")
    assert wire.session_open(opening) == draft_pb2.SessionOpen(
        prompt=[1, 2, 3], params=params, tokenizer_fingerprint=FP, tenant="t")
    step = wire.step_request([4, 5], 9)
    assert wire.session_step(step, "s1") == draft_pb2.SessionStep(accepted=[4, 5], budget=9)
    assert wire.step_request([4], None) == wire.step_request([4], 0)
    with pytest.raises(InvalidRequest, match="budget must be a non-negative integer"):
        wire.step_request([4], 1 << 32)
    with pytest.raises(InvalidRequest, match=r"token ids must be in \[0, 2\^31\)"):
        wire.check_ids([1, -2], "accepted")


@pytest.mark.parametrize("first", [
    draft_pb2.SessionRequest(step=draft_pb2.SessionStep(accepted=[1])),
    draft_pb2.SessionRequest(),
])
def test_a_session_not_opened_first_is_refused_as_the_server_refuses_it(server, first):
    with pytest.raises(Refusal) as info:
        wire.session_open(first)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(server.address) as channel:
        call = draft_pb2_grpc.DrafterStub(channel).Session(iter([first]), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    _same_refusal(info.value, err.value)


def test_a_second_open_in_a_session_is_refused_as_the_server_refuses_it(server):
    opening = wire.open_request(DOCS[1][:10], draft_pb2.DraftParams(), FP, "")
    with pytest.raises(Refusal) as info:
        wire.session_step(opening, "the-id")
    with grpc.insecure_channel(server.address) as channel:
        call = draft_pb2_grpc.DrafterStub(channel).Session(iter([opening, opening]), timeout=30)
        first = next(call)
        with pytest.raises(grpc.RpcError) as err:
            next(call)
    want = Refusal(info.value.code, info.value.message.replace("the-id", first.session_id))
    _same_refusal(want, err.value)


# ---- batched entries and packed steps ---------------------------------------------------


ENTRIES = [SequenceOpen("a", [1, 2, 3]), SequenceOpen("b", [4], PARAMS[1], tenant="t"),
           SequenceStep("c", [5, 6], budget=4), SequenceStep("d", []), SequenceEnd("e", [7]),
           SequenceEnd("f")]


def test_entries_round_trip():
    req = draft_pb2.BatchRequest()
    for e in ENTRIES:
        wire.add_entry(req.entries.add, e)
    values = [wire.entry_value(m) for m in req.entries]
    assert [(type(v), v.sequence) for v in values] == [(type(e), e.sequence) for e in ENTRIES]
    for got, want in zip(values, ENTRIES):
        assert {k: list(v) if isinstance(v, (list, tuple)) else v
                for k, v in vars(got).items()} == {
            k: list(v) if isinstance(v, (list, tuple)) else v for k, v in vars(want).items()}
    again = draft_pb2.BatchRequest()
    for v in values:
        wire.add_entry(again.entries.add, v)
    assert again == req
    assert [m.WhichOneof("kind") for m in req.entries] == [
        "open", "open", "step", "step", "close", "close"]  # empty ones keep their kind


def test_an_entry_without_a_kind_is_refused_as_the_server_refuses_it(server):
    entry = draft_pb2.BatchEntry(sequence="x")
    with pytest.raises(Refusal) as info:
        wire.entry_value(entry)
    reply = _call(server, "Batch", draft_pb2.BatchRequest(client="w", entries=[entry]))
    (result,) = reply.results  # a bad entry fails alone, in its result
    assert (result.code, result.message) == (info.value.code.value[0], info.value.message)


def test_a_value_no_entry_can_carry_is_refused_before_sending():
    req = draft_pb2.BatchRequest()
    with pytest.raises(InvalidRequest, match="a batch entry is a SequenceOpen"):
        wire.add_entry(req.entries.add, ("a", [1]))
    with pytest.raises(InvalidRequest, match="budget must be a non-negative integer"):
        wire.add_entry(req.entries.add, SequenceStep("a", [1], budget=-3))


@pytest.mark.parametrize("steps", [
    PackedSteps(["a", "b", "c"], [[1, 2], [], [3]], [5, 0, 2]),
    PackedSteps(["a", "b"], [[1, 2, 3], [4]]),
    PackedSteps(["a", "b"], [np.array([9, 8]), np.array([7], np.int32)], None),
    PackedSteps([], []),
])
def test_packed_steps_round_trip(steps):
    msg = draft_pb2.PackedSteps()
    wire.pack_steps(steps, msg)
    got = wire.unpack_steps(msg).value()
    assert got.sequences == steps.sequences
    assert got.accepted == [list(map(int, a)) for a in steps.accepted]
    assert got.budgets == (None if steps.budgets is None else list(steps.budgets))
    again = draft_pb2.PackedSteps()
    wire.pack_steps(got, again)
    assert again == msg


def test_packed_steps_the_wire_cannot_carry_are_refused_before_sending():
    for steps, match in [
        (PackedSteps(["a"], [[1], [2]]), "packed steps: 1 sequences, 2 accepted lists"),
        (PackedSteps(["a"], [[1 << 31]]), r"token ids must be in \[0, 2\^31\)"),
        (PackedSteps(["a"], [np.array([1.5])]), "token ids must be integers"),
        (PackedSteps(["a", "b"], [[1], [2]], [1, -1]), "budget must be a non-negative"),
    ]:
        with pytest.raises(InvalidRequest, match=match):
            wire.pack_steps(steps, draft_pb2.PackedSteps())


MALFORMED_PACKINGS = [
    dict(sequences=["a", "b"], accepted=u32(1, 2), counts=u32(2)),
    dict(sequences=["a", "b"], accepted=u32(1, 2), counts=u32(2, 1)),
    dict(sequences=["a"], accepted=u32(1, 2)[:7], counts=u32(2)),
    dict(sequences=["a"], accepted=u32(1), counts=u32(1) + b"\0"),
    dict(sequences=["a"], accepted=u32(1), counts=u32(1), budgets=u32(3, 4)),
    dict(sequences=["a"], accepted=u32(1), counts=u32(1), budgets=b"\1\0"),
]


@pytest.mark.parametrize("fields", MALFORMED_PACKINGS)
def test_a_malformed_packing_is_refused_as_the_server_refuses_it(server, fields):
    steps = draft_pb2.PackedSteps(**fields)
    with pytest.raises(Refusal) as info:
        wire.unpack_steps(steps)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    _same_refusal(info.value, _call(server, "Batch",
                                    draft_pb2.BatchRequest(client="w", steps=steps)))


# ---- batch replies ------------------------------------------------------------------------


def _encode(results: BatchResults, n_steps: int) -> draft_pb2.BatchReply:
    """A BatchReply of `results` (its last `n_steps` rows the packed steps') through the
    server's encoders."""
    reply = draft_pb2.BatchReply(server_us=results.server_us)
    n = len(results) - n_steps
    refusals = [None if e is None else Refusal(e.code, e.details) for e in results.errors]
    t = results.trees
    sizes = t.sizes()
    wire.put_results(reply, results.sequences[:n], refusals[:n], list(range(n)), t,
                     results.context_lens[:n])
    if n_steps:
        wire.put_step_results(
            reply.steps, sizes[n:], np.array(results.context_lens[n:], np.uint64),
            t.match_lens[n:], t.expected[n:].astype(np.float32),
            {i: r for i, r in enumerate(refusals[n:]) if r is not None})
    wire.put_trees(reply, t)
    return reply


def _fields(r: BatchResults) -> dict:
    out = dict(vars(r), trees={k: (v.tolist(), v.dtype.str) for k, v in vars(r.trees).items()})
    out["errors"] = [None if e is None else (type(e), e.code, e.details) for e in r.errors]
    return out


def test_batch_results_round_trip():
    """Entries and packed steps, one of each failed: every field comes back (a failed row's
    context length goes as 0, as the wire documents)."""
    nodes = [2, 0, 1, 0, 3]
    offsets = np.concatenate([[0], np.cumsum(nodes)]).astype(np.int64)
    results = BatchResults(
        ["a", "b", "c", "s1", "s2"],
        [None, UnknownSequence("x", grpc.StatusCode.NOT_FOUND, "no open sequence 'b'"),
         None, InvalidRequest("x", grpc.StatusCode.INVALID_ARGUMENT, "step.accepted: no"),
         None],
        [10, 0, 12, 0, 30],
        FlatTrees(offsets, np.array([5, 6, 7, 8, 9, 10], np.uint32),
                  np.array([-1, 0, -1, -1, 0, 1], np.int32),
                  np.array([0.5, 0.25, 0.75, 0.5, 0.5, 0.5], np.float32),
                  np.array([1, 3, 2, 4, 1, 1], np.uint8),
                  np.array([[3, 1, 0], [0, 0, 0], [1, 2, 0], [0, 0, 0], [2, 0, 4]], np.int64),
                  np.array([1.5, 0.0, 0.25, 0.0, 2.0])), 123.0)
    steps = PackedSteps(["s1", "s2"], [[1], [2]])
    reply = _encode(results, len(steps))
    got = wire.batch_results(draft_pb2.BatchReply.FromString(reply.SerializeToString()),
                             "here", steps)
    assert _fields(got) == _fields(results)
    assert str(got.errors[1]) == "draft service here: NOT_FOUND: no open sequence 'b'"
    assert got.tree(0) == Tree([5, 6], [-1, 0], [0.5, 0.25], ["rest", "pld+rest"], 3)
    assert _encode(got, len(steps)) == reply


def test_a_real_servers_batch_reply_round_trips(server):
    """Message -> value -> message on what a real server sent: opens, a failed step, a
    close, packed steps (one of a sequence never opened)."""
    opened = _call(server, "Batch", wire.batch_request(  # "a", "b", "c" exist before
        [SequenceOpen(s, DOCS[i][:15]) for i, s in enumerate("abc")], None, FP, "", 0,
        "round-trip", None, True)[0])
    assert [r.code for r in opened.results] == [0, 0, 0]
    req, steps = wire.batch_request(
        [SequenceOpen("d", DOCS[5][:8]), SequenceStep("nope", [1]), SequenceEnd("b", [5])],
        DraftParams(budget=12), FP, "", 0, "round-trip",
        PackedSteps(["a", "ghost", "c"], [DOCS[0][15:17], [3], DOCS[2][15:16]]), True)
    reply = _call(server, "Batch", req)
    assert isinstance(reply, draft_pb2.BatchReply), reply
    got = wire.batch_results(reply, server.address, steps)
    assert [e is None for e in got.errors] == [True, False, True, True, False, True]
    assert isinstance(got.errors[1], UnknownSequence)
    assert len(got.tokens) > 0 and list(reply.steps.failed) == [1]
    assert _encode(got, len(steps)) == reply


def test_a_batch_reply_that_does_not_add_up_is_a_service_error():
    reply = draft_pb2.BatchReply()
    reply.results.add(sequence="a", nodes=2)
    wire.put_trees(reply, FlatTrees(np.array([0, 1]), np.array([1], np.uint32),
                                    np.array([-1], np.int32), np.array([0.5], np.float32),
                                    np.array([1], np.uint8), np.zeros((1, 3)), np.zeros(1)))
    with pytest.raises(ServiceError, match=r"trees hold \[1, 1, 1, 1\] nodes, its results 2"):
        wire.batch_results(reply, "here")
    short = draft_pb2.BatchReply(steps=draft_pb2.PackedResults(nodes=u32(0)))
    with pytest.raises(ServiceError, match="do not fit its 2 steps"):
        wire.batch_results(short, "here", PackedSteps(["a", "b"], [[1], [2]]))


def test_the_manifest_goes_as_sorted_json():
    info = ServiceInfo("f", "t", 1, 0, 0, 0, 1, manifest={"b": 1, "a": [2]})
    assert json.loads(wire.info_message(info).manifest_json) == {"a": [2], "b": 1}
    assert wire.info_message(info).manifest_json == '{"a": [2], "b": 1}'
