"""What a draft request asks for: one value, shared by the client, the wire, the server, the
in-process drafters and the engine adapters.

Why one value: the same six parameters used to be written as three types with their own
names and defaults (the client's, the session drafter's and the adapters'), and they drifted
apart. Here each has one name and one meaning of 0 / empty:

    budget         tree nodes drafted per step; 0 = the drafter's default
                   (the server's --budget, DEFAULT_BUDGET in process)
    max_depth      deepest node of the tree; 0 = the drafter's default
                   (the server's --depth, DEFAULT_MAX_DEPTH in process)
    sources        the sources drafted from (`tree.REST`, `PLD`, `LEARNED`); empty = REST and
                   PLD (LEARNED only when named), the wire's meaning
    corpora        the named corpora retrieval reads; empty = every corpus but the learned one
    min_match_len  shortest suffix match worth drafting from; 0 = each source's own default
                   (REST 2, PLD 1)
    max_match_len  longest suffix tried first; 0 = each source's own default (REST 16, PLD 8)

A drafter that drafts in process (`DraftSettings`) is handed the value with budget and depth
already filled in; the server fills them from its defaults in one place
(`ServiceConfig.draft_settings`).

Tested by: tests/proto/test_params.py, tests/datastore/service/test_wire.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from redraft.proto import draft_pb2
from redraft.proto.errors import InvalidQuery
from redraft.proto.tree import LEARNED, PLD, REST

SOURCES = (REST, PLD, LEARNED)  # every source, in the wire's order
SOURCE_ENUM = {REST: draft_pb2.SOURCE_REST, PLD: draft_pb2.SOURCE_PLD,
               LEARNED: draft_pb2.SOURCE_LEARNED}
SOURCE_NAMES = {v: k for k, v in SOURCE_ENUM.items()}
DEFAULT_SOURCES = (REST, PLD)  # what empty `sources` means
_UINT32 = 1 << 32  # the wire's counts are uint32


class InvalidParams(InvalidQuery):
    """A parameter the wire cannot carry: one line naming the field."""


@dataclass(frozen=True)
class DraftParams:
    """What a draft request asks for; 0 / empty: a default (see the module docstring)."""

    budget: int = 0
    max_depth: int = 0
    sources: Collection[str] = DEFAULT_SOURCES
    corpora: Sequence[str] = ()
    min_match_len: int = 0
    max_match_len: int = 0

    def check(self) -> None:
        """Raise InvalidParams (one line, one per field) for a value the wire cannot carry."""
        for name in ("budget", "max_depth", "min_match_len", "max_match_len"):
            value = getattr(self, name)
            if (not isinstance(value, int) or isinstance(value, bool) or value < 0
                    or value >= _UINT32):
                raise InvalidParams(f"{name} must be a non-negative integer, got {value!r}")
        unknown = [s for s in self.sources if s not in SOURCES]
        if unknown:
            raise InvalidParams(f"unknown draft sources {unknown} (use 'rest', 'pld', "
                                "'learned')")
        if isinstance(self.corpora, str) or any(not isinstance(c, str) for c in self.corpora):
            raise InvalidParams(f"corpora must be a sequence of names, got {self.corpora!r}")

    def to_proto(self) -> draft_pb2.DraftParams:
        """The wire's message (checked first: InvalidParams)."""
        self.check()
        return draft_pb2.DraftParams(
            budget=self.budget, max_depth=self.max_depth,
            sources=[SOURCE_ENUM[s] for s in self.sources], corpora=list(self.corpora),
            min_match_len=self.min_match_len, max_match_len=self.max_match_len)

    @classmethod
    def from_proto(cls, p: draft_pb2.DraftParams) -> DraftParams:
        """The value a message carries (sources in its order; an unknown one: InvalidParams,
        which the server answers as its own refusal)."""
        unknown = [s for s in p.sources if s not in SOURCE_NAMES]
        if unknown:
            raise InvalidParams(f"unknown draft sources {unknown}")
        return cls(budget=p.budget, max_depth=p.max_depth,
                   sources=tuple(SOURCE_NAMES[s] for s in p.sources),
                   corpora=tuple(p.corpora), min_match_len=p.min_match_len,
                   max_match_len=p.max_match_len)

    def source_set(self) -> frozenset[str]:
        """The sources drafted from (empty `sources`: REST and PLD)."""
        return frozenset(self.sources or DEFAULT_SOURCES)

    def replace(self, **changes) -> DraftParams:
        """This value with some fields changed."""
        return dataclasses.replace(self, **changes)

    def with_defaults(self, budget: int, max_depth: int) -> DraftParams:
        """This value with a 0 budget or depth replaced by the drafter's own default."""
        return self.replace(budget=self.budget or budget, max_depth=self.max_depth or max_depth)
