"""One generation's retrieval drafts, from the draft service or a datastore in this process,
with a fallback when the service fails: the one owner of that lifecycle.

Why one owner: the decoder's `rest` drafters and every engine adapter draft the same way. A
`DraftSource` holds what outlives a generation (the service's connection or the datastore,
the learned outputs, the tokenizer and corpus checks, when the service may be tried again);
`open(prompt)` starts one generation's `DraftStream`: `extend(tokens)` (accepted tokens:
learned at once in process, sent with the next request to the service), `propose(budget)` (a
tree for the context so far; only the tokens the service has not seen are sent) and `close()`
(the generation is over: the last tokens go to the service, so it learns the whole output).
The drafters (`redraft.decoder.drafters.source_drafter`) and the engines' adapters
(`redraft.decoder.engines.streams`) are thin wrappers over it.

Output never depends on drafts, so no failure of the service may reach the caller: a stream
whose service call fails drafts by its fallback (prompt lookup in process, unless the caller
gives another or none) over the context it kept, for the rest of its generation, and the source
leaves the service alone for `retry_after` seconds (streams opened meanwhile start on the
fallback, without waiting on a dead server). Torch-free: the engines load it.

Tested by: tests/decoder/test_draft_source.py, tests/decoder/drafters/test_datastore_drafter.py,
tests/decoder/engines/test_llama_cpp.py
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from redraft.datastore import Reader
from redraft.datastore.drafting import (
    DEFAULT_PARAMS,
    DraftSettings,
    LearnedIndex,
    new_session_drafter,
)
from redraft.proto.errors import InvalidQuery, RedraftError, TokenizerMismatch
from redraft.proto.params import DraftParams
from redraft.proto.tree import DEFAULT_BUDGET, DEFAULT_MAX_DEPTH, PLD, Tree

log = logging.getLogger("redraft.drafts")

RETRY_AFTER = 30.0  # seconds a failed service is left alone
FINGERPRINT_PREFIX = "sha256:"  # what `tokenizer_fingerprint` values start with


class DraftConfigError(RedraftError, ValueError):
    """A draft source was given arguments it cannot work with (one line says which)."""


class DraftStream:
    """One generation's drafting (see the module docstring)."""

    failed = False  # True once the service failed and the fallback took over

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the context (accepted drafts and the token after them)."""

    def propose(self, budget: int | None = None) -> Tree:
        """A tree of at most `budget` nodes (None: the source's) continuing the context."""
        return Tree()

    def close(self) -> None:
        """The generation is over: what was accepted is final (learned outputs)."""


class LocalStream(DraftStream):
    """Drafts from a datastore opened in this process (or prompt lookup alone: reader None)."""

    def __init__(self, prompt: Sequence[int], settings: DraftSettings,
                 reader: Reader | None = None, learned=None, tenant: str = "") -> None:
        self._session = new_session_drafter(prompt, settings, reader, learned, tenant)

    def extend(self, tokens: Sequence[int]) -> None:
        self._session.extend(tokens)

    def propose(self, budget: int | None = None) -> Tree:
        return self._session.propose(budget)

    def close(self) -> None:
        self._session.close()


class ServiceStream(DraftStream):
    """Drafts from one streaming session of the draft service; the fallback after a failure.

    The context is kept once: by the session (`DraftSession.context`, what it reopens with
    after a reconnect), this stream holding only the tokens accepted since its last step;
    after a failure the fallback starts from the two."""

    def __init__(self, source: DraftSource, prompt: Sequence[int]) -> None:
        self._source = source
        self._context = [int(t) for t in prompt]  # the session's own list, once it has one
        self._unsent: list[int] = []
        self._fresh: Tree | None = None  # the draft the session opened with, not yet used
        self._fallback: DraftStream | None = None
        self._session = None
        if not source.service_usable():
            self._fail(None)
            return
        try:
            self._session = source.client.session(self._context, source.params,
                                                  source.fingerprint(), tenant=source.tenant)
            self._context = self._session.context
            self._fresh = self._session.open()
        except Exception as exc:  # any failure: the fallback for this generation
            self._fail(exc)

    def extend(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if self._fallback is not None:
            self._fallback.extend(tokens)
            return
        self._unsent.extend(tokens)
        if tokens:
            self._fresh = None

    def propose(self, budget: int | None = None) -> Tree:
        if self._fallback is not None:
            return self._fallback.propose(budget)
        if self._fresh is not None:
            draft, self._fresh = self._fresh, None
            return draft if budget is None else draft.prune(budget)
        sent = len(self._context)  # a failed step may have added the unsent tokens or not
        try:
            draft = self._session.step(self._unsent, budget=budget)
        except Exception as exc:
            self._fail(exc, sent)
            return self._fallback.propose(budget)
        self._unsent = []
        return draft

    def close(self) -> None:
        if self._fallback is not None:
            self._fallback.close()
            return
        if self._unsent and self._session is not None:
            try:  # the last tokens, so the service learns the whole output
                self._session.step(self._unsent, budget=1)
            except Exception:  # the generation is over: nothing depends on this step
                pass
        self._unsent = []
        self._end_session()

    def _fail(self, exc: BaseException | None, sent: int | None = None) -> None:
        """The fallback from now on, over the context so far: the first `sent` tokens the
        session holds (None: all of them) and those not sent yet."""
        self.failed = True
        self._end_session()
        if exc is not None:
            self._source.service_failed(exc)
        context = self._context if sent is None else self._context[:sent]
        self._fallback = self._source.open_fallback(context + self._unsent)
        self._context = []
        self._unsent = []

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                session.close()
            except Exception:  # closing a broken stream must not raise
                pass


class DraftSource:
    """Opens one `DraftStream` per generation: `service="HOST:PORT"` or `datastore=DIR`.

    `params`: what each draft asks for (the one parameters value; its `corpora`, retrieval
    from these only, must each exist; a 0 budget or depth is the server's default over the
    service, DEFAULT_BUDGET / DEFAULT_MAX_DEPTH in process). `tokenizer`: a fingerprint, model
    name, `.gguf` path or loaded tokenizer whose fingerprint must be the datastore's (None:
    checked later by `check_tokenizer`, or trusted: ids then only need to be in the
    datastore's vocabulary). `learned`: the index of earlier outputs a datastore in process
    drafts from and adds to. `fallback`: how a stream drafts after the service failed: True
    (prompt lookup in process), False (no drafts) or a function of the context so far that
    opens a `DraftStream`. `failures`: service calls that failed; `fallbacks`: streams that
    drafted by the fallback (a failed service, or one left alone after a failure).
    """

    def __init__(self, *, service: str | None = None, datastore: str | None = None,
                 params: DraftParams = DEFAULT_PARAMS, tenant: str = "",
                 learned: LearnedIndex | None = None, token: str | None = None,
                 tls: bool | str = False, tokenizer=None, timeout: float = 1.0,
                 retry_after: float = RETRY_AFTER,
                 fallback: bool | Callable[[list[int]], DraftStream] = True) -> None:
        if (service is None) == (datastore is None):
            raise DraftConfigError("give exactly one of service='HOST:PORT' (the draft "
                                   "service) or datastore=DIR (a datastore in this process)")
        if not isinstance(params, DraftParams):
            raise DraftConfigError(f"params must be a DraftParams, got {params!r}")
        params.check()  # bad values fail here (InvalidParams), not at the first generation
        self.params = params
        self.tenant = tenant
        self.learned = learned
        self.failures = 0
        self.fallbacks = 0
        self.retry_after = float(retry_after)
        self.tokenizer_checked = False
        self._fallback = fallback
        self._down_until = 0.0
        self._wanted: str | None = None  # the model's tokenizer fingerprint, once known
        self._info = None  # what the service said it serves, once reached
        self.reader = self.client = None
        drafted = params.with_defaults(DEFAULT_BUDGET, DEFAULT_MAX_DEPTH)  # in process
        self.fallback_settings = DraftSettings(drafted.replace(sources=(PLD,), corpora=()))
        self.settings = DraftSettings(drafted)
        if datastore is not None:
            self._open_datastore(str(datastore), tokenizer)
        else:
            self._open_service(service, token, tls, tokenizer, float(timeout))

    # ---- opening ------------------------------------------------------------------------
    def _open_datastore(self, path: str, tokenizer) -> None:
        self.reader = Reader(path)
        try:
            if tokenizer is not None:
                self.check_tokenizer(tokenizer)
            unknown = [c for c in self.params.corpora if c not in self.reader.corpora]
            if unknown:
                raise DraftConfigError(f"unknown corpora {unknown} (the datastore has: "
                                       f"{', '.join(sorted(self.reader.corpora)) or 'none'})")
        except BaseException:
            self.reader.close()
            raise

    def _open_service(self, address: str, token: str | None, tls: bool | str, tokenizer,
                      timeout: float) -> None:
        # lazy: grpc is loaded only when a service is used
        from redraft.datastore.service.client import DraftClient

        if tokenizer is not None:
            self._wanted = fingerprint_of(tokenizer)
            self.tokenizer_checked = True
        self.client = DraftClient(address, token=token, tls=tls, timeout=timeout)
        try:
            self.check()
        except BaseException:
            self.client.close()
            raise

    # ---- checks -------------------------------------------------------------------------
    def check(self) -> None:
        """Ask the service what it serves: its tokenizer must be the model's (when known) and
        each corpus asked for one of its. An unreachable service is not an error: streams
        draft by the fallback until it is tried again. Nothing to ask of a datastore."""
        # lazy: grpc is loaded only when a service is used
        from redraft.datastore.service.client import ServiceError

        if self.client is None or not self.service_usable():
            return
        try:
            info = self.client.info()
        except ServiceError as exc:
            self.service_failed(exc)
            return
        self._info = info
        if self._wanted is not None:
            self._compare(self._wanted)
        unknown = [c for c in self.params.corpora if info.corpora and c not in info.corpora]
        if unknown:
            raise DraftConfigError(f"unknown corpora {unknown} (the service has: "
                                   f"{', '.join(sorted(info.corpora))})")

    def check_tokenizer(self, tokenizer) -> None:
        """Raise TokenizerMismatch unless `tokenizer` (a fingerprint, model name, `.gguf`
        path or tokenizer) is the one the datastore was built with, and, over the service,
        the one this source was made for. An unreachable service is not an error: its
        sessions are opened with this fingerprint, and refused if it is wrong."""
        wanted = fingerprint_of(tokenizer)
        if self.reader is not None:
            self.reader.check_tokenizer(wanted)
        else:
            if self._wanted is not None and wanted != self._wanted:
                raise TokenizerMismatch(f"this draft source was made for tokenizer "
                                        f"{self._wanted}; this model's tokenizer is {wanted}")
            self._wanted = wanted
            if self._info is None:
                self.check()
            else:
                self._compare(wanted)
        self.tokenizer_checked = True

    def _compare(self, wanted: str) -> None:
        info = self._info
        if info.tokenizer_fingerprint != wanted:
            raise TokenizerMismatch(
                f"draft service {self.client.address} serves a datastore built with tokenizer "
                f"{info.tokenizer_name or '?'} ({info.tokenizer_fingerprint}); this model's "
                f"tokenizer is {wanted}")

    def fingerprint(self) -> str:
        """The fingerprint sessions open with: the model's, else the service's (asked now
        if it was not reached yet; raises if it cannot be)."""
        if self._wanted is not None:
            return self._wanted
        if self._info is None:
            self._info = self.client.info()
        return self._info.tokenizer_fingerprint

    # ---- the service's health -----------------------------------------------------------
    def service_usable(self) -> bool:
        """False for `retry_after` seconds after the service failed."""
        return time.monotonic() >= self._down_until

    def service_failed(self, exc: BaseException) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.retry_after
        log.warning("draft service %s failed (%s); local drafts for %g s, then it is tried "
                    "again", self.address, exc, self.retry_after)

    @property
    def address(self) -> str:
        return self.client.address if self.client is not None else "?"

    # ---- streams ------------------------------------------------------------------------
    def open(self, prompt: Sequence[int]) -> DraftStream:
        """One generation's stream, starting from `prompt`."""
        if self.client is not None:
            return ServiceStream(self, prompt)
        return LocalStream(prompt, self.settings, self.reader, self.learned, self.tenant)

    def open_fallback(self, context: list[int]) -> DraftStream:
        """The fallback's stream over `context` (a stream whose service failed, or was down)."""
        self.fallbacks += 1
        if callable(self._fallback):
            return self._fallback(context)
        if self._fallback:
            return LocalStream(context, self.fallback_settings)
        return DraftStream()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.reader is not None:
            self.reader.close()


def fingerprint_of(tokenizer) -> str:
    """The fingerprint of a tokenizer, a model name's or `.gguf` path's tokenizer, or the
    fingerprint itself (a string starting `sha256:`)."""
    if isinstance(tokenizer, str) and tokenizer.startswith(FINGERPRINT_PREFIX):
        return tokenizer
    # lazy: transformers is loaded only when a tokenizer is checked
    from redraft.proto.models import load_tokenizer, tokenizer_fingerprint

    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    try:
        return tokenizer_fingerprint(tokenizer)
    except (AttributeError, TypeError) as exc:
        raise InvalidQuery(f"tokenizer must be a model name, a .gguf path or a tokenizer: "
                           f"{exc}") from None
