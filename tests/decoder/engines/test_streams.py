"""The adapters' options: the one parameters value plus the adapter's own fields, each checked
with one line (EngineConfigError), and the sources the `learn` flag gives."""

from __future__ import annotations

import pytest
from redraft.decoder.engines.settings import EngineSettings
from redraft.decoder.engines.streams import DraftOptions, EngineConfigError
from redraft.proto.params import DraftParams
from redraft.proto.tree import DEFAULT_BUDGET, DEFAULT_MAX_DEPTH, LEARNED, PLD, REST


def test_the_defaults_are_the_drafters_usual_ones():
    o = DraftOptions()
    o.check()
    assert (o.params.budget, o.params.max_depth, o.params.corpora) == (DEFAULT_BUDGET,
                                                                     DEFAULT_MAX_DEPTH, ())
    assert o.sources == (REST, PLD, LEARNED)
    assert DraftOptions(learn=False).sources == (REST, PLD)


def test_learn_adds_or_removes_the_learned_source():
    asked = DraftParams(budget=8, max_depth=4, sources=(LEARNED, REST))
    assert DraftOptions(asked).sources == (REST, LEARNED)
    assert DraftOptions(asked, learn=False).sources == (REST,)
    assert DraftOptions(asked.replace(sources=(PLD,))).sources == (PLD, LEARNED)


@pytest.mark.parametrize("options, message", [
    (DraftOptions(DraftParams(budget=0, max_depth=4)), "budget must be a positive integer, got 0"),
    (DraftOptions(DraftParams(budget=4, max_depth=True)), "max_depth must be a positive integer"),
    (DraftOptions(learn_max_tokens=0), "learn_max_tokens must be a positive integer, got 0"),
    (DraftOptions(tenant=3), "tenant must be a string, got 3"),
    (DraftOptions(DraftParams(4, 4, corpora=("a", ""))), "corpora must be non-empty names"),
    (DraftOptions(DraftParams(4, 4, corpora="abc")), "corpora must be non-empty names"),
    (DraftOptions(DraftParams(4, 4, sources=("nope",))), r"unknown draft sources \['nope'\]"),
    (DraftOptions(DraftParams(1 << 32, 4)), "budget must be a non-negative integer"),
    (DraftOptions(params={"budget": 4}), "params must be a DraftParams"),
])
def test_each_option_is_checked_with_one_line(options, message):
    with pytest.raises(EngineConfigError, match=message):
        options.check()


def test_engine_settings_hold_the_parameters_and_cap_them_for_the_engine():
    s = EngineSettings.read({"budget": "32", "max_depth": "8", "corpora": "a, b",
                             "tenant": "t", "learn": "0"}, environ={})
    assert s.options == DraftOptions(DraftParams(budget=32, max_depth=8, corpora=("a", "b")),
                                     tenant="t", learn=False)
    defaults = EngineSettings.read({}, environ={}).options
    assert defaults == DraftOptions()
