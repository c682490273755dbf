"""`rest`: retrieval from a datastore, opened in this process (`DatastoreDrafter`,
`--datastore DIR`) or asked over gRPC (`ServiceDrafter`, `--draft-service ADDR`), plus the
outputs learned from earlier generations. This module is the registry's factory: which of
the two a command's options ask for, and with what.

Tested by: tests/decoder/drafters/test_registry.py, tests/decoder/test_generate.py,
tests/decoder/cli/test_generate_cli.py
"""

from __future__ import annotations

from redraft.datastore.drafting import new_learned_index
from redraft.decoder.drafter import Drafter, UnknownDrafter
from redraft.decoder.drafters.datastore_drafter import DatastoreDrafter
from redraft.decoder.drafters.pld import PLDDrafter
from redraft.decoder.drafters.service_drafter import ServiceDrafter
from redraft.proto.models import tokenizer_fingerprint
from redraft.proto.tree import LEARNED, REST

__all__ = ["DatastoreDrafter", "ServiceDrafter", "make"]


def make(ctx) -> Drafter:
    """In-process retrieval with a datastore, else the draft service (its tokenizer checked
    as it is made); PLD is the service's fallback unless the combination already runs PLD.
    Learned drafts come with either unless `--learn off`."""
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
        return ServiceDrafter(ctx.draft_service, tokenizer_fingerprint(ctx.tokenizer),
                              fallback, max_depth=ctx.max_depth, token=ctx.token,
                              sources=sources, tenant=str(ctx.option("tenant")), tls=ctx.tls)
    raise UnknownDrafter("drafter 'rest' needs a datastore (--datastore DIR) or a "
                         "draft service (--draft-service ADDR)")
