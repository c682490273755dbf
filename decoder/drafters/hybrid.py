"""`hybrid`: the copying drafters and the Medusa heads merged into one tree per step.

The members are the default drafters for what was given (prompt lookup, retrieval when a
datastore or draft service is given, token recycling) plus `medusa`. Their trees are merged
into one trie (a token several sources propose after the same path is one node) and cut to
the budget by path probability; the calibrator corrects every source label separately, so
the budget keeps the heads' guesses exactly where they beat the copied ones.

Tested by: tests/decoder/drafters/test_medusa.py, tests/decoder/drafters/test_registry.py
"""

from __future__ import annotations

import dataclasses

from redraft.decoder.drafter import Drafter, MergedDrafter, UnknownDrafter
from redraft.decoder.drafters import medusa, pld, recycle, rest
from redraft.decoder.drafters.registry import copying_drafters


def copying_members(ctx, composite: str) -> list[Drafter]:
    """pld, rest (when a datastore or draft service is given) and recycle, built as the
    registry builds them."""
    if len(ctx.names) > 1:
        raise UnknownDrafter(f"'{composite}' already combines drafters: name it alone")
    retrieval = bool(ctx.datastore or ctx.draft_service)
    names = tuple(copying_drafters(retrieval).split(","))
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
    members = copying_members(ctx, "hybrid")
    try:
        members.append(medusa.make(ctx))
    except BaseException:
        for d in members:
            d.close()
        raise
    return MergedDrafter(members)
