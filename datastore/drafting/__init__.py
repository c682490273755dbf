"""Drafting over storage: the candidate trees the datastore side proposes.

- `retrieval`: the REST tree from a Reader's exact lookups (and its calibration);
- `prompt_lookup`: copying from the generation's own context (PLD);
- `learned_index`: copying from earlier generations' outputs, per tenant;
- `session_drafter`: one generation's drafting, all of them merged under one budget (what the draft
  service runs per session and the decoder's in-process `rest` drafter runs too);
- `native`: the same session drafting and learned index compiled (C++), the default;
- `implementation`: which of the two a process runs, and the constructors that follow it;
- `batch_step`: one step of many sessions at once (one call into the core).

This `__init__` is the whole surface the decoder drafts through on the datastore side.
`SessionDrafter` and `LearnedIndex` are the Python reference; `new_session_drafter` and
`new_learned_index` give the implementation in use (identical trees, compiled by default).
"""

from redraft.datastore.drafting.batch_step import BatchStep, step_batch, step_flat
from redraft.datastore.drafting.implementation import (
    DRAFTING_ENV,
    new_learned_index,
    new_session_drafter,
    prepare_reader,
    uses_native,
)
from redraft.datastore.drafting.learned_index import LearnedIndex
from redraft.datastore.drafting.prompt_lookup import PromptLookup, prompt_lookup
from redraft.datastore.drafting.retrieval import REST_CALIBRATION, calibrate, retrieval_tree
from redraft.datastore.drafting.session_drafter import (
    DEFAULT_PARAMS,
    LEARNED_CORPUS,
    SOURCES,
    DraftSettings,
    SessionDrafter,
)

__all__ = [
    "DEFAULT_PARAMS",
    "DRAFTING_ENV",
    "LEARNED_CORPUS",
    "REST_CALIBRATION",
    "SOURCES",
    "BatchStep",
    "DraftSettings",
    "LearnedIndex",
    "PromptLookup",
    "SessionDrafter",
    "calibrate",
    "new_learned_index",
    "new_session_drafter",
    "prepare_reader",
    "prompt_lookup",
    "retrieval_tree",
    "step_batch",
    "step_flat",
    "uses_native",
]
