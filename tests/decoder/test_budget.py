"""Tree budgets follow the hardware's cost curve and the drafts' calibrated probabilities."""

from __future__ import annotations

import json
import time

import pytest
from redraft.decoder.budget import CostModel
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.generate import Generator
from redraft.proto.models import load_tokenizer
from redraft.proto.tree import Tree

from .conftest import CPU_COST, tiny_model


def chain(probs, source="pld") -> Tree:
    return Tree(list(range(10, 10 + len(probs))), list(range(-1, len(probs) - 1)), list(probs),
                [source] * len(probs))


def test_flat_gpu_curve_drafts_more_than_steep_cpu_curve():
    tree = chain([0.8] * 30)
    gpu = CostModel([1, 64], [0.02, 0.021])
    cpu = CostModel(*CPU_COST)
    steep = CostModel([1, 2, 4, 8], [1.0, 1.5, 2.5, 4.5])
    n_gpu, n_cpu, n_steep = (len(c.choose(tree)) for c in (gpu, cpu, steep))
    assert n_gpu >= 20 and 0 < n_cpu < n_gpu and n_steep < n_cpu


def test_a_fixed_tree_keeps_its_best_nodes_whatever_the_forwards_cost():
    tree = chain([0.9, 0.8, 0.4, 0.2, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05])
    flat = CostModel.flat(6)
    assert flat.max_nodes == 6 and flat.describe()["source"] == "flat"
    assert flat.select(tree) == tree.best_nodes()[:6] == list(range(6))
    assert len(CostModel(*CPU_COST).choose(tree)) < 6  # the CPU curve keeps fewer
    for _ in range(flat.window * 3):  # timed forwards never correct a fixed tree
        flat.observe(7, 5.0)
        flat.observe(1, 0.01)
    assert flat.corrections == 0 and flat.cost(7) == flat.cost(1)
    with pytest.raises(ValueError):
        CostModel.flat(0)


def test_choice_maximises_expected_tokens_per_second():
    cpu = CostModel(*CPU_COST)
    tree = chain([0.9, 0.9, 0.5, 0.5, 0.3, 0.3, 0.2, 0.2, 0.1])
    pp = tree.path_probs()
    best = max(range(len(tree) + 1), key=lambda k: (1 + sum(pp[:k])) / cpu.cost(k + 1))
    assert len(cpu.choose(tree)) == best


def test_hopeless_drafts_get_no_budget():
    cpu = CostModel(*CPU_COST)
    assert len(cpu.choose(chain([0.01] * 16))) == 0
    assert len(cpu.choose(Tree())) == 0


def test_cost_curve_interpolates_and_prefers_cheaper_bigger_forwards():
    c = CostModel([1, 4, 16], [1.0, 2.0, 3.0])
    assert c.cost(10) == 2.5 and c.cost(28) == 4.0 and c.relative(16) == 3.0
    # 3 tokens cost more than 4 on `quirky`: the chooser then adds a weak third node
    # (4 tokens) rather than stopping at two; on a smooth curve it stops at two.
    tree = chain([0.9, 0.9, 0.05])
    assert len(CostModel([1, 2, 3, 4], [1.0, 1.5, 2.0, 2.1]).choose(tree)) == 2
    assert len(CostModel([1, 2, 3, 4], [1.0, 1.5, 2.0, 1.6]).choose(tree)) == 3


def test_cost_curve_is_measured_once_and_cached(tmp_path):
    model = tiny_model("llama")
    curve = CostModel.for_model(model, "tiny", directory=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and curve.sizes[0] == 1 and all(s > 0 for s in curve.seconds)
    data = json.loads(files[0].read_text())
    data["seconds"] = [7.0] * len(data["seconds"])
    files[0].write_text(json.dumps(data))
    again = CostModel.for_model(model, "tiny", directory=tmp_path)
    assert again.seconds == [7.0] * len(curve.sizes)  # read from the cache, not re-measured


def test_a_per_step_overhead_makes_bigger_trees_worth_it():
    cpu = CostModel(*CPU_COST)
    tree = chain([0.7] * 20)
    pp = tree.path_probs()
    overhead = 0.03
    best = max(range(len(tree) + 1),
               key=lambda k: (1 + sum(pp[:k])) / (cpu.cost(k + 1) + overhead))
    assert len(cpu.choose(tree, overhead=overhead)) == best > len(cpu.choose(tree))


def test_side_rows_count_in_the_cost_and_the_cap_not_in_the_tokens():
    cpu = CostModel(*CPU_COST)
    tree = chain([0.7] * 20)
    pp = tree.path_probs()
    fixed = 8
    best = max(range(len(tree) + 1),
               key=lambda k: (1 + sum(pp[:k])) / cpu.cost(1 + fixed + k))
    assert len(cpu.choose(tree, fixed=fixed)) == best
    assert len(cpu.choose(tree, max_nodes=12, fixed=fixed)) <= 4
    assert len(cpu.choose(tree, max_nodes=8, fixed=fixed)) == 0


class SlowPLD(PLDDrafter):
    """Prompt lookup taking 5 ms more per proposal: time spent outside the target's forward."""

    def propose(self, context, budget):
        time.sleep(0.005)
        return super().propose(context, budget)


def test_generator_learns_the_loops_overhead_per_step():
    # a pessimistic curve that is never corrected: the clip (one plain forward) never binds
    curve = CostModel([1, 64], [1.0, 2.0], window=10**6)
    gen = Generator(tiny_model(), load_tokenizer(None), SlowPLD(), cost=curve)
    r = gen.generate([5, 9, 14, 3], max_new_tokens=40, eos=False)
    assert 0 < r.stats.forward_seconds < r.stats.seconds
    # 5 ms per step outside the forward, learned by a running average over ~40 steps
    assert 0.002 < gen.step_overhead < 1.0


def test_timed_forwards_correct_a_pessimistic_curve_everywhere():
    true = CostModel([1, 2, 4, 8, 16, 64], [0.02, 0.021, 0.023, 0.027, 0.035, 0.09])
    busy = CostModel(true.sizes, [3 * s for s in true.seconds])  # measured on a busy machine
    for i in range(busy.window * 3):
        for n in (1, 4):  # the sizes decoding used: load only ever adds time
            busy.observe(n, true.cost(n) * (1.0 + 0.5 * (i % 3)))
    assert busy.corrections >= 1
    for n in (1, 4):
        assert busy.cost(n) == pytest.approx(true.cost(n), rel=0.01)
    # sizes no forward reached move with their observed neighbours: the shape is kept
    for n in (8, 16, 64):
        assert busy.cost(n) == pytest.approx(true.cost(n), rel=0.01)
    # ... and an agreeing curve is left alone
    steady = CostModel(true.sizes, list(true.seconds))
    for i in range(steady.window * 4):
        steady.observe(2, true.cost(2) * (1.0 + 0.1 * (i % 2)))
    assert steady.corrections == 0 and steady.seconds == true.seconds


def test_a_curve_cached_while_busy_is_corrected_and_written_back(tmp_path):
    model = tiny_model("llama")
    measured = CostModel.for_model(model, "tiny-busy", directory=tmp_path)
    assert measured.source == "measured" and measured.measure_seconds > 0
    path = measured.path
    data = json.loads(path.read_text())
    data["seconds"] = [100 * s for s in data["seconds"]]  # as if measured under heavy load
    path.write_text(json.dumps(data))
    busy = CostModel.for_model(model, "tiny-busy", directory=tmp_path)
    assert busy.source == "cached" and busy.cost(1) == pytest.approx(100 * measured.cost(1))
    # max_nodes=0: every step is a one-token forward, each one timed
    gen = Generator(model, load_tokenizer(None), PLDDrafter(), cost=busy, max_nodes=0)
    gen.generate([5, 9, 14, 3], max_new_tokens=4 * busy.window, eos=False)
    assert busy.corrections >= 1 and busy.cost(1) < 25 * measured.cost(1)
    again = CostModel.for_model(model, "tiny-busy", directory=tmp_path)
    assert again.source == "cached" and again.seconds == pytest.approx(busy.seconds)
