"""Checking a request before it touches the datastore: the bearer token (and the tenant it
stands for), token ids, the tokenizer, and the drafting parameters against the limits.

Tested by: tests/datastore/service/test_server.py, tests/datastore/service/test_batch_rpc.py
"""

from __future__ import annotations

import hmac
import zlib
from collections.abc import Sequence

import grpc
from redraft.datastore.drafting import LEARNED_CORPUS, DraftSettings
from redraft.datastore.service.config import ServiceConfig
from redraft.datastore.service.refusals import Refusal, bad
from redraft.datastore.service.tenants import session_key, token_key
from redraft.datastore.service.wire import source_names
from redraft.proto import draft_pb2
from redraft.proto.tree import PLD, REST

_MAX_TENANT_LEN = 200


class RequestValidator:
    """The checks of one server over one datastore; each raises `Refusal` on a bad request."""

    def __init__(self, reader, config: ServiceConfig) -> None:
        self.config = config
        self.vocab_size = int(reader.vocab_size)
        self.fingerprint = str(reader.tokenizer_fingerprint)
        self.tokenizer_name = getattr(reader, "tokenizer_name", "?")
        self.corpora = set(getattr(reader, "corpora", {}) or {}) - {LEARNED_CORPUS}
        tokens = config.tokens()
        self._tokens = [f"Bearer {t}".encode() for t in tokens]
        # a digest, not the secret itself: tenant keys are logged and persisted
        self.token_keys = [token_key(t) for t in tokens]
        self._slots = {key: i for i, key in enumerate(self.token_keys)}
        self.buckets = config.tenant_slots()  # the tenant slots the server's stats count

    def slot(self, authenticated: str, tenant_key: str | None = None) -> int:
        """The tenant slot whose share of max_sessions a caller's sessions count against:
        its token's (`auth`'s key); without auth, its declared tenant's (`tenant_key`, by a
        hash: `config.TENANT_BUCKETS`), or none yet (-1) while it is not known."""
        if self._tokens:
            return self._slots.get(authenticated, 0)
        if tenant_key is None:
            return -1
        return zlib.crc32(tenant_key.encode("utf-8", "surrogatepass")) % self.buckets

    def auth(self, context: grpc.aio.ServicerContext) -> str:
        """Check the bearer token; returns the tenant key it stands for ("" without auth)."""
        if not self._tokens:
            return ""
        for key, value in context.invocation_metadata() or ():
            if key != "authorization":
                continue
            sent = str(value).encode()
            for expected, tenant in zip(self._tokens, self.token_keys):
                if hmac.compare_digest(sent, expected):
                    return tenant
        raise Refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong token: send metadata 'authorization: Bearer <token>'",
        )

    def check_tokens(self, tokens: Sequence[int], what: str) -> None:
        if not tokens:
            return
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= self.vocab_size:
            bad_id = lo if lo < 0 else hi
            raise bad(f"{what}: token id {bad_id} is outside the vocabulary "
                      f"[0, {self.vocab_size})")

    def check_context(self, tokens: Sequence[int], noun: str, field: str) -> None:
        """A context or an opening prompt (message `field`): length within max_context_len,
        every id in the vocabulary."""
        if len(tokens) > self.config.max_context_len:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{noun} of {len(tokens)} tokens exceeds max_context_len "
                f"{self.config.max_context_len}",
            )
        self.check_tokens(tokens, field)

    def check_fingerprint(self, fingerprint: str, required: bool) -> None:
        if not fingerprint:
            if required:
                raise Refusal(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "open.tokenizer_fingerprint is required (the datastore's is "
                    f"{self.fingerprint})",
                )
            return
        if fingerprint != self.fingerprint:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tokenizer fingerprint {fingerprint} does not match the datastore's "
                f"{self.fingerprint} (built with {self.tokenizer_name})",
            )

    def tenant(self, authenticated: str, declared: str) -> str:
        """The key of whose outputs a session learns from: the token's tenant, else the
        declared one (with a token, a declared tenant subdivides it); see `tenants`."""
        if len(declared) > _MAX_TENANT_LEN or not declared.isprintable():
            raise bad(f"tenant must be at most {_MAX_TENANT_LEN} printable characters")
        return session_key(authenticated, declared)

    def check_budget(self, budget: int, what: str) -> None:
        if budget > self.config.max_budget:
            raise bad(f"{what} {budget} exceeds the server's max_budget {self.config.max_budget}")

    def settings(self, p: draft_pb2.DraftParams) -> DraftSettings:
        """The drafting settings a request's parameters ask for, within the limits."""
        c = self.config
        self.check_budget(p.budget, "budget")
        if p.max_depth > c.max_depth:
            raise bad(f"max_depth {p.max_depth} exceeds the server's limit {c.max_depth}")
        sources = source_names(p.sources)
        if LEARNED_CORPUS in p.corpora:
            raise bad(f"corpus {LEARNED_CORPUS!r} is drafted through SOURCE_LEARNED (which "
                      "keeps tenants apart), not through retrieval")
        unknown = [name for name in p.corpora if name not in self.corpora]
        if unknown:
            known = ", ".join(sorted(self.corpora)) or "none"
            raise bad(f"unknown corpora {unknown} (this datastore has: {known})")
        if p.max_match_len and p.min_match_len > p.max_match_len:
            raise bad(f"min_match_len {p.min_match_len} > max_match_len {p.max_match_len}")
        if max(p.min_match_len, p.max_match_len) > 1024:
            raise bad("min_match_len and max_match_len must be at most 1024")
        return DraftSettings(
            budget=p.budget or c.default_budget,
            max_depth=p.max_depth or c.default_depth,
            sources=frozenset(sources or (REST, PLD)),
            corpora=tuple(p.corpora) or None,
            min_match=p.min_match_len,
            max_match=p.max_match_len,
            rest_max_occurrences=c.rest_max_occurrences,
            rest_calibration=c.rest_calibration,
        )
