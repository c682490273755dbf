"""Merging REST and PLD trees: shared prefixes, kept sources, budget, best nodes first."""

from __future__ import annotations

from redraft.proto.tree import (
    PLD,
    REST,
    SOURCE_LABELS,
    Tree,
    merge,
    source_bits,
    source_label,
)


def paths(draft):
    out = []
    for i, parent in enumerate(draft.parents):
        out.append((out[parent] if parent >= 0 else ()) + (draft.tokens[i],))
    return out


def by_path(draft):
    return dict(zip(paths(draft), zip(draft.probs, draft.sources)))


REST_D = Tree([1, 2, 3, 9], [-1, 0, 1, -1], [0.9, 0.8, 0.5, 0.1], [REST] * 4, match_len=6)
PLD_D = Tree([1, 2, 4, 5], [-1, 0, 1, -1], [0.6, 0.9, 0.7, 0.3], [PLD] * 4, match_len=3)


def test_shared_prefixes_merge_keep_the_higher_prob_and_name_both_sources():
    m = merge([REST_D, PLD_D], budget=100)
    m.validate()
    got = by_path(m)
    assert set(got) == {(1,), (1, 2), (1, 2, 3), (1, 2, 4), (9,), (5,)}
    assert got[(1,)] == (0.9, "pld+rest")
    assert got[(1, 2)] == (0.9, "pld+rest")
    assert got[(1, 2, 3)][1] == REST and got[(1, 2, 4)][1] == PLD
    assert m.match_len == 6
    assert merge([REST_D, PLD_D]) == merge([REST_D, PLD_D], budget=100)


def test_source_labels_round_trip_the_wire_bits():
    for label in (REST, PLD, "pld+rest"):
        assert source_label(source_bits(label)) == label
    assert source_bits("pld+rest") == source_bits(REST) | source_bits(PLD)
    assert source_label(0) == "unknown"
    # the table the client reads a reply's bits with: the same label for any value
    for bits in range(-9, 300):
        assert SOURCE_LABELS[bits & 7] == source_label(bits)


def test_budget_keeps_highest_path_probabilities():
    m = merge([REST_D, PLD_D], budget=3)
    m.validate()
    assert set(paths(m)) == {(1,), (1, 2), (1, 2, 4)}  # path probs .9, .81, .567
    assert abs(m.expected_accepted - (0.9 + 0.81 + 0.567)) < 1e-6


def test_parents_precede_children_and_empty_inputs():
    m = merge([PLD_D, REST_D], budget=5)
    m.validate()
    assert len(merge([], 8)) == 0
    assert len(merge([Tree(), Tree()], 8)) == 0
    assert len(merge([REST_D], 0)) == 0


def test_prune_is_a_closed_tree_under_ties():
    d = Tree([1, 2, 3, 4], [-1, 0, 1, 2], [1.0, 1.0, 1.0, 1.0], [REST] * 4)
    s = d.prune(2)
    assert paths(s) == [(1,), (1, 2)]


