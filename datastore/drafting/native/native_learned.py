"""Learned outputs kept in the compiled core: LearnedIndex's API and drafts, in C++.

Why a second index: a session drafted by the core must read learned outputs without a
call back into Python. Same documents, pools (dropped once empty), bound, eviction order,
trees and journal records as redraft.datastore.drafting.learned_index.LearnedIndex (the
reference), which the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redraft.datastore.drafting.native._core as _core
from redraft.datastore.drafting.learned_index import (
    MAX_MATCH,
    PROMPT_TAIL,
    JournaledOutput,
    OutputJournal,
)
from redraft.proto.tree import Tree


def tenant_bytes(tenant: str) -> bytes:
    """A tenant key as the core keeps it (any str, lone surrogates included)."""
    if not isinstance(tenant, str):
        raise TypeError(f"a tenant is a str, not a {type(tenant).__name__}")
    return tenant.encode("utf-8", "surrogatepass")


class NativeLearnedIndex:
    """Outputs of many generations, indexed for drafting; bounded to `max_tokens` tokens.

    Token ids must be integers in [0, 2**32). Thread-safe. `journal`: as LearnedIndex's.
    """

    def __init__(self, max_tokens: int = 1_000_000, shared: bool = False,
                 journal: OutputJournal | None = None) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.shared = shared
        self.journal = journal
        self._core = _core.Learned(self.max_tokens, bool(shared))

    @property
    def n_tokens(self) -> int:
        return self._core.n_tokens

    def writer(self, tenant: str, prompt: Sequence[int], journal: bool = True
               ) -> NativeLearnedWriter:
        """A handle that records one generation's accepted tokens for `tenant` (and in the
        journal, unless `journal` is False: outputs replayed from elsewhere)."""
        return NativeLearnedWriter(self, tenant, prompt, self.journal if journal else None)

    def journaled(self, tenant: str, prompt: Sequence[int]) -> JournaledOutput | None:
        """How a new output of `tenant` after `prompt` reaches the journal (None: none)."""
        if self.journal is None:
            return None
        return JournaledOutput(self.journal, tenant, [int(t) for t in prompt[-PROMPT_TAIL:]])

    def propose(self, tenant: str, context: Sequence[int], budget: int, max_depth: int
                ) -> Tree:
        """A tree continuing `context` from the outputs of `tenant`'s pool."""
        (tokens, parents, probs, sources), match_len = self._core.propose(
            tenant_bytes(tenant), list(context[-MAX_MATCH:]), budget, max_depth)
        return Tree(tokens, parents, probs, sources, match_len)

    def load(self, documents: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Add finished documents (tenant, tokens), oldest first (outputs persisted earlier:
        not journaled again)."""
        self._core.load((tenant_bytes(t), tokens) for t, tokens in documents)

    def stats(self) -> dict:
        return self._core.stats()


class NativeLearnedWriter:
    """Records one generation's accepted tokens (see learned_index.LearnedWriter)."""

    def __init__(self, index: NativeLearnedIndex, tenant: str, prompt: Sequence[int],
                 journal: OutputJournal | None) -> None:
        self.index = index
        self.tenant = tenant
        head = [int(t) for t in prompt[-PROMPT_TAIL:]]
        self._core = _core.Writer(index._core, tenant_bytes(tenant), head)
        self._journaled = JournaledOutput(journal, tenant, head) if journal is not None \
            else None

    def extend(self, tokens: Sequence[int]) -> None:
        self._core.extend(tokens)
        if self._journaled is not None:
            self._journaled.record(tokens)

    def close(self) -> None:
        """The generation ended: its output is final."""
        self._core.close()
        if self._journaled is not None:
            self._journaled.end()
