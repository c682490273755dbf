"""`RedraftProposer` hands each row only the drafts that pay in a batched engine.

The rule (`pacing.BatchPacer`) is tested alone, then through the proposer driven exactly as
vLLM's GPU model runner drives a custom proposer (vllm/v1/worker/gpu_model_runner.py,
`GPUModelRunner.propose_draft_token_ids`: one `propose(sampled_token_ids,
input_batch.num_tokens_no_spec, input_batch.token_ids_cpu, slot_mappings=...)` per step for
every row of the persistent batch, after `_bookkeeping_sync` booked the step's sampled
tokens; `test_vllm.engine_step` does exactly that). The engine here is the test's: each step
takes a + b * (tokens verified) seconds (slept, so the proposer measures it as it measures a
real engine's), and its sampler accepts each drafted token that matches the row's text with
probability `q` (1: greedy over a text the drafts come from; below 1: a sampler that rejects
plausible drafts, as sampling at a temperature does). The drafts come from a real
`redraft serve` over a datastore holding the rows' texts.
"""

from __future__ import annotations

import random
import shutil
import time

import pytest
from redraft.datastore.service.client import DraftClient
from redraft.decoder.engines.pacing import BackOff, BatchPacer, RateGuard

from ..conftest import have_default_model
from .conftest import QUESTIONS
from .test_vllm import InputBatch, create_proposer, engine_step, vllm_config


def timed_pacer(a: float, b: float, sizes=(4, 8, 12, 24)) -> BatchPacer:
    pacer = BatchPacer()
    for _ in range(3):
        for n in sizes:
            pacer.forward(n, a + b * n, drafted=n > sizes[0])
    return pacer


def test_flat_cost_drafts_every_node_of_every_row():
    pacer = timed_pacer(0.020, 0.0)  # a GPU-like step: its tokens cost nothing more
    chains = [([0.6] * 5, ["rest"] * 5), ([0.3] * 3, ["pld"] * 3)]
    assert pacer.choose(chains, rows=4) == [5, 3]


def test_steep_cost_drafts_nothing_unlikely():
    pacer = timed_pacer(0.001, 0.004)  # a CPU-like step: each token as dear as a row
    chains = [([0.5] * 5, ["rest"] * 5)] * 4
    assert pacer.choose(chains, rows=4) == [0, 0, 0, 0]


def test_rows_get_drafts_by_their_own_chances():
    pacer = timed_pacer(0.040, 0.002)
    sure, unsure = ([0.95] * 5, ["learned"] * 5), ([0.2] * 5, ["rest"] * 5)
    keep = pacer.choose([sure, unsure, sure], rows=8)
    assert keep[0] == keep[2] == 5 and keep[1] == 0
    for _ in range(40):  # the target never takes learned drafts: calibration learns it
        pacer.verified([0.95] * 5, ["learned"] * 5, 0)
    assert pacer.choose([sure], rows=8) == [0]


def test_a_step_with_drafts_that_costs_a_jump_more_gets_none():
    """A step that runs another kernel once any row has drafts: 8 rows plain cost 100 ms,
    with drafts 200 ms + 2 ms a token. The line through both kinds of step promises drafts
    of 0.7 a gain; the fits apart see they lose (24 drafts: 20.3 tokens in 264 ms against
    8 in 100)."""
    pacer = BatchPacer()
    for _ in range(10):
        for n in (8, 12, 16, 24, 32):
            pacer.forward(n, 0.100 if n == 8 else 0.200 + 0.002 * n, drafted=n > 8)
    chains = [([0.7] * 3, ["rest"] * 3)] * 8
    assert pacer.choose(chains, rows=8) == [0] * 8
    line = BatchPacer(cost=pacer.cost, calibration=pacer.calibration)  # one line only
    assert sum(line.choose(chains, rows=8)) > 0


def test_a_slope_is_measured_before_drafts_are_costed():
    pacer = BatchPacer()
    chain = ([0.9] * 4, ["rest"] * 4)
    assert pacer.choose([chain], rows=2) == [4]  # no timing yet: draft, then time it
    pacer.forward(6, 0.030, drafted=True)
    assert pacer.choose([chain], rows=2) == [0]  # one size timed: a plain step next
    pacer.forward(2, 0.022, drafted=False)
    assert pacer.choose([chain], rows=2) == [4]  # 18 ms a step + 2 ms a token: pays
    assert BatchPacer(adaptive=False).choose([chain, chain], rows=9) == [4, 4]


def test_a_back_off_doubles_on_every_run_of_failures_and_starts_over_on_a_success():
    wait = BackOff(patience=3, first=4, most=16)

    def waits() -> int:
        n = 0
        while wait.skipping():
            n += 1
        return n

    for expected in (4, 8, 16, 16):
        for _ in range(2):
            wait.failed()
        wait.passed()  # a run broken: no back-off
        assert waits() == 0
        for _ in range(3):
            wait.failed()
        assert waits() == expected
    wait.succeeded()
    for _ in range(3):
        wait.failed()
    assert waits() == 4


def test_the_rate_guard_judges_drafted_steps_against_plain_ones_in_the_same_time():
    guard = RateGuard(patience=4)
    for _ in range(3):  # 16 rows: plain makes 16 tokens in 52 ms; drafted, 24 in 150 ms
        guard.observe(24, 0.150, 16 / 0.052)
        assert not guard.losses.skipping()  # not judged before `patience` steps
    guard.observe(24, 0.150, 16 / 0.052)
    assert guard.losses.skip == guard.losses.first
    guard.losses.skip = 0
    for _ in range(4):  # a win: 28 tokens in 60 ms
        guard.observe(28, 0.060, 16 / 0.052)
    assert guard.losses.skip == 0 and guard.losses.length == 0
    for seconds in (0.060, 0.060, 0.500, 0.060):  # one step a busy machine stalled
        guard.observe(28, seconds, 16 / 0.052)
    assert guard.losses.skip == 0


def test_drafted_steps_that_made_less_than_plain_ones_turn_drafting_off_for_a_while():
    """The model says drafts pay (flat cost, 90% drafts), but the drafted 16-row steps made
    no more than their rows in 60 ms where plain ones make as many in 52 ms: after
    `patience` such steps no row is drafted (nor the drafter asked) for a while. Fewer rows
    are judged apart: what loses at 16 rows may pay at 2."""
    pacer = timed_pacer(0.052, 0.0, sizes=(16, 20, 24, 32))
    chains = [([0.9] * 2, ["rest"] * 2)] * 4
    guard = pacer.guard(16)
    for _ in range(guard.patience):
        assert pacer.wants_drafts(16) and pacer.choose(chains, rows=16) == [2] * 4
        pacer.forward(24, 0.060, drafted=True, rows=16, made=16)
    assert [pacer.wants_drafts(16) for _ in range(guard.losses.first + 1)] == \
        [False] * guard.losses.first + [True]
    assert pacer.choose(chains, rows=16) == [2] * 4  # tried again
    assert pacer.wants_drafts(2) and pacer.choose(chains, rows=2) == [2] * 4


def test_drafted_steps_that_made_more_keep_drafting_and_plain_steps_stay_timed():
    pacer = timed_pacer(0.052, 0.0, sizes=(16, 20, 24, 32))
    chains = [([0.9] * 2, ["rest"] * 2)] * 4
    handed = []
    for _ in range(3 * (pacer.stale_after + 1)):
        keep = pacer.choose(chains, rows=16) if pacer.wants_drafts(16) else [0] * 4
        handed.append(sum(keep))
        pacer.forward(16 + sum(keep), 0.060 if keep[0] else 0.052, drafted=keep[0] > 0,
                      rows=16, made=28 if keep[0] else 16)
    plain = [i for i, n in enumerate(handed) if n == 0]
    # drafting won, so no back-off: only a plain step after every stale_after drafted ones
    assert len(plain) == 3 and plain[0] <= pacer.stale_after
    assert all(b - a == pacer.stale_after + 1 for a, b in zip(plain, plain[1:]))


def test_steps_that_draft_nothing_ask_the_drafter_ever_less_often():
    pacer = timed_pacer(0.020, 0.002)  # a draft costs a tenth of a 4-row step
    chains = [([0.3] * 5, ["pld"] * 5)] * 4  # too unlikely for that
    asked = []
    for _ in range(200):
        ask = pacer.wants_drafts(4)
        asked.append(ask)
        if ask:
            assert pacer.choose(chains, rows=4) == [0] * 4
    assert sum(asked[100:]) < 0.25 * 100
    sure = [([0.99] * 5, ["learned"] * 5)] * 4  # drafts that pay even there
    while not pacer.wants_drafts(4):
        pass
    assert sum(pacer.choose(sure, rows=4)) > 0
    assert all(pacer.wants_drafts(4) for _ in range(pacer.idle.patience))  # every step again


class Engine:
    """The test's engine over a real proposer: rows replay `texts` (module docstring)."""

    def __init__(self, proposer, texts: list[tuple[list[int], list[int]]], rows: int,
                 a: float, b: float, q: float, seed: int = 0) -> None:
        self.proposer, self.texts = proposer, texts
        self.a, self.b, self.q = a, b, q
        self.rng = random.Random(seed)
        self.batch = InputBatch(max_num_reqs=rows, max_model_len=512)
        self.rows = rows
        self.made: dict[str, int] = {}
        self.text: dict[str, list[int]] = {}
        self.next_id = 0
        self.simulated = 0.0  # the engine's seconds: sum of a + b * tokens over steps
        self.produced = 0

    def cost(self, tokens: int) -> float:
        return self.a + self.b * tokens

    def run(self, steps: int) -> list[tuple[int, int]]:
        """(drafted tokens handed out, offered by the service) per step."""
        drafts: dict[str, list[int]] = {}
        out = []
        for _ in range(steps):
            sampled = {}
            for rid in list(self.batch.req_ids):
                if rid is None:
                    continue
                text, made = self.text[rid], self.made[rid]
                a = 0
                for t in drafts.get(rid, []):
                    if made + a < len(text) and t == text[made + a] and self.rng.random() < self.q:
                        a += 1
                    else:
                        break
                sampled[rid] = text[made:made + a + 1]
                self.made[rid] = made + len(sampled[rid])
                self.produced += len(sampled[rid])
            for rid in [r for r in self.batch.req_ids if r and self.made[r] >= len(self.text[r])]:
                self.batch.remove_request(rid)
                sampled.pop(rid)
            self.batch.condense()
            while self.batch.num_reqs < self.rows:  # a new request joins: its prompt only
                prompt, answer = self.texts[self.next_id % len(self.texts)]
                rid = f"r{self.next_id}"
                self.next_id += 1
                self.batch.add_request(rid, prompt)
                self.text[rid], self.made[rid] = prompt + answer, len(prompt)
                sampled[rid] = []  # its prefill ran in this step
            tokens = self.batch.num_reqs + sum(len(d) for d in drafts.values())
            seconds = self.cost(tokens)
            self.simulated += seconds
            time.sleep(seconds)
            offered_before = self.proposer.stats["offered_tokens"]
            drafted_before = self.proposer.stats["drafted_tokens"]
            drafts = engine_step(self.proposer, self.batch, sampled)
            out.append((self.proposer.stats["drafted_tokens"] - drafted_before,
                        self.proposer.stats["offered_tokens"] - offered_before))
        return out

    def plain_rate(self) -> float:
        return self.rows / self.cost(self.rows)


@pytest.mark.skipif(not have_default_model(), reason="default model not installed")
def test_a_costly_engine_whose_sampler_rejects_drafts_gets_none(service, plain_answers):
    """The known bad case: drafts offered on almost every row, few accepted, and a CPU that
    pays for every verified token. The proposer soon hands out (almost) nothing, so the
    engine runs at plain speed."""
    texts = [plain_answers[q] for q in QUESTIONS[:3]]  # their answers are in the datastore
    proposer = create_proposer(vllm_config(5))
    engine = Engine(proposer, texts, rows=4, a=0.002, b=0.003, q=0.25)
    steps = engine.run(120)
    late = steps[60:]
    offered = sum(o for _, o in late)
    assert offered > 60 * 4  # the service kept offering chains
    assert sum(d for d, _ in late) <= 0.05 * offered
    assert engine.produced / engine.simulated >= 0.9 * engine.plain_rate()
    assert proposer.stats["errors"] == 0
    proposer.close()


@pytest.mark.skipif(not have_default_model(), reason="default model not installed")
def test_a_cheap_engine_whose_sampler_accepts_drafts_gets_whole_chains(service, plain_answers):
    texts = [plain_answers[q] for q in QUESTIONS[:3]]
    proposer = create_proposer(vllm_config(5))
    engine = Engine(proposer, texts, rows=4, a=0.012, b=0.0002, q=1.0)
    steps = engine.run(80)
    late = steps[30:]
    offered = sum(o for _, o in late)
    assert offered > 0 and sum(d for d, _ in late) >= 0.8 * offered
    assert engine.produced / engine.simulated >= 1.5 * engine.plain_rate()
    assert proposer.stats["accepted_tokens"] > 0
    assert proposer.stats["accepted_by_source"]  # counted per source
    proposer.close()


@pytest.mark.skipif(not have_default_model(), reason="default model not installed")
def test_steps_the_service_is_not_asked_still_reach_it_whole(monkeypatch, servers, tmp_path,
                                                             answers_store, plain_answers):
    """A costly engine whose sampler takes no draft: the proposer soon stops asking the
    service for drafts at most steps, and sends those steps' tokens without waiting for the
    reply. Drafts never change what a row makes here, so the same requests finish as under
    a proposer that asks at every step, and the service must have learned exactly as much
    from both, and held as many sequences open. (Each service has a copy of the datastore:
    a service reads the outputs learned over its datastore before.)"""
    texts = [plain_answers[q] for q in QUESTIONS[:3]]
    runs = {}
    for adaptive in ("1", "0"):
        store = shutil.copytree(answers_store, tmp_path / adaptive)
        serve = servers.start(str(store), "--port", "0", "--learn-persist-seconds", "0")
        monkeypatch.setenv("REDRAFT_SERVICE", serve.address)
        monkeypatch.setenv("REDRAFT_ADAPTIVE", adaptive)
        monkeypatch.setenv("REDRAFT_LEARN", "1")
        monkeypatch.delenv("REDRAFT_DATASTORE", raising=False)
        proposer = create_proposer(vllm_config(5))
        engine = Engine(proposer, texts, rows=4, a=0.002, b=0.003, q=0.0)
        engine.run(150)
        time.sleep(0.5)  # the last step's call, not waited for, is served
        stats = DraftClient(serve.address).stats()
        proposer.close()
        runs[adaptive] = (stats["learned_docs"], stats["learned_tokens"],
                          stats["sessions_opened"], stats["sessions_active"],
                          proposer.stats["unasked_steps"], engine.next_id)
    unasked, always = runs["1"], runs["0"]
    assert always[4] == 0 and unasked[4] > 50  # most steps not asked for drafts...
    assert unasked[5] == always[5] > 8  # ...as many requests started (and all but 4 ended)
    assert unasked[:4] == always[:4]  # ...every token learned, every sequence opened once
