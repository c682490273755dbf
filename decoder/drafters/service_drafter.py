"""`rest` over gRPC (`--draft-service ADDR`): retrieval drafts from the draft service, one
streaming session per generation; the service learns from every session it serves.

If the service cannot be reached or fails mid-generation, the drafter switches to local
drafting for the rest of that generation. Output never changes: drafts only affect speed.

Tested by: tests/decoder/test_generate.py, tests/decoder/cli/test_generate_cli.py
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redraft.decoder.drafter import Drafter
from redraft.proto.errors import TokenizerMismatch
from redraft.proto.models import tokenizer_fingerprint
from redraft.proto.tree import DEFAULT_MAX_DEPTH, LEARNED, REST, Tree

log = logging.getLogger("redraft.decoder")


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
        sources: Sequence[str] = (REST, LEARNED),
        tenant: str = "",
        tls: bool | str = False,
    ) -> None:
        from redraft.datastore.service.client import DraftClient  # lazy: gRPC only for a service

        self.address = address
        self.fingerprint = fingerprint
        self.fallback = fallback
        self.max_depth = max_depth
        self.sources = tuple(sources)
        self.tenant = tenant
        self.client = DraftClient(address, token=token, tls=tls, timeout=timeout)
        self.failures = 0
        self._session = None
        self._sent = 0
        self._first = None
        self._failed = False
        self._unsent: list[int] = []  # accepted since the last step (the server learns them)

    def check_tokenizer(self, tokenizer) -> None:
        """The Generator's tokenizer must be the one this drafter was made for (`check` then
        compares that with the server's)."""
        given = tokenizer if isinstance(tokenizer, str) else tokenizer_fingerprint(tokenizer)
        if given != self.fingerprint:
            raise TokenizerMismatch(f"this drafter was made for tokenizer {self.fingerprint}; "
                                    f"the Generator's is {given}")

    def check(self) -> None:
        """Raise TokenizerMismatch now if the server's datastore uses another tokenizer.

        An unreachable server is not an error here: generation falls back to local drafts.
        """
        from redraft.datastore.service.client import ServiceError  # lazy: gRPC, as above

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
        from redraft.datastore.service.client import DraftParams  # lazy: gRPC, as above

        self._close_session()
        self._failed = False
        self._first = None
        self._unsent = []
        try:
            params = DraftParams(max_depth=self.max_depth, sources=self.sources)
            self._session = self.client.session(list(prompt), params, self.fingerprint,
                                                tenant=self.tenant)
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
            self._unsent = []
            return draft
        except Exception as exc:
            self._fail(exc, context)
            return self.fallback.propose(context, budget) if self.fallback else Tree()

    def update(self, accepted: Sequence[int]) -> None:
        self._unsent.extend(accepted)

    def end(self) -> None:
        if self._unsent and self._session is not None and not self._failed:
            try:  # the last step's tokens, so the server learns the whole output
                self._session.step(self._unsent, budget=1)
            except Exception:  # the generation is over: nothing depends on this step
                pass
        self._unsent = []
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
