"""`rest` in process (`--datastore DIR`): retrieval from a datastore opened in this process,
plus the outputs learned from this process's earlier generations.

It drafts through the same session drafter the draft service runs
(`redraft.datastore.drafting`: the compiled core unless REDRAFT_DRAFTING=python), so both
paths draft with the same tunings and trees. Output never changes: drafts only affect speed.

Tested by: tests/decoder/drafters/test_datastore_drafter.py, tests/decoder/test_generate.py
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.datastore import Reader
from redraft.datastore.drafting import DraftSettings, LearnedIndex, new_session_drafter
from redraft.decoder.drafter import Drafter
from redraft.proto.errors import TokenizerMismatch
from redraft.proto.tree import DEFAULT_MAX_DEPTH, LEARNED, REST, Tree


class DatastoreDrafter(Drafter):
    """Retrieval and learned outputs from a datastore opened in this process (no server).

    `tokenizer`: the target's tokenizer (or its fingerprint), checked against the datastore's
    at once; None leaves the check to the Generator this drafter joins, which passes its own
    (`check_tokenizer`). Drafting before either check raises TokenizerMismatch: drafts in
    another tokenizer's ids would be verified as garbage. `learned`: the index of earlier
    outputs to draft from and add to (shared across this drafter's generations; pass one to
    share it further), None for retrieval only.
    """

    name = "rest"

    def __init__(self, path: str, tokenizer=None, max_depth: int = DEFAULT_MAX_DEPTH,
                 corpora: Sequence[str] | None = None,
                 learned: LearnedIndex | None = None) -> None:
        self.reader = Reader(path)
        self._tokenizer_checked = False
        if tokenizer is not None:
            try:
                self.check_tokenizer(tokenizer)
            except BaseException:
                self.reader.close()
                raise
        self.learned = learned
        sources = {REST, LEARNED} if learned is not None else {REST}
        self.settings = DraftSettings(max_depth=max_depth, sources=frozenset(sources),
                                      corpora=tuple(corpora) if corpora else None)
        self._session = None
        self._last = None  # the session's last context token

    def check_tokenizer(self, tokenizer) -> None:
        self.reader.check_tokenizer(tokenizer)
        self._tokenizer_checked = True

    def begin(self, prompt: Sequence[int]) -> None:
        self.end()
        if not self._tokenizer_checked:
            raise TokenizerMismatch(
                f"{self.reader.path}: no tokenizer was checked against this datastore's: pass "
                "DatastoreDrafter(path, tokenizer) or use the drafter in a Generator")
        self._session = new_session_drafter(prompt, self.settings, self.reader, self.learned)
        self._last = prompt[-1] if len(prompt) else None  # the context's last token

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        s = self._session
        n = len(s) if s is not None else -1
        if s is None or n > len(context) or (n and self._last != context[n - 1]):
            self.begin(context)  # out of step with the caller (e.g. reused without begin)
            s, n = self._session, len(context)
        if n < len(context):
            s.extend(context[n:])
        self._last = context[-1] if len(context) else None
        return s.propose(budget)

    def update(self, accepted: Sequence[int]) -> None:
        if self._session is not None:  # learned now (the last step's tokens come only here)
            self._session.extend(accepted)
            if len(accepted):
                self._last = accepted[-1]

    def end(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def close(self) -> None:
        self.end()
        self.reader.close()
