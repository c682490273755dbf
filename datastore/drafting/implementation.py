"""Which drafting implementation this process runs: the compiled core (the default) or the
Python reference, and the constructors that follow that choice.

Why a choice at all: both draft identical trees (the tests hold the core to the reference
node for node), so the reference is there to debug with and to test against. Set
`REDRAFT_DRAFTING=python` to run the reference everywhere (the service, `--datastore`
drafting, engines' in-process streams); `native` insists on the core; unset (`auto`) uses the
core and falls back to the reference, with a warning, when the extension was not built.

Tested by: tests/datastore/drafting/native/test_native_session.py,
tests/datastore/service/test_batch_rpc.py
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from redraft.datastore.drafting.learned_index import LearnedIndex, OutputJournal
from redraft.datastore.drafting.session_drafter import DraftSettings, SessionDrafter

log = logging.getLogger("redraft.drafting")
DRAFTING_ENV = "REDRAFT_DRAFTING"
CHOICES = ("auto", "native", "python")

try:
    from redraft.datastore.drafting.native import (
        NativeLearnedIndex,
        NativeSessionDrafter,
    )
    from redraft.datastore.drafting.native.mapped_store import store_of
    _MISSING: str | None = None
except ImportError as exc:  # the extension is built by `pip install` (setup.py)
    NativeLearnedIndex = NativeSessionDrafter = store_of = None  # type: ignore[assignment]
    _MISSING = str(exc)
_warned = False


def uses_native(choice: str | None = None) -> bool:
    """Whether drafting runs on the compiled core: `choice` (None or auto: $REDRAFT_DRAFTING,
    else auto) is one of CHOICES; ValueError for anything else, RuntimeError for `native`
    without the core."""
    global _warned
    if choice is None or choice.strip().lower() == "auto":  # auto: the environment decides
        choice = os.environ.get(DRAFTING_ENV) or "auto"
    choice = choice.strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"{DRAFTING_ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "python":
        return False
    if _MISSING is None:
        return True
    if choice == "native":
        raise RuntimeError(f"{DRAFTING_ENV}=native but the compiled drafting core is not built "
                           f"({_MISSING}); reinstall redraft (pip install -e .)")
    if not _warned:
        _warned = True
        log.warning("the compiled drafting core is not built (%s); drafting with the Python "
                    "reference (reinstall redraft to build it)", _MISSING)
    return False


def new_learned_index(max_tokens: int = 1_000_000, shared: bool = False,
                      journal: OutputJournal | None = None, choice: str | None = None):
    """A learned-output index of the chosen implementation (LearnedIndex's API)."""
    cls = NativeLearnedIndex if uses_native(choice) else LearnedIndex
    return cls(max_tokens, shared=shared, journal=journal)


def new_session_drafter(prompt: Sequence[int], settings: DraftSettings, reader=None,
                        learned=None, tenant: str = "", choice: str | None = None):
    """A session drafter (SessionDrafter's API) of the implementation `learned` belongs to,
    or, without one, of the chosen implementation."""
    if learned is not None:
        native = NativeLearnedIndex is not None and isinstance(learned, NativeLearnedIndex)
    else:
        native = uses_native(choice)
    cls = NativeSessionDrafter if native else SessionDrafter
    return cls(prompt, settings, reader, learned, tenant)


def prepare_reader(reader, choice: str | None = None) -> None:
    """Do now, on the caller's thread, what the first session over `reader` would otherwise
    do on its own: the core's tables over its arrays (a reload builds them for new segments
    only). Nothing with the Python reference."""
    if uses_native(choice) and not reader.closed:
        store_of(reader)
