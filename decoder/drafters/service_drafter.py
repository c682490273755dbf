"""`rest` over gRPC (`--draft-service ADDR`): retrieval drafts from the draft service, one
streaming session per generation; the service learns from every session it serves.

A thin wrapper over the draft source (`redraft.decoder.draft_source`), which the engine
adapters share: if the service cannot be reached or fails mid-generation, the rest of that
generation is drafted by `fallback`, and the service is left alone for `retry_after` seconds.
Output never changes: drafts only affect speed.

Tested by: tests/decoder/test_generate.py, tests/decoder/cli/test_generate_cli.py,
tests/decoder/test_draft_source.py
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.datastore.drafting import DEFAULT_PARAMS
from redraft.decoder.draft_source import RETRY_AFTER, DraftSource
from redraft.decoder.drafter import Drafter
from redraft.decoder.drafters.source_drafter import DrafterStream, SourceDrafter
from redraft.proto.tree import DEFAULT_MAX_DEPTH, LEARNED, REST


class ServiceDrafter(SourceDrafter):
    """Retrieval drafts from the gRPC draft service: one streaming session per generation.

    `fingerprint`: the model's tokenizer fingerprint, checked against the server's now (an
    unreachable server is no error: generations draft by `fallback` until it is back).
    `fallback`: the drafter that takes over a generation whose service failed (None: no
    drafts from this source). Output cannot change: drafts only decide speed.
    """

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
        retry_after: float = RETRY_AFTER,
    ) -> None:
        self.fallback = fallback
        opens = (lambda ctx: DrafterStream(fallback, ctx)) if fallback is not None else False
        super().__init__(DraftSource(
            service=address, tokenizer=fingerprint,
            params=DEFAULT_PARAMS.replace(max_depth=max_depth, sources=tuple(sources)),
            tenant=tenant, token=token, tls=tls, timeout=timeout, retry_after=retry_after,
            fallback=opens))

    def check(self) -> None:
        """Raise TokenizerMismatch now if the server's datastore uses another tokenizer (an
        unreachable server, or one left alone after a failure, is no error)."""
        self.source.check()
