"""The `Drafter` over a draft source (`redraft.decoder.draft_source`): what the `rest` drafters,
in process and over the service, share.

The loop hands a drafter the whole context at each `propose` and the accepted tokens at each
`update`; a draft source's stream wants only the new tokens. `SourceDrafter` keeps the two in
step: `update` feeds the stream at once (learned outputs see every token, the last step's
too), `propose` feeds whatever the stream has not seen, and a context that does not continue
the stream's (a drafter reused without `begin`) starts a new one.

Tested by: tests/decoder/drafters/test_datastore_drafter.py, tests/decoder/test_draft_source.py,
tests/decoder/test_generate.py
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.decoder.draft_source import DraftSource, DraftStream
from redraft.decoder.drafter import Drafter
from redraft.proto.tree import DEFAULT_BUDGET, Tree


class SourceDrafter(Drafter):
    """One `DraftStream` of `source` per generation (see the module docstring). `failures`:
    the generations that drafted by the source's fallback."""

    name = "rest"

    def __init__(self, source: DraftSource) -> None:
        self.source = source
        self._stream: DraftStream | None = None
        self._fed = 0  # context tokens the stream has
        self._last: int | None = None  # the last of them

    def check_tokenizer(self, tokenizer) -> None:
        self.source.check_tokenizer(tokenizer)

    def begin(self, prompt: Sequence[int]) -> None:
        self.end()
        self._stream = self.source.open(prompt)
        self._fed = len(prompt)
        self._last = int(prompt[-1]) if len(prompt) else None

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        n = self._fed
        if self._stream is None or n > len(context) or (n and self._last != context[n - 1]):
            self.begin(context)  # out of step with the caller (e.g. reused without begin)
        elif n < len(context):
            self._feed(context[n:])
        return self._stream.propose(budget)

    def update(self, accepted: Sequence[int]) -> None:
        if self._stream is not None:
            self._feed(accepted)

    def _feed(self, tokens: Sequence[int]) -> None:
        self._stream.extend(tokens)
        self._fed += len(tokens)
        if len(tokens):
            self._last = int(tokens[-1])

    def end(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def close(self) -> None:
        self.end()
        self.source.close()

    @property
    def failures(self) -> int:  # type: ignore[override]
        return self.source.fallbacks


class DrafterStream(DraftStream):
    """A `Drafter` as a draft stream: a drafter as a draft source's fallback."""

    def __init__(self, drafter: Drafter, context: Sequence[int]) -> None:
        self.drafter = drafter
        self.context = list(context)
        drafter.begin(self.context)

    def extend(self, tokens: Sequence[int]) -> None:
        self.context.extend(tokens)

    def propose(self, budget: int | None = None) -> Tree:
        return self.drafter.propose(self.context, DEFAULT_BUDGET if budget is None else budget)

    def close(self) -> None:
        self.drafter.end()
