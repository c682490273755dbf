"""End to end on the default model: speculative greedy output is token-for-token the plain
greedy output, through every drafter, including a draft service that dies mid-generation."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from redraft.datastore import Reader
from redraft.datastore.service.server import ServerThread
from redraft.decoder.budget import CostModel
from redraft.decoder.drafter import MergedDrafter
from redraft.decoder.drafters.datastore_drafter import DatastoreDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.drafters.recycle import RecycleDrafter, table_path
from redraft.decoder.drafters.registry import build_drafter
from redraft.decoder.drafters.service_drafter import ServiceDrafter
from redraft.decoder.generate import GenerationError, Generator
from redraft.decoder.near_tie import is_near_tie
from redraft.decoder.policy import calibration_path
from redraft.proto.files import cache_root
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint

from .conftest import CODE_PROMPTS, CPU_COST, tiny_model

NEW = 40


@pytest.fixture(scope="module")
def plain(default_model):
    model, tok = default_model
    gen = Generator(model, tok, None, cost=CostModel(*CPU_COST))
    return {p: gen.generate(p, max_new_tokens=NEW) for p in CODE_PROMPTS}


def assert_same_or_near_tie(model, result, reference) -> bool:
    """Identical tokens, or a first difference where the target's top two logits are a
    near-tie at its precision (`redraft.decoder.near_tie`); True if identical."""
    if result.tokens == reference.tokens:
        return True
    i = next(k for k, (a, b) in enumerate(zip(result.tokens, reference.tokens)) if a != b)
    ids = reference.prompt_ids + reference.tokens[:i]
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
    tie, gap = is_near_tie(logits, next(model.parameters()).dtype)
    print(f"first difference at token {i}: top-2 logit gap {gap:.2e}")
    assert tie, f"tokens differ at {i} with a top-2 gap of {gap:.3g}: a bug"
    return False


@pytest.mark.parametrize("prompt", CODE_PROMPTS)
def test_plain_decoding_matches_hf_generate(default_model, plain, prompt):
    """redraft's plain loop (packed CPU kernels) against Hugging Face's (stock kernels)."""
    assert_same_or_near_tie(default_model[0], plain[prompt],
                            hf_generate(default_model, plain[prompt]))


def hf_generate(model_and_tokenizer, ours):
    """Hugging Face's greedy `generate` on the prompt of `ours` (a result), as a result."""
    model, tok = model_and_tokenizer
    with torch.inference_mode():
        out = model.generate(torch.tensor([ours.prompt_ids], device=model.device),
                             max_new_tokens=NEW,
                             do_sample=False, eos_token_id=sorted(
                                 {tok.eos_token_id, model.generation_config.eos_token_id}))
    return dataclasses.replace(ours, tokens=out[0, len(ours.prompt_ids):].tolist())


@pytest.mark.parametrize("which", ["pld", "rest", "pld,rest", "recycle", "pld,rest,recycle",
                                   "medusa", "hybrid", "fallback", "draft-model", "lookahead",
                                   "pld,lookahead"])
def test_speculative_greedy_is_identical_to_plain(default_model, plain, code_datastore, which):
    model = default_model[0]
    check_drafter_against_plain(default_model, code_datastore, which,
                                lambda r, ref: assert_same_or_near_tie(model, r, ref), plain)


def check_drafter_against_plain(model_and_tokenizer, datastore, which: str, check,
                                plain: dict) -> None:
    """Generate every code prompt with `which`; `check(result, plain result)` each, and
    require drafts to have been accepted (some: how many trees the budget keeps depends on
    the machine's timings, which correct the curve and the loop's overhead as it runs)."""
    model, tok = model_and_tokenizer
    drafter = build_drafter(which, model=model, tokenizer=tok, model_name="smollm2-135m",
                            datastore=datastore)
    gen = Generator(model, tok, drafter, cost=CostModel(*CPU_COST))
    steps = tokens = 0
    for prompt in CODE_PROMPTS:
        r = gen.generate(prompt, max_new_tokens=NEW)
        check(r, plain[prompt])
        assert r.stats.new_tokens == len(r.tokens) and r.stats.drafter_errors == 0
        steps += r.stats.steps
        tokens += r.stats.new_tokens
    drafter.close()
    assert tokens > steps, f"{which}: drafts were never accepted ({tokens}/{steps})"


@pytest.mark.parametrize("which", ["none", "pld,recycle"])
def test_two_threads_on_one_generator_get_their_own_answers(default_model, plain, which):
    """Generations from two threads on one Generator are serialized: each thread gets the
    answer to its own prompt, exactly as one at a time, never another's or an error."""
    model, tok = default_model
    drafter = build_drafter(which, model=model, tokenizer=tok, model_name="smollm2-135m")
    gen = Generator(model, tok, drafter, cost=CostModel(*CPU_COST))
    orders = {"a": CODE_PROMPTS, "b": CODE_PROMPTS[::-1]}
    results: dict[str, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(name: str) -> None:
        try:
            start.wait()
            results[name] = [gen.generate(p, max_new_tokens=NEW) for p in orders[name]]
        except BaseException as exc:  # reported below, with the thread's name
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(name,)) for name in orders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    for name, prompts in orders.items():
        for prompt, r in zip(prompts, results[name]):
            if which == "none":  # the very same computation as the sequential reference
                assert r.tokens == plain[prompt].tokens, (name, prompt)
            else:
                assert_same_or_near_tie(model, r, plain[prompt])
            assert r.prompt_ids == plain[prompt].prompt_ids
            assert r.stats.drafter_errors == 0
    if drafter is not None:
        drafter.close()


def test_a_thread_cannot_start_a_second_generation_while_its_first_is_unfinished(
        default_model, plain):
    model, tok = default_model
    gen = Generator(model, tok, None, cost=CostModel(*CPU_COST))
    stream = gen.stream(CODE_PROMPTS[0], max_new_tokens=NEW)
    next(iter(stream))
    with pytest.raises(GenerationError, match="already running a generation"):
        gen.generate(CODE_PROMPTS[1], max_new_tokens=4)
    stream.close()  # frees the Generator
    assert gen.generate(CODE_PROMPTS[1], max_new_tokens=NEW).tokens == \
        plain[CODE_PROMPTS[1]].tokens


def test_early_exit_draft_model_is_identical_to_plain(default_model, plain):
    """The target's first layers as the draft model: rarely right (no training), never wrong."""
    model, tok = default_model
    drafter = build_drafter("draft-model", model=model, tokenizer=tok,
                            options={"draft_model": "skip:20"})
    gen = Generator(model, tok, drafter, cost=CostModel(*CPU_COST))
    for prompt in CODE_PROMPTS:
        r = gen.generate(prompt, max_new_tokens=NEW)
        assert_same_or_near_tie(model, r, plain[prompt])
        assert r.stats.drafter_errors == 0


def test_stream_yields_the_generated_text(default_model, plain):
    model, tok = default_model
    gen = Generator(model, tok, PLDDrafter(), cost=CostModel(*CPU_COST))
    s = gen.stream(CODE_PROMPTS[1], max_new_tokens=NEW)
    pieces = list(s)
    assert len(pieces) > 1 and "".join(pieces) == s.result.text
    assert s.result.tokens == plain[CODE_PROMPTS[1]].tokens


def test_service_dying_mid_generation_falls_back_with_identical_output(
    default_model, plain, code_datastore
):
    model, tok = default_model
    reader = Reader(code_datastore)
    server = ServerThread(reader).start()
    try:
        service = ServiceDrafter(server.address, tokenizer_fingerprint(tok),
                                 fallback=PLDDrafter(), timeout=2.0)
        service.check()
        gen = Generator(model, tok, MergedDrafter([service]), cost=CostModel(*CPU_COST))
        prompt = CODE_PROMPTS[0]
        stream = gen.stream(prompt, max_new_tokens=NEW)
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 3:
                server.stop(grace=0)  # the service goes away mid-generation
        r = stream.result
        assert_same_or_near_tie(model, r, plain[prompt])
        assert r.stats.drafter_errors >= 1
        service.close()
    finally:
        server.stop(grace=0)
        reader.close()


@pytest.mark.parametrize("path", ["datastore", "service"])
def test_learned_drafts_repeat_earlier_answers_losslessly(default_model, plain, code_datastore,
                                                          path):
    """Asked for `rest`, the decoder also drafts what it generated before (in this process,
    or what the draft service learned from its sessions): answering the same prompts again
    accepts mostly learned tokens, and every answer stays plain greedy's."""
    model, tok = default_model
    reader = server = None
    if path == "service":
        reader = Reader(code_datastore)
        server = ServerThread(reader).start()
        drafter = build_drafter("rest", tokenizer=tok, draft_service=server.address,
                                options={"tenant": "learned-test"})
    else:
        drafter = build_drafter("rest", tokenizer=tok, datastore=code_datastore)
    try:
        gen = Generator(model, tok, drafter, cost=CostModel(*CPU_COST))
        prompts = CODE_PROMPTS[:2]
        rounds = [[gen.generate(p, max_new_tokens=NEW) for p in prompts] for _ in range(2)]
        for results in rounds:
            for p, r in zip(prompts, results):
                assert_same_or_near_tie(model, r, plain[p])
        again = rounds[1]
        learned = sum(v for r in again for k, v in r.stats.accepted.items() if "learned" in k)
        assert learned > 0.5 * sum(r.stats.new_tokens for r in again)
        per_step = [sum(r.stats.new_tokens for r in rs) / sum(r.stats.steps for r in rs)
                    for rs in rounds]
        assert per_step[1] > 1.5 * per_step[0], per_step
    finally:
        drafter.close()
        if server is not None:
            server.stop(grace=0)
            reader.close()


def test_unreachable_service_is_not_a_failed_generation(default_model, plain):
    model, tok = default_model
    service = ServiceDrafter("127.0.0.1:9", tokenizer_fingerprint(tok), fallback=PLDDrafter(),
                             timeout=1.0)
    service.check()  # unreachable: a warning, not an error
    gen = Generator(model, tok, service, cost=CostModel(*CPU_COST))
    r = gen.generate(CODE_PROMPTS[2], max_new_tokens=NEW)
    assert_same_or_near_tie(model, r, plain[CODE_PROMPTS[2]])
    assert r.stats.drafter_errors == 1 and r.stats.tokens_per_step > 1.0
    service.close()


def test_eos_stop_strings_and_max_new_tokens(default_model):
    model, tok = default_model
    gen = Generator(model, tok, PLDDrafter(), cost=CostModel(*CPU_COST))
    r = gen.generate("Say hello.", max_new_tokens=200)
    assert r.finish_reason == "eos" and r.tokens[-1] in gen.eos_ids
    assert r.stats.new_tokens < 200
    r = gen.generate(CODE_PROMPTS[0], max_new_tokens=5)
    assert len(r.tokens) == 5 and r.finish_reason == "length"
    r = gen.generate(CODE_PROMPTS[0], max_new_tokens=NEW, stop=["def "])
    assert r.finish_reason == "stop" and "def " not in r.text
    # one string is one stop string, not one per character
    one = gen.generate(CODE_PROMPTS[0], max_new_tokens=NEW, stop="reader")
    listed = gen.generate(CODE_PROMPTS[0], max_new_tokens=NEW, stop=["reader"])
    assert one.finish_reason == "stop" and (one.tokens, one.text) == (listed.tokens, listed.text)
    assert "def " in one.text  # a stop per character would cut at the "d" of "def"


def test_bad_inputs_are_clear_errors(default_model):
    model, tok = default_model
    gen = Generator(model, tok, PLDDrafter(), cost=CostModel(*CPU_COST))
    with pytest.raises(GenerationError, match="empty prompt"):
        gen.generate("   ")
    with pytest.raises(GenerationError, match="empty prompt"):
        gen.generate([])
    with pytest.raises(GenerationError, match="max_new_tokens must be positive"):
        gen.generate("hi", max_new_tokens=0)
    with pytest.raises(GenerationError, match="context is 8192"):
        gen.generate([5] * 9000)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        gen.generate([5, 10**6])
    with pytest.raises(GenerationError, match="temperature"):
        gen.generate("hi", temperature=-1)
    with pytest.raises(GenerationError, match="top_p"):
        gen.generate("hi", temperature=1, top_p=0)
    for temperature in (float("nan"), float("inf")):
        with pytest.raises(GenerationError, match="temperature must be a finite number"):
            gen.generate("hi", temperature=temperature)
    for seed in (2**70, 2**64, -1, 1.5, "7"):
        with pytest.raises(GenerationError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            gen.generate("hi", temperature=1, seed=seed)
    assert len(gen.generate("hi", max_new_tokens=2, temperature=1, seed=2**64 - 1).tokens) == 2
    with pytest.raises(GenerationError, match="prompt is not valid Unicode .*U\\+D800"):
        gen.generate("caf\ud800")
    with pytest.raises(GenerationError, match="a message is not valid UTF-8 .*0xff"):
        gen.generate([{"role": "user", "content": "caf\udcff"}])


def test_incompatible_datastore_is_refused(tmp_path, default_model):
    from redraft.datastore import TokenizerMismatch, build_datastore

    _, tok = default_model
    path = str(tmp_path / "other")
    build_datastore(None, path, documents=[[1, 2, 3, 4]], fingerprint="sha256:other",
                    vocab_size=100)
    with pytest.raises(TokenizerMismatch, match="fingerprint"):
        DatastoreDrafter(path, tok)


def test_a_failing_member_of_a_combination_drops_out_alone(default_model, plain, code_datastore):
    model, tok = default_model
    rest = DatastoreDrafter(code_datastore, tok)
    gen = Generator(model, tok, MergedDrafter([PLDDrafter(), rest]), cost=CostModel(*CPU_COST))
    prompt = CODE_PROMPTS[1]
    stream = gen.stream(prompt, max_new_tokens=NEW)
    for n, _ in enumerate(stream):
        if n == 2:
            rest.close()  # the datastore goes away mid-generation: lookups now raise
    r = stream.result
    assert_same_or_near_tie(model, r, plain[prompt])
    assert r.stats.drafter_errors == 1
    # PLD kept drafting, and its drafts were taken (how many depends on the tree sizes the
    # budget reads off this machine's clock)
    assert r.stats.accepted.get("pld", 0) > 0 and r.stats.tokens_per_step > 1


def test_max_nodes_zero_drafts_nothing(default_model, plain):
    model, tok = default_model
    gen = Generator(model, tok, PLDDrafter(), cost=CostModel(*CPU_COST), max_nodes=0)
    r = gen.generate(CODE_PROMPTS[0], max_new_tokens=NEW)
    assert r.tokens == plain[CODE_PROMPTS[0]].tokens
    assert r.stats.drafted == 0 and r.stats.steps == NEW and not r.stats.accepted


def test_a_generator_keeps_calibration_and_drafter_state_across_processes(tmp_path, caplog):
    model, tok = tiny_model("llama", vocab=64, init=0.3), load_tokenizer(None)
    flat, prompt = CostModel.flat(63), [5, 9, 14, 3]  # frozen: the trees depend on state alone

    def generator(state, persist=True):
        rec = RecycleDrafter()
        gen = Generator(model, tok, MergedDrafter([PLDDrafter(), rec]), model_name="tiny",
                        cost=flat, persist_state=state if persist else False)
        return gen, rec

    first, rec = generator(tmp_path)
    cold = first.generate(prompt, max_new_tokens=30, eos=False)
    assert table_path("tiny", tmp_path).is_file()
    assert calibration_path("tiny", "pld,recycle", tmp_path).is_file()
    second, back = generator(tmp_path)  # a new process: fresh drafters, the same folder
    assert back.table.probs.any()
    assert np.array_equal(back.table.probs, rec.table.probs[:64])  # (rows past the vocabulary
    assert np.array_equal(back.table.ids, rec.table.ids[:64])  # were never recorded in)
    assert second.calibrator.to_json() == first.calibrator.to_json()
    # it then drafts exactly as the first Generator's own next generation does
    again = first.generate(prompt, max_new_tokens=30, eos=False)
    warm = second.generate(prompt, max_new_tokens=30, eos=False)
    assert warm.tokens == again.tokens == cold.tokens
    assert (warm.stats.steps, warm.stats.tried) == (again.stats.steps, again.stats.tried)
    assert warm.stats.accepted == again.stats.accepted and warm.stats.accepted["recycle"]
    # without persist_state nothing is read (it drafts as the first did, cold); True is the
    # cache root, as `redraft generate` uses
    fresh, rec = generator(tmp_path, persist=False)
    assert not rec.table.ids.size
    plain_again = fresh.generate(prompt, max_new_tokens=30, eos=False).stats.tried
    assert plain_again == cold.stats.tried != warm.stats.tried
    assert generator(True)[0].state_dir == cache_root()

    # a generation closed early keeps what it learned too
    third, rec = generator(tmp_path / "closed")
    steps = third.iter_steps([7, 2, 11, 6], max_new_tokens=30, eos=False)
    next(steps)
    steps.close()
    assert table_path("tiny", tmp_path / "closed").is_file()

    class CannotSave(RecycleDrafter):
        def save_state(self, directory, model_name):
            raise RuntimeError("disk on fire")

    gen = Generator(model, tok, CannotSave(), model_name="tiny", cost=flat,
                    persist_state=tmp_path / "broken")
    assert gen.generate(prompt, max_new_tokens=8, eos=False).tokens == cold.tokens[:8]
    assert "failed to save its state (disk on fire)" in caplog.text
