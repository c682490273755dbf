"""One generation's drafts for an engine adapter: the adapters' options, checked, and the
draft source they open (`redraft.decoder.draft_source`, the one owner of a generation's
drafting, shared with the decoder's `rest` drafters).

An engine hands an adapter the tokens of a sequence as they are accepted; the adapter asks for
a draft tree when it wants one. `DraftSource(service=... or datastore=..., options=...)` opens
one `DraftStream` per generation for that conversation: `extend(tokens)`, `propose()`,
`close()`. When the service fails, a stream drafts by prompt lookup over the context it kept,
and the source leaves the service alone for `retry_after` seconds.

Tested by: tests/decoder/engines/test_llama_cpp.py, tests/decoder/engines/test_vllm.py,
tests/decoder/engines/test_sglang.py
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from redraft.datastore.drafting import new_learned_index
from redraft.decoder import draft_source
from redraft.decoder.draft_source import DraftStream, LocalStream, ServiceStream
from redraft.proto.params import SOURCES, DraftParams, InvalidParams
from redraft.proto.tree import DEFAULT_BUDGET, DEFAULT_MAX_DEPTH, LEARNED

__all__ = ["DraftOptions", "DraftSource", "DraftStream", "EngineConfigError", "LocalStream",
           "ServiceStream", "check_address"]

_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")

# An adapter was given arguments it cannot work with (one line says which): the draft
# source's own error, under the name the adapters raise.
EngineConfigError = draft_source.DraftConfigError


@dataclass(frozen=True)
class DraftOptions:
    """What an engine adapter drafts with: the request's parameters (`params`: the budget is
    tree nodes per request, the chain cut from the tree; an adapter names both budget and
    depth, no 0) and the adapter's own fields."""

    params: DraftParams = DraftParams(budget=DEFAULT_BUDGET, max_depth=DEFAULT_MAX_DEPTH)
    tenant: str = ""
    learn: bool = True  # draft from, and add to, served outputs (the LEARNED source)
    learn_max_tokens: int = 1_000_000  # in process only (the service has its own bound)

    def check(self) -> None:
        p = self.params
        if not isinstance(p, DraftParams):
            raise EngineConfigError(f"params must be a DraftParams, got {p!r}")
        for name, value in (("budget", p.budget), ("max_depth", p.max_depth),
                            ("learn_max_tokens", self.learn_max_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.tenant, str):
            raise EngineConfigError(f"tenant must be a string, got {self.tenant!r}")
        if isinstance(p.corpora, str) or any(not isinstance(c, str) or not c
                                             for c in p.corpora):
            raise EngineConfigError(f"corpora must be non-empty names, got {p.corpora!r}")
        try:
            p.check()
        except InvalidParams as exc:
            raise EngineConfigError(str(exc)) from None

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources asked for, LEARNED added when learning and removed when not."""
        asked = self.params.source_set() - {LEARNED} | ({LEARNED} if self.learn else set())
        return tuple(s for s in SOURCES if s in asked)


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


class DraftSource(draft_source.DraftSource):
    """The draft source (`redraft.decoder.draft_source.DraftSource`) an adapter opens from its
    `DraftOptions`, each argument checked with one line (EngineConfigError).

    `tokenizer`: a model name, `.gguf` path or loaded tokenizer whose fingerprint must match
    the datastore's (None: trust the datastore; ids then only need to be in its vocabulary).
    """

    def __init__(self, *, service: str | None = None, datastore: str | None = None,
                 options: DraftOptions = DraftOptions(), token: str | None = None,
                 tokenizer=None, timeout: float = 1.0,
                 retry_after: float = draft_source.RETRY_AFTER) -> None:
        options.check()
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise EngineConfigError(f"timeout must be a positive number of seconds, "
                                    f"got {timeout!r}")
        if token is not None and not isinstance(token, str):
            raise EngineConfigError("token must be a string")
        if service is not None and datastore is None:
            check_address(service)
        self.options = o = options
        p = o.params
        super().__init__(
            service=service, datastore=datastore,
            params=p.replace(sources=o.sources, corpora=tuple(p.corpora)), tenant=o.tenant,
            token=token, tokenizer=tokenizer, timeout=float(timeout), retry_after=retry_after,
            learned=new_learned_index(o.learn_max_tokens) if o.learn and service is None
            else None)
