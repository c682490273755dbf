"""Drafting over storage: the candidate trees the datastore side proposes.

- `retrieval`: the REST tree from a Reader's exact lookups (and its calibration);
- `prompt_lookup`: copying from the generation's own context (PLD);
- `learned`: copying from earlier generations' outputs, per tenant;
- `session`: one generation's drafting, all of them merged under one budget (what the draft
  service runs per session and the decoder's in-process `rest` drafter runs too).

This `__init__` is the whole surface the decoder drafts through on the datastore side.
"""

from redraft.datastore.drafting.learned import LearnedIndex
from redraft.datastore.drafting.prompt_lookup import PromptLookup, prompt_lookup
from redraft.datastore.drafting.retrieval import REST_CALIBRATION, calibrate, retrieval_tree
from redraft.datastore.drafting.session import (
    LEARNED_CORPUS,
    SOURCES,
    DraftSettings,
    SessionDrafter,
)

__all__ = [
    "LEARNED_CORPUS",
    "REST_CALIBRATION",
    "SOURCES",
    "DraftSettings",
    "LearnedIndex",
    "PromptLookup",
    "SessionDrafter",
    "calibrate",
    "prompt_lookup",
    "retrieval_tree",
]
