"""One generation's drafts for an engine adapter: from the draft service or a datastore opened
in this process, with prompt lookup taking over when the service fails.

An engine hands an adapter the tokens of a sequence as they are accepted; the adapter asks for
a draft tree when it wants one. `DraftStream` is that conversation for one generation:
`extend(tokens)` (accepted tokens, learned at once in process; sent with the next request to
the service), `propose()` (a tree for the context so far) and `close()` (the output is final).
`DraftSource` opens one stream per generation from the drafters' usual options.

Output never depends on drafts, so no failure of the service may reach the engine: a stream
whose service call fails switches to prompt lookup over the context it kept, for the rest of
its generation, and the source leaves the service alone for `retry_after` seconds.

Tested by: tests/decoder/engines/test_llama_cpp.py, tests/decoder/engines/test_vllm.py,
tests/decoder/engines/test_sglang.py
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from redraft.datastore import Reader
from redraft.datastore.drafting import DraftSettings, new_learned_index, new_session_drafter
from redraft.proto.errors import InvalidQuery, RedraftError, TokenizerMismatch
from redraft.proto.tree import DEFAULT_BUDGET, DEFAULT_MAX_DEPTH, LEARNED, PLD, REST, Tree

log = logging.getLogger("redraft.engines")

_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


class EngineConfigError(RedraftError, ValueError):
    """An adapter was given arguments it cannot work with (one line says which)."""


@dataclass(frozen=True)
class DraftOptions:
    """The drafters' usual options, as an engine adapter takes them."""

    budget: int = DEFAULT_BUDGET  # tree nodes drafted per request (the chain is cut from the tree)
    max_depth: int = DEFAULT_MAX_DEPTH
    corpora: tuple[str, ...] = ()
    tenant: str = ""
    learn: bool = True
    learn_max_tokens: int = 1_000_000  # in process only (the service has its own bound)

    def check(self) -> None:
        for name in ("budget", "max_depth", "learn_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.tenant, str):
            raise EngineConfigError(f"tenant must be a string, got {self.tenant!r}")
        if any(not isinstance(c, str) or not c for c in self.corpora):
            raise EngineConfigError(f"corpora must be non-empty names, got {self.corpora!r}")

    @property
    def sources(self) -> tuple[str, ...]:
        return (REST, PLD, LEARNED) if self.learn else (REST, PLD)


def check_address(address: str) -> str:
    """`HOST:PORT`, several comma-separated (replicas) or `dns:///NAME:PORT`, or raise
    EngineConfigError."""
    parts = address.split(",") if isinstance(address, str) else [None]
    if len(parts) == 1 and parts[0] is not None and parts[0].startswith("dns:///"):
        parts = [parts[0][len("dns:///"):]]
    for part in parts:
        m = _ADDRESS.match(part.strip()) if part is not None else None
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise EngineConfigError(f"service must be HOST:PORT (e.g. 127.0.0.1:50051), "
                                    f"several of them comma-separated, or dns:///NAME:PORT; "
                                    f"got {address!r}")
    return address


class DraftStream:
    """One generation's drafting (see the module docstring)."""

    failed = False  # True once the service failed and prompt lookup took over

    def extend(self, tokens: Sequence[int]) -> None:
        raise NotImplementedError

    def propose(self) -> Tree:
        raise NotImplementedError

    def close(self) -> None:
        """The generation is over: what was accepted is final (learned outputs)."""


class LocalStream(DraftStream):
    """Drafts from a datastore opened in this process (or prompt lookup alone: reader None)."""

    def __init__(self, prompt: Sequence[int], settings: DraftSettings,
                 reader: Reader | None = None, learned=None,
                 tenant: str = "") -> None:
        self._session = new_session_drafter(prompt, settings, reader, learned, tenant)

    def extend(self, tokens: Sequence[int]) -> None:
        self._session.extend(tokens)

    def propose(self) -> Tree:
        return self._session.propose()

    def close(self) -> None:
        self._session.close()


class ServiceStream(DraftStream):
    """Drafts from one streaming session of the draft service; prompt lookup after a failure."""

    def __init__(self, source: DraftSource, prompt: Sequence[int]) -> None:
        self._source = source
        self._context = [int(t) for t in prompt]
        self._unsent: list[int] = []
        self._fresh: Tree | None = None  # the draft the session opened with, not yet used
        self._fallback: LocalStream | None = None
        self._session = None
        if not source.service_usable():
            self._fail(None)
            return
        try:
            self._session = source.client.session(self._context, source.params,
                                                  source.fingerprint(), tenant=source.tenant)
            self._fresh = self._session.open()
        except Exception as exc:  # any failure: prompt lookup for this generation
            self._fail(exc)

    def extend(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if self._fallback is not None:
            self._fallback.extend(tokens)
            return
        self._context.extend(tokens)
        self._unsent.extend(tokens)
        if tokens:
            self._fresh = None

    def propose(self) -> Tree:
        if self._fallback is not None:
            return self._fallback.propose()
        if self._fresh is not None:
            draft, self._fresh = self._fresh, None
            return draft
        try:
            draft = self._session.step(self._unsent)
        except Exception as exc:
            self._fail(exc)
            return self._fallback.propose()
        self._unsent = []
        return draft

    def close(self) -> None:
        if self._fallback is not None:
            self._fallback.close()
            return
        session, self._session = self._session, None
        if session is None:
            return
        if self._unsent:
            try:  # the last tokens, so the service learns the whole output
                session.step(self._unsent, budget=1)
            except Exception:  # the generation is over: nothing depends on this step
                pass
            self._unsent = []
        session.close()

    def _fail(self, exc: BaseException | None) -> None:
        self.failed = True
        if self._session is not None:
            try:
                self._session.close()
            except Exception:
                pass
            self._session = None
        if exc is not None:
            self._source.service_failed(exc)
        self._fallback = LocalStream(self._context, self._source.fallback_settings)
        self._context = []
        self._unsent = []


class DraftSource:
    """Opens one `DraftStream` per generation: `service="HOST:PORT"` or `datastore=DIR`.

    `tokenizer`: a model name, `.gguf` path or loaded tokenizer whose fingerprint must match
    the datastore's (None: trust the datastore; ids then only need to be in its vocabulary).
    """

    def __init__(self, *, service: str | None = None, datastore: str | None = None,
                 options: DraftOptions = DraftOptions(), token: str | None = None,
                 tokenizer=None, timeout: float = 1.0, retry_after: float = 30.0) -> None:
        if (service is None) == (datastore is None):
            raise EngineConfigError("give exactly one of service='HOST:PORT' (the draft "
                                    "service) or datastore=DIR (a datastore in this process)")
        options.check()
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise EngineConfigError(f"timeout must be a positive number of seconds, "
                                    f"got {timeout!r}")
        if token is not None and not isinstance(token, str):
            raise EngineConfigError("token must be a string")
        self.options = options
        self.tenant = options.tenant
        self.failures = 0
        self.retry_after = float(retry_after)
        self._down_until = 0.0
        self._fingerprint: str | None = None
        self.reader = self.learned = self.client = None
        self.fallback_settings = DraftSettings(budget=options.budget,
                                               max_depth=options.max_depth,
                                               sources=frozenset({PLD}))
        if datastore is not None:
            self._open_datastore(str(datastore), tokenizer)
        else:
            self._open_service(check_address(service), token, tokenizer, float(timeout))

    # ---- in process ---------------------------------------------------------------------
    def _open_datastore(self, path: str, tokenizer) -> None:
        o = self.options
        self.reader = Reader(path)
        try:
            if tokenizer is not None:
                self.check_tokenizer(tokenizer)
            unknown = [c for c in o.corpora if c not in self.reader.corpora]
            if unknown:
                raise EngineConfigError(f"unknown corpora {unknown} (the datastore has: "
                                        f"{', '.join(sorted(self.reader.corpora)) or 'none'})")
        except BaseException:
            self.reader.close()
            raise
        self.learned = new_learned_index(o.learn_max_tokens) if o.learn else None
        self.settings = DraftSettings(budget=o.budget, max_depth=o.max_depth,
                                      sources=frozenset(o.sources),
                                      corpora=o.corpora or None)

    # ---- over the service ---------------------------------------------------------------
    def _open_service(self, address: str, token: str | None, tokenizer, timeout: float) -> None:
        # lazy: grpc is loaded only when a service is used
        from redraft.datastore.service.client import DraftClient, DraftParams, ServiceError

        o = self.options
        self.params = DraftParams(budget=o.budget, max_depth=o.max_depth, sources=o.sources,
                                  corpora=o.corpora)
        self.params.to_proto()  # bad values fail here, not at the first generation
        self.client = DraftClient(address, token=token, timeout=timeout)
        try:
            info = self.client.info()
        except ServiceError as exc:  # unreachable now: drafts fall back until it is back
            self.service_failed(exc)
            if tokenizer is not None:
                self._fingerprint = _fingerprint_of(tokenizer)
            return
        try:
            if tokenizer is not None:
                self.check_tokenizer(tokenizer, info)
        except BaseException:
            self.client.close()
            raise
        unknown = [c for c in o.corpora if info.corpora and c not in info.corpora]
        if unknown:
            self.client.close()
            raise EngineConfigError(f"unknown corpora {unknown} (the service has: "
                                    f"{', '.join(sorted(info.corpora))})")
        self._fingerprint = info.tokenizer_fingerprint

    def check_tokenizer(self, tokenizer, info=None) -> None:
        """Raise TokenizerMismatch unless `tokenizer` (a model name, `.gguf` path or
        tokenizer) is the one the datastore was built with. An unreachable service is not
        an error: its sessions are then opened with this fingerprint, and refused if wrong."""
        # lazy: grpc is loaded only when a service is used
        from redraft.datastore.service.client import ServiceError

        wanted = _fingerprint_of(tokenizer)
        if self.reader is not None:
            self.reader.check_tokenizer(wanted)
            return
        if info is None:
            try:
                info = self.client.info()
            except ServiceError:
                self._fingerprint = wanted
                return
        if info.tokenizer_fingerprint != wanted:
            raise TokenizerMismatch(
                f"draft service {self.client.address} serves a datastore built with tokenizer "
                f"{info.tokenizer_name or '?'} ({info.tokenizer_fingerprint}); this model's "
                f"tokenizer is {wanted}")
        self._fingerprint = wanted

    def fingerprint(self) -> str:
        """The fingerprint sessions open with (the server's, when none was given)."""
        if self._fingerprint is None:
            self._fingerprint = self.client.info().tokenizer_fingerprint
        return self._fingerprint

    def service_usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def service_failed(self, exc: BaseException) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.retry_after
        log.warning("draft service %s failed (%s); prompt lookup drafts until it is back",
                    self.client.address if self.client else "?", exc)

    # ---- streams ------------------------------------------------------------------------
    def open(self, prompt: Sequence[int]) -> DraftStream:
        if self.client is not None:
            return ServiceStream(self, prompt)
        return LocalStream(prompt, self.settings, self.reader, self.learned, self.tenant)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.reader is not None:
            self.reader.close()


def _fingerprint_of(tokenizer) -> str:
    """The fingerprint of a tokenizer, or of a model name / `.gguf` path's tokenizer."""
    # lazy: transformers is loaded only when a tokenizer is checked
    from redraft.proto.models import load_tokenizer, tokenizer_fingerprint

    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    try:
        return tokenizer_fingerprint(tokenizer)
    except (AttributeError, TypeError) as exc:
        raise InvalidQuery(f"tokenizer must be a model name, a .gguf path or a tokenizer: "
                           f"{exc}") from None
