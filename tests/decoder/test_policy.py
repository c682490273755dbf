"""The shared policy: the calibrator (drafters' probabilities corrected per source from what the
target accepted, kept across processes) and the budget's rule, for trees and chains alike."""

from __future__ import annotations

import pytest
from redraft.decoder.acceptance import Acceptance
from redraft.decoder.budget import CostModel
from redraft.decoder.policy import Calibrator, best_prefix
from redraft.proto.tree import Tree

from .conftest import CPU_COST


def chain(probs, source="pld") -> Tree:
    return Tree(list(range(10, 10 + len(probs))), list(range(-1, len(probs) - 1)), list(probs),
                [source] * len(probs))

def test_calibrator_learns_that_a_source_never_hits():
    cal = Calibrator()
    cpu = CostModel(*CPU_COST)
    raw = chain([0.9] * 8, source="rest")
    assert len(cpu.choose(cal.apply(raw))) > 0
    for _ in range(30):  # the target rejects the first node every time
        tree = cal.apply(raw)
        cal.observe(raw, tree, Acceptance(nodes=[], tokens=[1]))
    assert len(cpu.choose(cal.apply(raw))) == 0
    assert cal.rate("rest") < 0.2
    # another source is unaffected
    assert len(cpu.choose(cal.apply(chain([0.9] * 8, source="pld")))) > 0


def test_calibrator_learns_a_reliable_source():
    cal = Calibrator()
    raw = chain([0.35] * 6)
    for _ in range(40):
        tree = cal.apply(raw)
        cal.observe(raw, tree, Acceptance(nodes=list(range(6)), tokens=list(range(7))))
    assert min(cal.apply(raw).probs) > 0.9


def test_calibration_persists_and_old_counts_fade(tmp_path):
    cal = Calibrator()
    raw = chain([0.95] * 4, source="rest")
    for _ in range(1000):
        cal.observe(raw, cal.apply(raw), Acceptance(nodes=[], tokens=[1]))
    path = tmp_path / "cal.json"
    cal.save(path, max_trials=100)
    again = Calibrator()
    assert again.load(path)
    assert again.apply(raw).probs[0] == pytest.approx(cal.apply(raw).probs[0], rel=1e-6)
    assert sum(again._get("rest").trials) < 200  # scaled down: new evidence still counts
    assert not Calibrator().load(tmp_path / "missing.json")


def test_a_chain_is_calibrated_as_the_same_tree_is():
    tree_cal, chain_cal = Calibrator(), Calibrator()
    raw = chain([0.9, 0.6, 0.35, 0.2, 0.05], source="rest")
    for accepted in (0, 1, 3, 5, 2):
        tree_cal.observe(raw, tree_cal.apply(raw), Acceptance(nodes=list(range(accepted)),
                                                              tokens=[1] * (accepted + 1)))
        chain_cal.observe_chain(raw.probs, raw.sources, accepted)
    assert chain_cal.to_json() == tree_cal.to_json()
    assert chain_cal.calibrated(raw.probs, raw.sources) == tree_cal.apply(raw).probs
    assert chain_cal.rate("rest") == tree_cal.rate("rest") > 0


def test_the_budget_rule_is_best_prefix():
    cpu = CostModel(*CPU_COST)
    for probs in ([0.9] * 8, [0.5] * 8, [0.2] * 8, [0.99, 0.99, 0.1, 0.9]):
        raw = chain(probs)
        k, expected = best_prefix(raw.path_probs(), cpu.cost, cpu.min_gain)
        assert cpu.select(raw) == list(range(k))
        assert expected == pytest.approx(sum(raw.path_probs()[:k]))
    # a chain that cannot beat plain decoding by min_gain is not drafted at all
    assert best_prefix(chain([0.2] * 8).path_probs(), cpu.cost, min_gain=0.5) == (0, 0.0)
    # side rows are paid in every forward; the caller's overhead makes a tree relatively cheaper
    steep = CostModel([1, 2, 3, 9], [1.0, 2.0, 2.2, 2.4])
    assert best_prefix([0.5], steep.cost, 0.0)[0] == 0  # 1.5 tokens for twice the time
    assert best_prefix([0.5], steep.cost, 0.0, fixed=1)[0] == 1  # beside a side row: 1.1x
    assert best_prefix([0.5], steep.cost, 0.0, overhead=10.0)[0] == 1
