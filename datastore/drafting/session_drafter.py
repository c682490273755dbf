"""One generation's drafting, without gRPC: retrieval (REST), prompt lookup (PLD) and learned
outputs, calibrated and merged under one budget.

Why one class: the draft service (one per streaming session) and the decoder's in-process
`--datastore` drafter both draft this way, so a tuning or a new source reaches both at once
instead of living in two copies that drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from redraft.datastore.drafting.learned_index import LearnedIndex
from redraft.datastore.drafting.prompt_lookup import PromptLookup
from redraft.datastore.drafting.retrieval import REST_CALIBRATION, calibrate, retrieval_tree
from redraft.datastore.manifest import LEARNED_CORPUS  # learned outputs persist as this corpus
from redraft.proto.errors import InvalidQuery
from redraft.proto.params import SOURCES, DraftParams
from redraft.proto.tree import (
    DEFAULT_BUDGET,
    DEFAULT_MAX_DEPTH,
    LEARNED,
    PLD,
    REST,
    Tree,
    merge,
    source_bits,
)

# What an in-process drafter drafts by default: every source, the usual budget and depth.
DEFAULT_PARAMS = DraftParams(budget=DEFAULT_BUDGET, max_depth=DEFAULT_MAX_DEPTH, sources=SOURCES)


@dataclass(frozen=True)
class DraftSettings:
    """How a session drafts: what was asked for (`params`, the one parameters value, its budget
    and depth as drafted: the server fills a request's 0s from its defaults first, in
    `ServiceConfig.draft_settings`) and the retrieval knobs only a drafter in process has."""

    params: DraftParams = DEFAULT_PARAMS
    rest_min_match: int = 2  # REST's match lengths where params ask 0
    rest_max_match: int = 16
    # Occurrences of the longest match the Reader samples: 64 drafts as well as its default
    # 256 on held-out code (same accepted tokens per step) at ~70% of the lookup time.
    rest_max_occurrences: int = 64
    # REST probabilities p become scale * p**power (retrieval.REST_CALIBRATION; (1, 1) = raw)
    rest_calibration: tuple[float, float] = REST_CALIBRATION


def retrieval_corpora(reader, corpora: Sequence[str] | None) -> list[str] | None:
    """The corpora retrieval may read: the given ones, or every corpus but the learned one.

    Learned outputs are drafted through the learned source, which keeps tenants apart; read
    as a corpus they would reach everyone. None means no corpus is left to read.
    """
    if corpora:
        if LEARNED_CORPUS in corpora:
            raise InvalidQuery(f"corpus {LEARNED_CORPUS!r} is drafted through the learned "
                               "source, not retrieval")
        return list(corpora)
    names = getattr(reader, "corpora", None) or {}
    if LEARNED_CORPUS not in names:
        return []  # every corpus (the Reader's own meaning of an empty list)
    rest = [n for n in names if n != LEARNED_CORPUS]
    return rest or None


class SessionDrafter:
    """Drafts for one generation from its prompt and the tokens accepted since.

    `reader`: a datastore Reader for REST (None: no retrieval). `learned`: the index of
    earlier outputs shared across sessions (None: no learning); this session's accepted
    tokens are added to it for `tenant` as they arrive, and drafts come from `tenant`'s
    outputs. Sources not asked for (`DraftParams.source_set`) are not drafted from.
    """

    def __init__(self, prompt: Sequence[int], settings: DraftSettings, reader=None,
                 learned: LearnedIndex | None = None, tenant: str = "") -> None:
        s = settings
        self.settings = s
        sources = s.params.source_set()
        self.context: list[int] = list(prompt)
        self.reader = reader if REST in sources else None
        self._corpora = (retrieval_corpora(reader, s.params.corpora) if self.reader is not None
                         else None)
        self.pld: PromptLookup | None = None
        if PLD in sources:
            max_ngram = s.params.max_match_len or 8
            self.pld = PromptLookup(max_ngram=max_ngram,
                                    min_ngram=min(s.params.min_match_len or 1, max_ngram))
            self.pld.extend(self.context)
        self.learned = learned
        self.tenant = tenant
        self._writer = learned.writer(tenant, self.context) if learned is not None else None
        self.rest_match_len = self.pld_match_len = self.learned_match_len = 0

    def __len__(self) -> int:
        """Tokens of the context."""
        return len(self.context)

    def use_reader(self, reader) -> None:
        """Draft retrieval from `reader` from now on: a newer snapshot of the same datastore
        (a server that follows its datastore's commits swaps it in between steps). Which
        corpora retrieval reads is decided again: the learned corpus may have appeared."""
        if self.reader is None or reader is self.reader:
            return
        self.reader = reader
        self._corpora = retrieval_corpora(reader, self.settings.params.corpora)

    def extend(self, accepted: Sequence[int]) -> None:
        """Tokens the decoder accepted since the last call (they are learned at once)."""
        self.context.extend(accepted)
        if self.pld is not None:
            self.pld.extend(accepted)
        if self._writer is not None:
            self._writer.extend(accepted)

    def propose(self, budget: int | None = None) -> Tree:
        """The merged tree of every source for the context so far, best nodes first."""
        s = self.settings
        p = s.params
        budget = p.budget if budget is None else budget
        context = self.context
        drafts: list[Tree] = []
        self.rest_match_len = self.pld_match_len = self.learned_match_len = 0
        if self.reader is not None and self._corpora is not None and context:
            max_match = p.max_match_len or s.rest_max_match
            min_match = min(p.min_match_len or s.rest_min_match, max_match)
            rest = retrieval_tree(
                self.reader, context[-max_match:], budget=budget, max_depth=p.max_depth,
                max_match_len=max_match, min_match_len=min_match,
                max_occurrences=s.rest_max_occurrences, corpora=self._corpora)
            self.rest_match_len = rest.match_len
            drafts.append(calibrate(rest, *s.rest_calibration))
        if self.pld is not None:
            d = self.pld.propose(budget=budget, max_depth=p.max_depth)
            self.pld_match_len = d.match_len
            drafts.append(d)
        if self.learned is not None and LEARNED in p.source_set():
            d = self.learned.propose(self.tenant, context, budget, p.max_depth)
            self.learned_match_len = d.match_len
            drafts.append(d)
        tree = merge(drafts, budget)
        tree.match_len = self.rest_match_len
        return tree

    def propose_arrays(self, budget: int | None = None) -> tuple[np.ndarray, ...]:
        """`propose`'s tree as arrays, as the compiled drafter gives them: tokens (uint32),
        parents (int32), probs (float64) and source bits (uint8, tree.SOURCE_BITS)."""
        tree = self.propose(budget)
        return (np.array(tree.tokens, np.uint32), np.array(tree.parents, np.int32),
                np.array(tree.probs, np.float64),
                np.array([source_bits(s) for s in tree.sources], np.uint8))

    def close(self) -> None:
        """The generation is over: its output is final in the learned index."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
