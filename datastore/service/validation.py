"""Checking a request before it touches the datastore: the bearer token (and the tenant it
stands for), token ids, the tokenizer, and the drafting parameters against the limits.

The step rule is here once, whichever way a step comes (a Session's step, a Batch step entry,
a packed step): `RequestValidator.check_step`, with `check_steps` its form over a call's
packed steps as arrays (tested equal to it, refusal by refusal, on random batches).

Tested by: tests/datastore/service/test_validation.py, tests/datastore/service/test_server.py,
tests/datastore/service/test_batch_rpc.py
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import grpc
import numpy as np
from redraft.datastore.drafting import LEARNED_CORPUS, DraftSettings
from redraft.datastore.service.config import ServiceConfig
from redraft.datastore.service.refusals import Refusal, bad, over_context
from redraft.datastore.service.tenants import TenantSlot, session_key, token_key
from redraft.datastore.service.wire import source_names
from redraft.proto import draft_pb2
from redraft.proto.params import DraftParams

_MAX_TENANT_LEN = 200
STEP_ACCEPTED, STEP_BUDGET = "step.accepted", "step.budget"  # what a step's refusals name


def _outside_vocabulary(what: str, token: int, vocab_size: int) -> Refusal:
    return bad(f"{what}: token id {token} is outside the vocabulary [0, {vocab_size})")


def _over_budget(what: str, budget: int, max_budget: int) -> Refusal:
    return bad(f"{what} {budget} exceeds the server's max_budget {max_budget}")


def step_over_context(n: int, limit: int) -> Refusal:
    """What a step gets that would take its context to `n` tokens, past max_context_len."""
    return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"context would reach {n} tokens, over max_context_len {limit}")


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
        hash: `config.TENANT_BUCKETS`; a `TenantSlot`, which names the tenant too, so that
        the tenants of one slot are counted apart), or none yet (-1) while it is not known."""
        if self._tokens:
            return self._slots.get(authenticated, 0)
        if tenant_key is None:
            return -1
        return TenantSlot(tenant_key, self.buckets)  # counted apart from its slot's others

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
            raise _outside_vocabulary(what, lo if lo < 0 else hi, self.vocab_size)

    def check_context(self, tokens: Sequence[int], noun: str, field: str) -> None:
        """A context or an opening prompt (message `field`): length within max_context_len,
        every id in the vocabulary."""
        if len(tokens) > self.config.max_context_len:
            raise over_context(noun, len(tokens), self.config.max_context_len)
        self.check_tokens(tokens, field)

    def check_step(self, accepted: Sequence[int], budget: int, held: int) -> int:
        """The step rule: the accepted ids in the vocabulary, the budget within max_budget,
        the context the step makes (the `held` tokens and the accepted ones) within
        max_context_len, checked in that order; raises the first refusal, else returns the
        context's length."""
        self.check_tokens(accepted, STEP_ACCEPTED)
        self.check_budget(budget, STEP_BUDGET)
        n = held + len(accepted)
        if n > self.config.max_context_len:
            raise step_over_context(n, self.config.max_context_len)
        return n

    def check_steps(self, tokens: np.ndarray, counts: np.ndarray, budgets: np.ndarray | None,
                    held: np.ndarray, errors: dict[int, Refusal]) -> list[int]:
        """`check_step` over packed steps at once: step i accepts the next counts[i] ids of
        `tokens` (unsigned, as the wire packs them), asks budgets[i] (None: every step its
        own, 0) and extends a context of held[i] tokens. Steps already in `errors` are
        skipped; each other one that breaks the rule gets there the refusal `check_step`
        raises for it. Returns those steps, by rule then by position. A call within the rule
        costs one max over the tokens, the budgets and the contexts."""
        failed: list[int] = []
        vocab = self.vocab_size
        if len(tokens) and int(tokens.max()) >= vocab:
            ends = np.cumsum(counts, dtype=np.int64)
            rows = np.searchsorted(ends, np.flatnonzero(tokens >= vocab), "right")
            for i in np.unique(rows).tolist():
                if i not in errors:
                    row = tokens[int(ends[i]) - int(counts[i]):int(ends[i])]
                    errors[i] = _outside_vocabulary(STEP_ACCEPTED, int(row.max()), vocab)
                    failed.append(i)
        max_budget = self.config.max_budget
        if budgets is not None and len(budgets) and int(budgets.max()) > max_budget:
            for i in np.flatnonzero(budgets > max_budget).tolist():
                if i not in errors:
                    errors[i] = _over_budget(STEP_BUDGET, int(budgets[i]), max_budget)
                    failed.append(i)
        limit = self.config.max_context_len
        reach = held.astype(np.int64) + counts
        if len(reach) and int(reach.max()) > limit:
            for i in np.flatnonzero(reach > limit).tolist():
                if i not in errors:
                    errors[i] = step_over_context(int(reach[i]), limit)
                    failed.append(i)
        return failed

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
            raise _over_budget(what, budget, self.config.max_budget)

    def settings(self, p: draft_pb2.DraftParams) -> DraftSettings:
        """The drafting settings a request's parameters ask for, within the limits."""
        c = self.config
        self.check_budget(p.budget, "budget")
        if p.max_depth > c.max_depth:
            raise bad(f"max_depth {p.max_depth} exceeds the server's limit {c.max_depth}")
        source_names(p.sources)  # refuses an unknown source with the wire's message
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
        return c.draft_settings(DraftParams.from_proto(p))
