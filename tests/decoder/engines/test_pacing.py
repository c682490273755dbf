"""The rule that decides how many drafts pay: a cost fit, calibration, choice and back-off."""

from __future__ import annotations

from redraft.decoder.engines.pacing import ChainPacer, CostFit
from redraft.decoder.policy import Calibrator


def test_cost_fit_recovers_a_line_and_is_flat_until_two_sizes_are_seen():
    fit = CostFit()
    assert fit.cost(1) == fit.cost(32) == 1.0
    for _ in range(10):
        fit.observe(1, 0.010)
    assert fit.slope() is None and abs(fit.cost(16) - 0.010) < 1e-12  # flat: nothing learned
    for n in (2, 4, 8, 16):
        fit.observe(n, 0.010 + 0.011 * (n - 1))
    assert abs(fit.slope() - 0.011) < 1e-9
    assert abs(fit.cost(1) - 0.010) < 1e-9 and abs(fit.cost(32) - 0.351) < 1e-9
    fit.observe(0, 1.0)  # nonsense observations are ignored
    fit.observe(3, -1.0)
    assert abs(fit.slope() - 0.011) < 1e-9


def test_calibration_moves_towards_what_the_target_accepted():
    cal = Calibrator()  # the loop's, fed the chains an engine verified
    assert abs(cal.calibrated([0.85], ["rest"])[0] - 0.85) < 1e-9  # the prior: the estimate
    for _ in range(50):  # 0.85-estimates of rest are never accepted
        cal.observe_chain([0.85, 0.85], ["rest", "rest"], accepted=0)
    assert cal.calibrated([0.85], ["rest"])[0] < 0.05
    assert abs(cal.calibrated([0.85], ["pld"])[0] - 0.85) < 1e-9  # other sources untouched
    cal.observe_chain([0.3, 0.3, 0.3], ["pld"] * 3, accepted=3)  # all three tried and accepted
    bins = cal._get("pld")
    assert bins.trials[3] == 2.0 + 3 and bins.hits[3] == 0.35 * 2 + 3


def feed(pacer: ChainPacer, seconds_for, n_calls: int, probs, sources, accept) -> list[int]:
    """Simulate an engine: each call the pacer picks L drafts of the chain, the forward of
    1 + L tokens takes seconds_for(1 + L), and `accept(L)` of them come back accepted."""
    chosen = []
    for _ in range(n_calls):
        if not pacer.wants_drafts():
            chosen.append(-1)  # skipped: the drafter is not even asked
            pacer.forward(1, seconds_for(1))
            continue
        k = pacer.choose(probs, sources)
        chosen.append(k)
        pacer.forward(1 + k, seconds_for(1 + k))
        if k:
            pacer.verified(probs[:k], sources[:k], accept(k))
    return chosen


def test_flat_costs_draft_everything_that_may_be_accepted():
    pacer = ChainPacer(max_drafts=8)
    probs, sources = [0.6] * 12, ["rest"] * 12
    chosen = feed(pacer, lambda n: 0.01, 40, probs, sources, lambda k: k // 2)
    # the first call drafts (nothing measured), the second is a plain forward that times the
    # slope, then drafts go out every call
    assert chosen[:2] == [8, 0] and all(k == 8 for k in chosen[2:])


def test_compute_bound_costs_stop_drafting_and_back_off():
    pacer = ChainPacer(max_drafts=16)
    probs, sources = [0.5] * 16, ["pld"] * 16
    # a llama.cpp-on-CPU-like curve: every extra token costs as much as the first
    chosen = feed(pacer, lambda n: 0.01 * n, 400, probs, sources, lambda k: 1 if k > 1 else 0)
    assert chosen[0] == 16  # nothing measured yet: assume drafts are free, and measure
    tail = chosen[100:]
    assert all(k <= 0 for k in tail)  # drafting stopped
    assert tail.count(-1) > 0.8 * len(tail)  # and mostly the drafter is not even asked


def test_near_certain_long_drafts_still_pay_on_a_compute_bound_curve():
    pacer = ChainPacer(max_drafts=16)
    probs, sources = [0.99] * 16, ["rest"] * 16
    chosen = feed(pacer, lambda n: 0.01 + 0.004 * (n - 1), 200, probs, sources, lambda k: k)
    assert all(k == 16 for k in chosen[50:])


def test_an_accepted_draft_resets_the_back_off():
    pacer = ChainPacer(max_drafts=4)
    pacer.idle.length = 512
    pacer.verified([0.9], ["rest"], accepted=1)
    assert pacer.idle.length == 0


def test_not_adaptive_always_hands_out_the_chain():
    pacer = ChainPacer(max_drafts=3, adaptive=False)
    chosen = feed(pacer, lambda n: 0.01 * n, 50, [0.1] * 5, ["pld"] * 5, lambda k: 0)
    assert chosen == [3] * 50


def test_a_lookup_dearer_than_its_gain_backs_off_while_still_using_this_calls_draft():
    pacer = ChainPacer(max_drafts=4)
    for n in (1, 5):  # a flat curve: drafts are free
        for _ in range(5):
            pacer.forward(n, 0.010)
    probs, sources = [0.3] * 4, ["pld"] * 4
    assert pacer.choose(probs, sources) == 4  # without lookup cost: worth it
    pacer.drafted(0.050)  # but each lookup takes 5 forwards' time (moving average: 0.005)
    for _ in range(20):
        pacer.drafted(0.050)
    chosen = [pacer.choose(probs, sources) for _ in range(pacer.patience)]
    assert chosen == [4] * pacer.patience  # the lookup is paid already: use its drafts
    assert not pacer.wants_drafts()  # but stop looking up for a while
