"""The step rule: one rule with one message for each refusal, whichever way a step comes. The
packed form (`check_steps`, over a call's arrays) is checked against the scalar one
(`check_step`, a Session's step and a Batch step entry) on random batches: the same steps
refused, each with the same code and message."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from redraft.datastore.service.config import ServiceConfig
from redraft.datastore.service.refusals import Refusal
from redraft.datastore.service.validation import RequestValidator


def _validator(vocab: int, max_budget: int, max_context: int) -> RequestValidator:
    reader = SimpleNamespace(vocab_size=vocab, tokenizer_fingerprint="fp")
    return RequestValidator(reader, ServiceConfig(max_budget=max_budget,
                                                  max_context_len=max_context))


def test_a_step_is_refused_for_its_first_broken_part_with_one_message():
    checks = _validator(512, 100, 40)
    assert checks.check_step([1, 2, 3], 100, 37) == 40
    assert checks.check_step([], 0, 40) == 40
    cases = [  # (accepted, budget, held): the code and message
        ([1, 515, 600], 101, 50, grpc.StatusCode.INVALID_ARGUMENT,
         "step.accepted: token id 600 is outside the vocabulary [0, 512)"),
        ([-3, 1], 0, 0, grpc.StatusCode.INVALID_ARGUMENT,
         "step.accepted: token id -3 is outside the vocabulary [0, 512)"),
        ([1], 101, 50, grpc.StatusCode.INVALID_ARGUMENT,
         "step.budget 101 exceeds the server's max_budget 100"),
        ([1, 2], 100, 39, grpc.StatusCode.RESOURCE_EXHAUSTED,
         "context would reach 41 tokens, over max_context_len 40"),
    ]
    for accepted, budget, held, code, message in cases:
        with pytest.raises(Refusal) as exc:
            checks.check_step(accepted, budget, held)
        assert (exc.value.code, exc.value.message) == (code, message)


def _random_call(rng: np.random.Generator):
    """A call's packed steps as the server unpacks them, with every part of the rule
    broken now and then: ids past the vocabulary (the wire's ids are unsigned), budgets
    past max_budget, contexts past max_context_len."""
    vocab = int(rng.integers(1, 600))
    max_budget = int(rng.integers(0, 100))
    max_context = int(rng.integers(0, 200))
    n = int(rng.integers(0, 40))
    counts = rng.integers(0, 12, n).astype(np.uint32)
    tokens = rng.integers(0, vocab, int(counts.sum())).astype(np.uint32)
    past = rng.random(len(tokens)) < rng.choice([0.0, 0.02, 0.2])
    tokens[past] = rng.integers(vocab, 1 << 32, int(past.sum()), dtype=np.uint64)
    budgets = None
    if rng.random() < 0.7:
        budgets = rng.integers(0, max_budget + 3, n).astype(np.uint32)
    held = rng.integers(0, max_context + 3, n).astype(np.int64)
    return _validator(vocab, max_budget, max_context), tokens, counts, budgets, held


def test_packed_steps_are_refused_as_each_step_alone_would_be():
    rng = np.random.default_rng(40)
    earlier = Refusal(grpc.StatusCode.NOT_FOUND, "refused before the rule")
    seen = set()
    for _ in range(300):
        checks, tokens, counts, budgets, held = _random_call(rng)
        n = len(counts)
        skipped = {i for i in range(n) if rng.random() < 0.1}  # e.g. duplicates, not held
        errors = dict.fromkeys(skipped, earlier)
        failed = checks.check_steps(tokens, counts, budgets, held, errors)
        assert len(failed) == len(set(failed)) and not skipped & set(failed)
        ends = np.cumsum(counts, dtype=np.int64)
        for i in range(n):
            if i in skipped:
                assert errors[i] is earlier
                continue
            row = tokens[int(ends[i]) - int(counts[i]):int(ends[i])].tolist()
            budget = 0 if budgets is None else int(budgets[i])
            try:
                checks.check_step(row, budget, int(held[i]))
                expected = None
            except Refusal as exc:
                expected = (exc.code, exc.message)
                seen.add(exc.message.split(" ")[0])
            got = errors.get(i)
            assert (None if got is None else (got.code, got.message)) == expected, i
            assert (i in failed) == (expected is not None)
        assert set(errors) == skipped | set(failed)
    assert seen == {"step.accepted:", "step.budget", "context"}  # every part was broken
