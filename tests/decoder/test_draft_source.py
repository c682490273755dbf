"""The draft source (`redraft.decoder.draft_source`), against a real `redraft serve` on a real
port: a stream opens with the prompt, sends only new tokens, sends the tail when it closes, and
a killed server turns into prompt lookup (the generation's output unchanged) while the source
leaves the service alone for `retry_after` seconds."""

from __future__ import annotations

import time

import pytest
from redraft.datastore import TokenizerMismatch, build_datastore
from redraft.datastore.drafting import DEFAULT_PARAMS
from redraft.datastore.service.client import DraftClient
from redraft.decoder.budget import CostModel
from redraft.decoder.draft_source import (
    DraftConfigError,
    DraftSource,
    DraftStream,
    fingerprint_of,
)
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.drafters.service_drafter import ServiceDrafter
from redraft.decoder.generate import Generator
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint
from redraft.proto.params import DraftParams, InvalidParams
from redraft.proto.tree import (
    DEFAULT_BUDGET,
    DEFAULT_MAX_DEPTH,
    LEARNED,
    PLD,
    REST,
    Chain,
    Tree,
    best_chain,
)

from ..conftest import free_port
from .conftest import tiny_model

VOCAB = 64
DOC = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
NOVEL = list(range(40, 60))  # in no document: only learned drafts can know it
WAIT = 3.0  # retry_after in the back-off test: longer than a `redraft serve` takes to start


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def fingerprint(tokenizer) -> str:
    return tokenizer_fingerprint(tokenizer)


@pytest.fixture(scope="module")
def store(tmp_path_factory, fingerprint) -> str:
    path = str(tmp_path_factory.mktemp("store") / "ds")
    build_datastore(None, path, documents=[DOC * 2, [20, 21, 22, 23] * 4], corpus="code",
                    fingerprint=fingerprint, vocab_size=VOCAB)
    return path


def chain(tree: Tree, n: int = 8) -> Chain:
    """The draft's best path, at most `n` tokens: what a caller would verify first."""
    return best_chain(tree, n)


def test_a_stream_opens_with_the_prompt_sends_new_tokens_and_the_tail(servers, store,
                                                                      fingerprint):
    address = servers.start(store, "--port", "0").address
    source = DraftSource(service=address, tokenizer=fingerprint,
                         params=DEFAULT_PARAMS.replace(sources=(REST, LEARNED)), tenant="t")
    stream = source.open(DOC[:4])
    assert chain(stream.propose(), 4).tokens == DOC[4:8]  # the draft the session opened with
    stream.extend(DOC[4:6])
    assert chain(stream.propose(budget=3)).tokens == DOC[6:9]  # the prompt and the new tokens
    stream.extend(NOVEL[:10])
    stream.propose()
    stream.extend(NOVEL[10:])  # proposed for no more: these reach the service at close
    stream.close()
    # the service learned the whole output, its tail too: a session that has seen its first
    # twelve novel tokens drafts the rest, from learned outputs alone
    again = source.open(DOC[:6] + NOVEL[:12])
    draft = chain(again.propose())
    assert draft.tokens == NOVEL[12:20] and set(draft.sources) == {LEARNED}
    again.close()
    assert not stream.failed and source.failures == source.fallbacks == 0
    with DraftClient(address, timeout=10) as c:
        assert c.stats()["sessions_opened"] == 2
    source.close()


def test_a_killed_server_turns_into_prompt_lookup_and_waits_before_trying_again(
        servers, store, fingerprint):
    port = free_port()
    serve = servers.start(store, "--port", str(port))
    source = DraftSource(service=serve.address, tokenizer=fingerprint, retry_after=WAIT)
    stream = source.open([30, 31, 32, 33, 30, 31])
    assert not stream.failed
    serve.kill()
    stream.extend([32])
    assert chain(stream.propose(), 1).tokens == [33]  # prompt lookup over the context kept
    failed_at = time.monotonic()
    assert stream.failed and source.failures == 1 and not source.service_usable()
    stream.extend([33, 30])
    assert chain(stream.propose(), 2).tokens == [31, 32]
    stream.close()
    # within the wait a new stream starts on prompt lookup without calling the service: a
    # server back on the port is not asked yet
    serve = servers.start(store, "--port", str(port))
    assert time.monotonic() - failed_at < WAIT - 1, "the server took too long to restart"
    waiting = source.open(DOC[:4])
    assert waiting.failed and source.failures == 1 and source.fallbacks == 2
    waiting.close()
    time.sleep(max(0.0, WAIT - (time.monotonic() - failed_at)))
    assert source.service_usable()
    back = source.open(DOC[:4])
    assert not back.failed and chain(back.propose(), 4).tokens == DOC[4:8]
    back.close()
    with DraftClient(serve.address, timeout=10) as c:
        assert c.stats()["sessions_opened"] == 1  # the one after the wait
    source.close()


def test_a_server_killed_mid_generation_leaves_the_output_unchanged(servers, tmp_path,
                                                                   tokenizer, fingerprint):
    """The decoder's `rest` over the service: drafts accepted from the service, then from
    prompt lookup once the server is gone; the output is plain decoding's, and the one
    generation that fell back counts as the drafter's one failure."""
    model = tiny_model(vocab=VOCAB, init=0.3)
    flat = CostModel.flat(63)
    prompt = [5, 6, 7, 8]
    plain = Generator(model, tokenizer, None, cost=flat).generate(prompt, max_new_tokens=48,
                                                                  eos=False)
    path = str(tmp_path / "answers")  # the answer itself: the service's drafts are accepted
    build_datastore(None, path, documents=[prompt + plain.tokens], fingerprint=fingerprint,
                    vocab_size=VOCAB)
    serve = servers.start(path, "--port", "0")
    drafter = ServiceDrafter(serve.address, fingerprint, fallback=PLDDrafter(), timeout=2.0)
    gen = Generator(model, tokenizer, drafter, cost=flat)
    steps = gen.iter_steps(prompt, max_new_tokens=48, eos=False)
    first = next(steps)
    serve.kill()
    out = list(first)
    while True:
        try:
            out += next(steps)
        except StopIteration as stop:
            result = stop.value
            break
    assert out == result.tokens == plain.tokens
    assert result.stats.accepted.get(REST, 0) > 0 and len(first) > 1  # the service drafted
    assert result.stats.drafter_errors == 1 and drafter.source.failures == 1
    drafter.close()


def test_a_failed_step_hands_the_fallback_the_context_once(servers, store, fingerprint):
    """The context is kept once, by the session: whether a failed step had added its tokens
    (the server gone: they count as the context's) or not (an id the wire refuses), the
    fallback starts from the prompt and every token since, each once."""
    serve = servers.start(store, "--port", "0")
    opened = []
    source = DraftSource(service=serve.address, tokenizer=fingerprint, retry_after=0.0,
                         fallback=lambda ctx: opened.append(list(ctx)) or DraftStream())
    refused = source.open(DOC[:4])
    refused.extend([5, 1 << 31])  # no token has this id: the step fails before it is sent
    refused.propose()
    assert refused.failed and opened == [DOC[:4] + [5, 1 << 31]]
    stream = source.open(DOC[:4])
    stream.extend(DOC[4:6])
    assert chain(stream.propose(), 2).tokens == DOC[6:8] and not stream.failed
    serve.kill()
    stream.extend(DOC[6:8])
    stream.propose()  # the session adds the tokens, then finds no server
    assert stream.failed and opened[1:] == [DOC[:8]]
    stream.close()
    source.close()


def test_the_service_is_sent_each_accepted_token_once(servers, tmp_path, tokenizer,
                                                     fingerprint):
    """The loop hands the drafter each step's tokens (`update`) and then the whole context
    (`propose`): the service is sent every token once, so the one output it learns is the
    prompt and the generation, no token twice."""
    model = tiny_model(vocab=VOCAB, init=0.3)
    prompt = [5, 6, 7, 8]
    plain = Generator(model, tokenizer, None).generate(prompt, max_new_tokens=40, eos=False)
    path = str(tmp_path / "answers")  # the answer itself: steps accept several tokens
    build_datastore(None, path, documents=[prompt + plain.tokens], fingerprint=fingerprint,
                    vocab_size=VOCAB)
    serve = servers.start(path, "--port", "0")
    drafter = ServiceDrafter(serve.address, fingerprint, timeout=5.0)
    gen = Generator(model, tokenizer, drafter, cost=CostModel.flat(63))
    result = gen.generate(prompt, max_new_tokens=40, eos=False)
    assert result.tokens == plain.tokens and result.stats.steps < 20
    drafter.close()
    with DraftClient(serve.address, timeout=10) as c:
        assert c.stats()["learned_tokens"] == len(prompt) + len(result.tokens)


def test_one_message_for_a_service_with_another_tokenizer(servers, store, fingerprint):
    address = servers.start(store, "--port", "0").address
    want = (f"draft service {address} serves a datastore built with tokenizer .* "
            fr"\({fingerprint}\); this model's tokenizer is sha256:other")
    with pytest.raises(TokenizerMismatch, match=want):
        DraftSource(service=address, tokenizer="sha256:other")
    with pytest.raises(TokenizerMismatch, match=want):  # the decoder's drafter alike
        ServiceDrafter(address, "sha256:other")
    source = DraftSource(service=address)  # no tokenizer yet: the model's, checked later
    with pytest.raises(TokenizerMismatch, match=want):
        source.check_tokenizer("sha256:other")
    source.close()
    made = DraftSource(service=address, tokenizer=fingerprint)
    with pytest.raises(TokenizerMismatch, match=f"made for tokenizer {fingerprint}; this "
                                                "model's tokenizer is sha256:other"):
        made.check_tokenizer("sha256:other")
    made.check_tokenizer(fingerprint)
    made.close()


def test_corpora_are_checked_over_the_service_and_in_process(servers, store, fingerprint):
    address = servers.start(store, "--port", "0").address
    with pytest.raises(DraftConfigError, match=r"unknown corpora \['nope'\] \(the service has: "
                                               "code"):
        DraftSource(service=address, tokenizer=fingerprint, params=DraftParams(corpora=["nope"]))
    with pytest.raises(DraftConfigError, match=r"unknown corpora \['nope'\] \(the datastore "
                                               "has: code"):
        DraftSource(datastore=store, tokenizer=fingerprint, params=DraftParams(corpora=["nope"]))
    local = DraftSource(datastore=store, tokenizer=fingerprint,
                        params=DraftParams(sources=(REST,), corpora=["code"]))
    # a 0 budget and depth: the server's defaults over the service, the drafter's in process
    assert local.params.budget == 0 and local.settings.params.budget == DEFAULT_BUDGET
    assert local.settings.params.max_depth == DEFAULT_MAX_DEPTH
    stream = local.open(DOC[:4])
    assert chain(stream.propose(), 4).tokens == DOC[4:8]
    stream.close()
    local.close()


def test_params_are_one_checked_value(store, fingerprint):
    with pytest.raises(DraftConfigError, match="params must be a DraftParams, got 8"):
        DraftSource(datastore=store, tokenizer=fingerprint, params=8)
    with pytest.raises(InvalidParams, match="unknown draft sources"):
        DraftSource(datastore=store, tokenizer=fingerprint, params=DraftParams(sources=("x",)))


def test_the_fallback_is_prompt_lookup_none_or_the_callers(fingerprint):
    """An unreachable service: one failure, and every stream drafts by the fallback."""
    address = f"127.0.0.1:{free_port()}"
    context = [30, 31, 32, 33, 30, 31]
    lookup = DraftSource(service=address, tokenizer=fingerprint)
    assert lookup.failures == 1
    drafted = chain(lookup.open(context).propose(), 2)
    assert drafted.tokens == [32, 33] and set(drafted.sources) == {PLD}
    nothing = DraftSource(service=address, tokenizer=fingerprint, fallback=False)
    assert len(nothing.open(context).propose()) == 0
    opened = []
    own = DraftSource(service=address, tokenizer=fingerprint,
                      fallback=lambda ctx: opened.append(list(ctx)) or DraftStream())
    own.open(context)
    assert opened == [context] and own.fallbacks == 1 and own.failures == 1
    for source in (lookup, nothing, own):
        source.close()


def test_fingerprints_pass_through_and_other_strings_name_a_tokenizer(tokenizer, fingerprint):
    assert fingerprint_of(fingerprint) == fingerprint
    assert fingerprint_of(tokenizer) == fingerprint
    with pytest.raises(Exception, match="tokenizer must be"):
        fingerprint_of(42)
