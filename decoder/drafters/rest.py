"""`rest`: retrieval from a datastore, opened in this process or asked over gRPC, plus the
outputs learned from earlier generations.

`DatastoreDrafter` reads a datastore directory in process (`--datastore DIR`) through the
same session drafter the draft service runs (`redraft.datastore.drafting`: the compiled core
unless REDRAFT_DRAFTING=python), so both paths draft with the same tunings and trees; it
learns from this process's generations. `ServiceDrafter`
asks the draft service (`--draft-service ADDR`), one streaming session per generation,
which learns from every session it serves; if the service cannot be reached or fails
mid-generation it switches to local drafting for the rest of that generation. Output never
changes: drafts only affect speed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redraft.datastore import Reader
from redraft.datastore.drafting import (
    DraftSettings,
    LearnedIndex,
    new_learned_index,
    new_session_drafter,
)
from redraft.decoder.drafter import DEFAULT_MAX_DEPTH, Drafter, UnknownDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.proto.errors import TokenizerMismatch
from redraft.proto.models import tokenizer_fingerprint
from redraft.proto.tree import LEARNED, REST, Tree

log = logging.getLogger("redraft.decoder")


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


def service_credentials(args) -> tuple[str | None, bool | str]:
    """A command's draft-service token (--token, --token-file or $REDRAFT_TOKEN) and TLS
    (--tls, --tls-ca), checked before any model loads; none without --draft-service."""
    if not getattr(args, "draft_service", None):
        return None, False
    from redraft.datastore.service.client import (  # lazy: gRPC only for a service
        client_tls,
        client_token,
    )

    return client_token(args.token, args.token_file), client_tls(args.tls, args.tls_ca)


def make(ctx) -> Drafter:
    """In-process retrieval with a datastore, else the draft service; PLD is the service's
    fallback unless the combination already runs PLD. Learned drafts come with either
    unless `--learn off`."""
    if ctx.datastore and ctx.draft_service:
        raise UnknownDrafter("give either a datastore or a draft service, not both")
    learn = str(ctx.option("learn")).lower()
    if learn not in ("on", "off"):
        raise UnknownDrafter(f"--learn takes on or off, got {learn!r}")
    if ctx.datastore:
        max_tokens = int(ctx.option("learn_max_tokens"))
        if max_tokens <= 0:
            raise UnknownDrafter(f"--learn-max-tokens must be positive, got {max_tokens}")
        learned = new_learned_index(max_tokens) if learn == "on" else None
        return DatastoreDrafter(ctx.datastore, ctx.tokenizer, max_depth=ctx.max_depth,
                                learned=learned)
    if ctx.draft_service:
        fallback = None if "pld" in ctx.names else PLDDrafter(max_depth=ctx.max_depth)
        sources = (REST, LEARNED) if learn == "on" else (REST,)
        service = ServiceDrafter(ctx.draft_service, tokenizer_fingerprint(ctx.tokenizer),
                                 fallback, max_depth=ctx.max_depth, token=ctx.token,
                                 sources=sources, tenant=str(ctx.option("tenant")),
                                 tls=ctx.tls)
        service.check()
        return service
    raise UnknownDrafter("drafter 'rest' needs a datastore (--datastore DIR) or a "
                         "draft service (--draft-service ADDR)")
