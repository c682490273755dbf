"""`rest` in process (`DatastoreDrafter`): the datastore's tokenizer is always checked
against the target's, even when the drafter is made without one (the Generator it joins
passes its own)."""

from __future__ import annotations

import pytest
from redraft.datastore import TokenizerMismatch, build_datastore
from redraft.decoder.budget import CostModel
from redraft.decoder.drafter import MergedDrafter
from redraft.decoder.drafters.datastore_drafter import DatastoreDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.generate import Generator
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint

from ..conftest import tiny_model

VOCAB = 64
DOCS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [20, 21, 22, 23] * 4]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _store(tmp_path, fingerprint: str) -> str:
    path = str(tmp_path / "ds")
    build_datastore(None, path, documents=DOCS, fingerprint=fingerprint, vocab_size=VOCAB)
    return path


@pytest.mark.parametrize("combined", [False, True], ids=["alone", "in-a-combination"])
def test_a_drafter_made_without_a_tokenizer_is_checked_by_its_generator(tmp_path, tokenizer,
                                                                        combined):
    drafter = DatastoreDrafter(_store(tmp_path, "sha256:another-tokenizer"), tokenizer=None)
    joined = MergedDrafter([PLDDrafter(), drafter]) if combined else drafter
    with pytest.raises(TokenizerMismatch, match="does not match the datastore's "
                                                "sha256:another-tokenizer"):
        Generator(tiny_model(vocab=VOCAB), tokenizer, joined)
    drafter.close()


def test_a_drafter_never_checked_refuses_to_draft(tmp_path, tokenizer):
    drafter = DatastoreDrafter(_store(tmp_path, tokenizer_fingerprint(tokenizer)))
    with pytest.raises(TokenizerMismatch, match="no tokenizer was checked"):
        drafter.propose([5, 6, 7], 8)
    drafter.close()


def test_a_drafter_checked_by_its_generator_drafts_losslessly(tmp_path, tokenizer):
    model = tiny_model(vocab=VOCAB, init=0.3)
    drafter = DatastoreDrafter(_store(tmp_path, tokenizer_fingerprint(tokenizer)))
    flat = CostModel.flat(63)
    spec = Generator(model, tokenizer, drafter, cost=flat)
    plain = Generator(model, tokenizer, None, cost=flat)
    for prompt in ([5, 6, 7, 8], [20, 21, 22]):
        a = spec.generate(prompt, max_new_tokens=12, eos=False)
        assert a.tokens == plain.generate(prompt, max_new_tokens=12, eos=False).tokens
        assert a.stats.drafted > 0 and a.stats.drafter_errors == 0
    drafter.close()
