"""Text as a generation grows: stop strings never leak into a stream, and the work per step
does not grow with the output."""

from __future__ import annotations

import random

import pytest
from redraft.decoder.budget import CostModel
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.generate import Generator
from redraft.decoder.text import IncrementalText, StopStrings
from redraft.proto.models import load_tokenizer

from .conftest import CODE_PROMPTS, CPU_COST


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("stops", [["\n\n"], ["END", "ENDING"], ["abcab"], ["zzz"]])
def test_stop_strings_cut_at_the_first_one_whatever_the_pieces(stops):
    rng = random.Random(0)
    text = "def f():\n    return 1\n\nabcabcabENDING more\n\nabcab END"
    found = [text.find(s) for s in stops if s in text]
    expected = text[: min(found)] if found else text
    for _ in range(200):
        matcher = StopStrings(stops)
        shown = ""
        for piece in random_pieces(text, rng):
            shown += matcher.feed(piece)
            assert expected.startswith(shown)  # never past the cut, at any point
        shown += matcher.flush()
        assert shown == expected and matcher.stopped == bool(found)


def test_incremental_text_equals_a_full_decode_and_decodes_a_bounded_window():
    tok = load_tokenizer(None)
    text = "héllo wörld 😀 — déjà vu\n    return {'ü': 1}  # ✓ 漢字\n" * 3
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    rng = random.Random(1)
    for _ in range(20):
        inc = IncrementalText(tok)
        out, i = "", 0
        while i < len(ids):
            n = rng.randint(1, 4)
            out += inc.push(ids[i : i + n])
            assert not out.endswith("\ufffd")  # a split character is held back
            i += n
        assert out + inc.flush() == text


class CountingTokenizer:
    """The real tokenizer, recording how many tokens every decode call was given."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded: list[int] = []

    def decode(self, ids, **kwargs):
        self.decoded.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_stop_check_work_per_step_is_bounded(default_model):
    model, tok = default_model
    counting = CountingTokenizer(tok)
    gen = Generator(model, counting, None)
    r = gen.generate(CODE_PROMPTS[1], max_new_tokens=96, eos=False, stop=["never appears"])
    assert r.finish_reason == "length" and r.stats.steps == 96
    # one token per step: each decode sees that token and the previous one, never the output
    assert max(counting.decoded) <= 2 and len(counting.decoded) <= 2 * 96 + 2
    assert r.text == tok.decode(r.tokens, skip_special_tokens=True)


@pytest.mark.parametrize("drafter", [None, "pld"])
def test_stream_equals_result_text_for_a_stop_string_split_across_tokens(default_model, drafter):
    model, tok = default_model
    make = (lambda: PLDDrafter()) if drafter else (lambda: None)
    full = Generator(model, tok, make(), cost=CostModel(*CPU_COST)).generate(
        CODE_PROMPTS[0], max_new_tokens=60)
    pieces = [tok.decode([t]) for t in full.tokens]
    # a stop string made of the end of one token and the start of the next, mid-answer
    k = next(i for i in range(len(pieces) // 2, len(pieces))
             if len(pieces[i - 1].strip()) >= 2 and len(pieces[i].strip()) >= 2)
    stop = pieces[k - 1][-2:] + pieces[k][:2]
    expected = full.text[: full.text.find(stop)]

    counting = CountingTokenizer(tok)
    gen = Generator(model, counting, make(), cost=CostModel(*CPU_COST))
    stream = gen.stream(CODE_PROMPTS[0], max_new_tokens=60, stop=[stop])
    shown = ""
    for piece in stream:
        shown += piece
        assert expected.startswith(shown), "the stream showed text past the stop string"
    assert shown == stream.result.text == expected
    assert stream.result.finish_reason == "stop"
    steps = stream.result.stats.steps
    most = max(len(stream.result.tokens) - steps + 1, 1)  # tokens of the longest step, at most
    assert max(counting.decoded) <= 2 * most
