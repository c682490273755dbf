"""SGLang's REDRAFT algorithm: the drafting object its NGRAM worker calls, driven as it calls it.

SGLang is not installed here (it needs a CUDA build of torch), so these tests play the part
of python/sglang/srt/speculative/ngram_worker.py (`NGRAMWorker`), whose class the REDRAFT
worker is: each decode step `_prepare_draft_tokens(batch)` calls
`self.ngram_cache.synchronize()`, builds, for each request of `batch.reqs` in order, its last
`max_match_window_size` tokens of `req.origin_input_ids + req.output_ids`
(`_efficient_concat_last_n`; unbounded in the REDRAFT worker, which also calls `expect` with
the batch's `rid`s from `forward_batch_generation`), then
`req_drafts, mask = self.ngram_cache.batch_get(batch_tokens)` and asserts
`len(req_drafts) == bs * draft_token_num`. The ids and mask go into int64 and bool tensors,
and sgl-kernel's `reconstruct_indices_from_tree_mask` takes a node's parent to be its
highest-numbered ancestor in its mask row. After verification `_update_ngram_cache` calls
`batch_put` with each request's last `branch_length` tokens; `clear_cache_pool` calls
`reset()`. The draft service is a real `redraft serve`; the target, in the greedy test, the
real default model.
"""

from __future__ import annotations

import logging
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import numpy as np
import pytest
from redraft.datastore.drafting import DraftSettings, new_session_drafter
from redraft.datastore.drafting.session_drafter import DEFAULT_PARAMS
from redraft.datastore.service.client import DraftClient
from redraft.decoder.engines.settings import EngineSettings
from redraft.decoder.engines.sglang import WHOLE_CONTEXT, RedraftNgramCache, register
from redraft.proto.tree import PLD, Tree

from ...conftest import free_port
from ..conftest import have_default_model
from .conftest import NEW_TOKENS, QUESTIONS, GreedySequence

pytestmark = pytest.mark.skipif(not have_default_model(), reason="default model not installed")

N = 12  # --speculative-num-draft-tokens (SGLang's default for NGRAM)
BRANCH_LENGTH = 18


def concat_last_n(seq1: list[int], seq2: list[int], n: int) -> list[int]:
    """The NGRAM worker's `_efficient_concat_last_n`: the last n tokens of seq1 + seq2."""
    if len(seq2) >= n:
        return seq2[-n:]
    return seq1[-(n - len(seq2)):] + seq2


def decode_step(cache: RedraftNgramCache, reqs: list) -> list[tuple[int, Tree]]:
    """One decode step's drafting as the REDRAFT worker runs it: (root token, tree) per
    request, the tree read back from SGLang's layout as its kernel reads it."""
    cache.expect([r.rid for r in reqs])  # the REDRAFT worker's forward_batch_generation
    cache.synchronize()
    batch_tokens = [concat_last_n(r.origin_input_ids, r.output_ids, WHOLE_CONTEXT)
                    for r in reqs]
    ids, mask = cache.batch_get(batch_tokens)
    bs = len(reqs)
    assert len(ids) == bs * N and ids.dtype == np.int64
    assert mask.shape == (bs * N * N,) and set(np.unique(mask)) <= {0, 1}
    out = []
    for b in range(bs):
        rows = mask[b * N * N:(b + 1) * N * N].reshape(N, N).astype(bool)
        node_ids = ids[b * N:(b + 1) * N].tolist()
        assert rows[0].tolist() == [True] + [False] * (N - 1)
        parents = []
        for i in range(1, N):
            assert rows[i, i] and not rows[i, i + 1:].any()
            up = int(np.flatnonzero(rows[i, :i])[-1])  # the highest ancestor: the parent
            assert rows[i, :i].tolist() == rows[up, :i].tolist()  # and all of its ancestors
            parents.append(up - 1)
        out.append((node_ids[0], Tree(node_ids[1:], parents, [0.5] * (N - 1),
                                      ["unknown"] * (N - 1))))
    return out


def put(cache: RedraftNgramCache, reqs: list) -> None:
    """The NGRAM worker's `_update_ngram_cache` after verification."""
    cache.batch_put([concat_last_n(r.origin_input_ids, r.output_ids, BRANCH_LENGTH)
                     for r in reqs])


def request(rid: str, prompt: list[int]):
    """The fields of SGLang's `Req` the worker reads."""
    return SimpleNamespace(rid=rid, origin_input_ids=list(prompt), output_ids=[])


def nodes_without_padding(tree: Tree, drafted: int) -> tuple[list[int], list[int]]:
    return tree.tokens[:drafted], tree.parents[:drafted]


def test_trees_are_the_services_in_sglangs_layout(service, plain_answers):
    cache = RedraftNgramCache.from_settings(N)
    source = cache.drafts.source
    assert source.params.budget == N - 1
    client = DraftClient(service.address, timeout=10)
    answers = {f"r{i}": plain_answers[q][1] for i, q in enumerate(QUESTIONS)}
    reqs = [request(f"r{i}", plain_answers[q][0]) for i, q in enumerate(QUESTIONS[:3])]
    handed_nodes = handed_trees = 0
    for step in range(8):
        if step == 3:
            reqs.reverse()  # the batch was filtered and merged: another order
        if step == 4:
            reqs = [r for r in reqs if r.rid != "r1"]  # r1 finished
            reqs.append(request("r3", plain_answers[QUESTIONS[3]][0]))
        drafted = decode_step(cache, reqs)
        for req, (root, tree) in zip(reqs, drafted):
            context = req.origin_input_ids + req.output_ids
            assert root == context[-1]
            want = client.propose(context, source.params, source.fingerprint())
            assert len(want) <= N - 1
            assert nodes_without_padding(tree, len(want)) == (want.tokens, want.parents)
            handed_nodes += len(want)
            handed_trees += len(want) > 0
            # padding: token 0 under the root, as SGLang's own NgramCache pads
            assert tree.tokens[len(want):] == [0] * (N - 1 - len(want))
            assert tree.parents[len(want):] == [-1] * (N - 1 - len(want))
        for req in reqs:  # the target accepted two tokens of each request
            answer = answers[req.rid]
            req.output_ids.extend(answer[len(req.output_ids):len(req.output_ids) + 2])
        put(cache, reqs)
    assert cache.drafts.calls == 8 and cache.stats["errors"] == 0
    assert cache.metrics.num_draft_tokens == handed_nodes > 0
    assert cache.metrics.drafts == handed_trees
    assert cache.metrics.steps == 8
    # The server saw one Batch call per decode step, drafting every request of it (3 a step);
    # r1 was ended on it when it had been absent for more than the grace steps.
    stats = client.stats()
    assert stats["batch_calls"] == 8 and stats["batch_steps"] == 8 * 3
    assert stats["sessions_active"] == 3 and len(cache.drafts._batch) == 3
    cache.reset()  # SGLang flushed its cache: every sequence ends
    assert len(cache.drafts._batch) == 0
    assert client.stats()["sessions_active"] == 0
    client.close()
    cache.close()


def test_without_request_ids_requests_are_told_apart_by_their_tokens(service, plain_answers):
    cache = RedraftNgramCache.from_settings(N)
    reqs = [request(f"r{i}", plain_answers[q][0]) for i, q in enumerate(QUESTIONS[:3])]
    for step in range(4):
        cache.synchronize()
        cache.batch_get([r.origin_input_ids + r.output_ids for r in reqs])  # no expect()
        assert len(cache.drafts._batch) == 3 and len(cache.rows) == 3
        for r in reqs:
            r.output_ids.append(plain_answers[QUESTIONS[int(r.rid[1:])]][1][step])
        reqs.reverse()
    cache.close()


def test_a_dead_service_gives_prompt_lookup_trees(monkeypatch, servers, answers_store,
                                                  plain_answers):
    serve = servers.start(answers_store, "--port", "0")
    monkeypatch.setenv("REDRAFT_SERVICE", serve.address)
    cache = RedraftNgramCache.from_settings(N)
    prompt = plain_answers[QUESTIONS[0]][0]
    req = request("r0", prompt + prompt[:4])  # its own tokens repeat: prompt lookup drafts
    decode_step(cache, [req])
    serve.kill()
    ((root, tree),) = decode_step(cache, [req])  # no exception: prompt lookup in process
    assert cache.drafts.source.failures == 1
    settings = DraftSettings(DEFAULT_PARAMS.replace(budget=N - 1, max_depth=N - 1,
                                                    sources=frozenset({PLD})))
    want = new_session_drafter(req.origin_input_ids, settings).propose()
    assert len(want) > 0
    assert nodes_without_padding(tree, len(want)) == (want.tokens, want.parents)
    cache.close()


@pytest.mark.slow
def test_greedy_tree_verification_equals_plain(service, default_model, plain_answers):
    """Each step the target verifies every request's tree (greedy: the longest path its
    argmax agrees with, plus the next argmax); requests leave when done."""
    model, _ = default_model
    cache = RedraftNgramCache.from_settings(N)
    reqs = [request(f"r{i}", plain_answers[q][0]) for i, q in enumerate(QUESTIONS)]
    seqs = {r.rid: GreedySequence(model, r.origin_input_ids) for r in reqs}
    for r in reqs:  # the prefill (extend) step samples the first token without drafts
        r.output_ids.extend(seqs[r.rid].step(Tree()))
    seen = 0  # accepted drafts of steps after which the request comes back to the cache
    while reqs:
        for req, (root, tree) in zip(reqs, decode_step(cache, reqs)):
            assert root == req.output_ids[-1] == seqs[req.rid].root
            made = seqs[req.rid].step(tree)
            req.output_ids.extend(made)
            seen += (len(made) - 1) * (len(req.output_ids) < NEW_TOKENS)
        put(cache, reqs)
        reqs = [r for r in reqs if len(r.output_ids) < NEW_TOKENS]
    for rid, seq in seqs.items():
        assert seq.output[:NEW_TOKENS] == plain_answers[QUESTIONS[int(rid[1:])]][1], rid
    accepted = sum(s.accepted for s in seqs.values())
    assert accepted >= NEW_TOKENS
    # The adapter's counters read what was accepted from how each request grew: every
    # accepted draft but those of a request's last step (it never comes back).
    assert cache.metrics.num_accepted_tokens == seen > 0
    assert cache.metrics.accepted_per_pos[0] > 0
    assert sum(s.forwards for s in seqs.values()) < len(QUESTIONS) * NEW_TOKENS
    cache.close()


def test_the_plugin_is_declared_and_needs_sglang_to_register(caplog):
    assert "redraft.decoder.engines.sglang:register" in [
        e.value for e in entry_points(group="sglang.srt.plugins")]
    assert "sglang" not in sys.modules  # nothing here imports SGLang
    with caplog.at_level(logging.WARNING, logger="redraft.engines"):
        assert register() is False
    assert "no speculative-algorithm registry" in caplog.text


def test_one_drafted_node_or_none(monkeypatch, answers_store, plain_answers):
    prompt = plain_answers[QUESTIONS[0]][0]
    settings = EngineSettings.read({"datastore": answers_store, "service": None})
    for n in (1, 2):
        cache = RedraftNgramCache.from_settings(n, settings)
        ids, mask = cache.batch_get([prompt + prompt[:4]])
        assert ids.tolist()[0] == prompt[3] and len(ids) == n and mask.tolist()[0] == 1
        cache.close()
    monkeypatch.setenv("REDRAFT_SERVICE", f"127.0.0.1:{free_port()}")
    cache = RedraftNgramCache.from_settings(N)
    ids, _ = cache.batch_get([[]])  # an empty request: only padding, no exception
    assert ids.tolist() == [0] * N
    cache.close()
