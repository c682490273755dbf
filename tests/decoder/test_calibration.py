"""The calibrator: drafters' probabilities corrected per source from what the target accepted,
and kept across processes."""

from __future__ import annotations

import pytest
from redraft.decoder.acceptance import Acceptance
from redraft.decoder.budget import CostModel
from redraft.decoder.calibration import Calibrator
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
