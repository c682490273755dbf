"""`pld`: prompt lookup over the prompt and the output so far (no corpus, no network).

Tested by: tests/decoder/test_generate.py, tests/decoder/test_acceptance.py"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.datastore.drafting import PromptLookup
from redraft.decoder.drafter import Drafter
from redraft.proto.tree import DEFAULT_MAX_DEPTH, Tree


class PLDDrafter(Drafter):
    """Prompt lookup over prompt + output so far, with an incremental n-gram index."""

    name = "pld"

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, **lookup_kwargs) -> None:
        self._factory = lambda: PromptLookup(**lookup_kwargs)
        self.max_depth = max_depth
        self._lookup = self._factory()

    def begin(self, prompt: Sequence[int]) -> None:
        self._lookup = self._factory()
        self._lookup.extend(prompt)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        lookup = self._lookup
        n = len(lookup)
        if n > len(context) or (n and lookup.tokens[-1] != context[n - 1]):
            # Out of step with the caller's context (e.g. reused without begin): rebuild.
            self._lookup = lookup = self._factory()
        if len(lookup) < len(context):
            lookup.extend(context[len(lookup) :])
        return lookup.propose(budget=budget, max_depth=self.max_depth)


def make(ctx) -> PLDDrafter:
    return PLDDrafter(max_depth=ctx.max_depth)
