"""`hybrid`: the copying drafters and the Medusa heads merged into one tree per step.

The default drafters. The members are the copying drafters for what was given (prompt
lookup, retrieval when a datastore or draft service is given, token recycling) plus `medusa`.
Their trees are merged into one trie (a token several sources propose after the same path is
one node) and cut to the budget by path probability; the calibrator corrects every source
label separately, so the budget keeps the heads' guesses exactly where they beat the copied
ones.
"""

from __future__ import annotations

import dataclasses
import logging

from redraft.decoder.drafters.base import Drafter, MergedDrafter, UnknownDrafter

log = logging.getLogger("redraft.decoder")


def copying_members(ctx, composite: str) -> list[Drafter]:
    """pld, rest (when a datastore or draft service is given) and recycle, built as the
    registry builds them."""
    from redraft.decoder.drafters import pld, recycle, rest

    if len(ctx.names) > 1:
        raise UnknownDrafter(f"'{composite}' already combines drafters: name it alone")
    retrieval = bool(ctx.datastore or ctx.draft_service)
    names = ("pld", "rest", "recycle") if retrieval else ("pld", "recycle")
    member_ctx = dataclasses.replace(ctx, names=names)
    members = [pld.make(member_ctx)]
    try:
        if retrieval:
            members.append(rest.make(member_ctx))
        members.append(recycle.make(member_ctx))
    except BaseException:
        for d in members:
            d.close()
        raise
    return members


def make(ctx) -> MergedDrafter:
    """The copying drafters plus the heads. Being the default, it also serves models that have
    no heads: without `--medusa-heads` and without committed heads for the model, it is the
    copying drafters alone (said once in the log)."""
    from redraft.decoder.drafters import medusa
    from redraft.decoder.medusa import default_heads_path

    members = copying_members(ctx, "hybrid")
    if not ctx.option("medusa_heads") and default_heads_path(ctx.model_name) is None:
        log.info("no Medusa heads for model %r: drafting without them", ctx.model_name)
        return MergedDrafter(members)
    try:
        members.append(medusa.make(ctx))
    except BaseException:
        for d in members:
            d.close()
        raise
    return MergedDrafter(members)
