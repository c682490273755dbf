"""`rest`: retrieval from a datastore, opened in this process or asked over gRPC.

`DatastoreDrafter` reads a datastore directory in process (`--datastore DIR`);
`ServiceDrafter` asks the draft service (`--draft-service ADDR`), one streaming session per
generation, and if the service cannot be reached or fails mid-generation it switches to
local drafting for the rest of that generation. Output never changes: drafts only affect
speed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redraft.decoder.drafters.base import DEFAULT_MAX_DEPTH, Drafter, UnknownDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.tree import Tree

log = logging.getLogger("redraft.decoder")


class DatastoreDrafter(Drafter):
    """Retrieval from a datastore opened in this process (no server needed)."""

    name = "rest"

    def __init__(self, path: str, tokenizer=None, max_depth: int = DEFAULT_MAX_DEPTH,
                 corpora: Sequence[str] | None = None) -> None:
        from redraft.datastore.reader import Reader

        self.reader = Reader(path)
        if tokenizer is not None:
            try:
                self.reader.check_tokenizer(tokenizer)
            except BaseException:
                self.reader.close()
                raise
        self.max_depth = max_depth
        self.corpora = list(corpora) if corpora else None

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        draft = self.reader.propose(
            context, budget=budget, max_depth=self.max_depth, corpora=self.corpora
        )
        return draft

    def close(self) -> None:
        self.reader.close()


class ServiceDrafter(Drafter):
    """Retrieval drafts from the gRPC draft service: one streaming session per generation.

    The session sends only the tokens appended since the previous step. Any failure
    (unreachable server, timeout, server error, a session ended mid-generation) closes the
    session and hands the rest of the generation to `fallback` (local drafting; None means
    no drafts from this source). Output cannot change: drafts only decide speed.
    """

    name = "rest"

    def __init__(
        self,
        address: str,
        fingerprint: str,
        fallback: Drafter | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        token: str | None = None,
        timeout: float = 1.0,
        sources: Sequence[str] = ("rest",),
    ) -> None:
        from redraft.datastore.client import DraftClient

        self.address = address
        self.fingerprint = fingerprint
        self.fallback = fallback
        self.max_depth = max_depth
        self.sources = tuple(sources)
        self.client = DraftClient(address, token=token, timeout=timeout)
        self.failures = 0
        self._session = None
        self._sent = 0
        self._first = None
        self._failed = False

    def check(self) -> None:
        """Raise TokenizerMismatch now if the server's datastore uses another tokenizer.

        An unreachable server is not an error here: generation falls back to local drafts.
        """
        from redraft.datastore.client import ServiceError
        from redraft.datastore.errors import TokenizerMismatch

        try:
            info = self.client.info()
        except ServiceError as exc:
            log.warning("draft service %s unavailable (%s); using local drafts", self.address, exc)
            return
        if info.tokenizer_fingerprint != self.fingerprint:
            raise TokenizerMismatch(
                f"draft service {self.address} serves a datastore built with tokenizer "
                f"{info.tokenizer_name or '?'} ({info.tokenizer_fingerprint}); this model's "
                f"tokenizer is {self.fingerprint}"
            )

    def begin(self, prompt: Sequence[int]) -> None:
        from redraft.datastore.client import DraftParams

        self._close_session()
        self._failed = False
        self._first = None
        try:
            params = DraftParams(max_depth=self.max_depth, sources=self.sources)
            self._session = self.client.session(list(prompt), params, self.fingerprint)
            self._first = self._session.open()
            self._sent = len(prompt)
        except Exception as exc:  # any failure: local drafting for this generation
            self._fail(exc, prompt)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        if self._failed or self._session is None:
            if not self._failed:
                self._fail(RuntimeError("no open session"), context)
            return self.fallback.propose(context, budget) if self.fallback else Tree()
        try:
            if self._first is not None and self._sent == len(context):
                tree, self._first = self._first, None
                return tree.prune(budget)
            self._first = None
            draft = self._session.step(list(context[self._sent :]), budget=budget)
            self._sent = len(context)
            return draft
        except Exception as exc:
            self._fail(exc, context)
            return self.fallback.propose(context, budget) if self.fallback else Tree()

    def end(self) -> None:
        self._close_session()
        if self._failed and self.fallback is not None:
            self.fallback.end()

    def close(self) -> None:
        self._close_session()
        self.client.close()

    def _fail(self, exc: BaseException, context: Sequence[int]) -> None:
        self.failures += 1
        self._failed = True
        self._close_session()
        log.warning("draft service %s failed (%s); continuing with local drafts",
                    self.address, exc)
        if self.fallback is not None:
            self.fallback.begin(context)

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                session.close()
            except Exception:  # closing a broken stream must not raise
                pass


def make(ctx) -> Drafter:
    """In-process retrieval with a datastore, else the draft service; PLD is the service's
    fallback unless the combination already runs PLD."""
    if ctx.datastore and ctx.draft_service:
        raise UnknownDrafter("give either a datastore or a draft service, not both")
    if ctx.datastore:
        return DatastoreDrafter(ctx.datastore, ctx.tokenizer, max_depth=ctx.max_depth)
    if ctx.draft_service:
        from redraft.datastore.tokenizer import tokenizer_fingerprint

        fallback = None if "pld" in ctx.names else PLDDrafter(max_depth=ctx.max_depth)
        service = ServiceDrafter(ctx.draft_service, tokenizer_fingerprint(ctx.tokenizer),
                                 fallback, max_depth=ctx.max_depth, token=ctx.token)
        service.check()
        return service
    raise UnknownDrafter("drafter 'rest' needs a datastore (--datastore DIR) or a "
                         "draft service (--draft-service ADDR)")
