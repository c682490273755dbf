"""The draft parameters' value: its checks (one line per field) and its round trip through the
wire's message."""

from __future__ import annotations

import pytest
from redraft.proto import draft_pb2
from redraft.proto.params import DEFAULT_SOURCES, SOURCES, DraftParams, InvalidParams
from redraft.proto.tree import LEARNED, PLD, REST

VALUES = [
    DraftParams(),
    DraftParams(budget=7, max_depth=3, sources=(LEARNED, REST), corpora=("c", "d"),
                min_match_len=2, max_match_len=9),
    DraftParams(sources=(), max_match_len=(1 << 32) - 1),
    DraftParams(budget=1, sources=SOURCES, corpora=("only",)),
]


@pytest.mark.parametrize("value", VALUES)
def test_a_value_survives_the_wire(value):
    msg = value.to_proto()
    assert DraftParams.from_proto(msg) == value
    again = draft_pb2.DraftParams()
    again.ParseFromString(msg.SerializeToString())
    assert DraftParams.from_proto(again) == value


def test_the_message_carries_each_field_under_its_own_name():
    msg = VALUES[1].to_proto()
    assert (msg.budget, msg.max_depth, list(msg.sources), list(msg.corpora),
            msg.min_match_len, msg.max_match_len) == (
        7, 3, [draft_pb2.SOURCE_LEARNED, draft_pb2.SOURCE_REST], ["c", "d"], 2, 9)


@pytest.mark.parametrize("value, message", [
    (DraftParams(budget=-1), "budget must be a non-negative integer, got -1"),
    (DraftParams(max_depth=1 << 32), "max_depth must be a non-negative integer"),
    (DraftParams(min_match_len=1.5), "min_match_len must be a non-negative integer, got 1.5"),
    (DraftParams(max_match_len=True), "max_match_len must be a non-negative integer"),
    (DraftParams(sources=(REST, "nope")), r"unknown draft sources \['nope'\]"),
    (DraftParams(corpora="abc"), "corpora must be a sequence of names, got 'abc'"),
    (DraftParams(corpora=("a", 3)), "corpora must be a sequence of names"),
])
def test_each_field_is_checked_with_one_line(value, message):
    with pytest.raises(InvalidParams, match=message):
        value.check()
    with pytest.raises(InvalidParams, match=message):
        value.to_proto()


def test_an_unknown_source_on_the_wire_is_refused():
    with pytest.raises(InvalidParams, match=r"unknown draft sources \[9\]"):
        DraftParams.from_proto(draft_pb2.DraftParams(sources=[draft_pb2.SOURCE_REST, 9]))


def test_zero_and_empty_mean_the_defaults():
    p = DraftParams(sources=())
    assert p.source_set() == frozenset(DEFAULT_SOURCES) == {REST, PLD}
    assert DraftParams(sources=(LEARNED,)).source_set() == {LEARNED}
    filled = DraftParams(max_depth=5).with_defaults(64, 16)
    assert (filled.budget, filled.max_depth) == (64, 5)
    assert DraftParams(budget=3).replace(corpora=("x",)) == DraftParams(budget=3,
                                                                        corpora=("x",))


def test_the_value_is_frozen():
    with pytest.raises(AttributeError):
        DraftParams().budget = 3
