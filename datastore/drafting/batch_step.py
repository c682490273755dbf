"""One step of many sessions at once: what an engine needs per engine step (every running
sequence's accepted tokens in, every sequence's tree or best chain out).

Every session is extended first, then every session drafts, so each tree is the same
whatever the order (and whatever threads drafted it): a session's tree is the one its own
`extend` + `propose` would give after every session of the batch learned its tokens. With
compiled drafters (the default) the whole batch is one call into the core, drafting without
the GIL; with the Python reference drafters the same is done session by session.

Tested by: tests/datastore/drafting/native/test_native_batch.py
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from redraft.datastore.drafting.native import (
    NativeSessionDrafter,
    native_step,
    native_step_flat,
)
from redraft.datastore.drafting.session_drafter import SessionDrafter
from redraft.proto.flat_trees import FlatTrees
from redraft.proto.tree import Tree, best_chain


@dataclass
class BatchStep(FlatTrees):
    """The trees of one batched step, one row per sequence (a `FlatTrees`: sequence i's
    nodes are [offsets[i], offsets[i + 1]) of each array, its best chain when one was asked
    for; `tree(i)`, `chain(i)`); `used[i]` is the OR of its nodes' source bits; errors[i] is
    why sequence i drafted nothing, for the sequences that failed."""

    used: np.ndarray  # uint8 per sequence: the OR of its nodes' source bits
    errors: dict[int, Exception]
    context_lens: np.ndarray | None = None  # uint64 per sequence after the step (step_flat)


def step_batch(drafters: Sequence[SessionDrafter | NativeSessionDrafter],
               accepted: Sequence[Sequence[int] | None],
               budgets: Sequence[int | None] | None = None, chain: int = 0,
               threads: int = 1) -> BatchStep:
    """Extend every drafter by its accepted tokens (None: none), then draft every one with
    its budget (None: its settings'); `chain` > 0: each sequence's best chain of at most
    that many nodes instead of its tree. A sequence whose step fails gets an empty tree and
    its exception in `errors`; the others are unaffected. Compiled drafters must not be
    used elsewhere during the call (it drafts without the GIL, on `threads` threads)."""
    if drafters and all(d.__class__ is NativeSessionDrafter for d in drafters):
        return BatchStep(*native_step(drafters, accepted, budgets, threads, chain))
    return _reference_step(drafters, accepted, budgets, chain)


def step_flat(drafters: Sequence[SessionDrafter | NativeSessionDrafter], tokens: np.ndarray,
              counts: np.ndarray, budgets: np.ndarray | None = None, chain: int = 0,
              threads: int = 1) -> BatchStep:
    """step_batch with the accepted tokens as flat arrays (what the service's packed steps
    carry, without a list per sequence): drafter i accepts the next counts[i] of `tokens`
    (uint32 ids within the vocabulary) and drafts with budgets[i] nodes (uint32, 0: its
    settings'). Also gives every drafter's context length after the step. Probs are float32
    from the core, float64 from the reference."""
    if drafters and all(d.__class__ is NativeSessionDrafter for d in drafters):
        return BatchStep(*native_step_flat(drafters, tokens, counts, budgets, threads, chain))
    ends = np.cumsum(counts).tolist()
    flat = tokens.tolist()
    accepted = [flat[b - c:b] if c else None for b, c in zip(ends, counts.tolist())]
    out = _reference_step(drafters, accepted, None if budgets is None else
                          [int(b) or None for b in budgets.tolist()], chain)
    out.context_lens = np.array([len(d) for d in drafters], np.uint64)
    return out


def _reference_step(drafters, accepted, budgets, chain: int) -> BatchStep:
    """The same step through each drafter's own extend and propose (the Python reference,
    or a batch that mixes kinds)."""
    errors: dict[int, Exception] = {}
    for i, (d, acc) in enumerate(zip(drafters, accepted)):
        if acc is not None:
            try:
                d.extend(acc)
            except (TypeError, ValueError, OverflowError) as exc:
                errors[i] = exc
    trees: list[Tree] = []
    match_lens = np.zeros((len(drafters), 3), np.int64)
    for i, d in enumerate(drafters):
        tree = Tree()
        if i not in errors:
            try:
                tree = d.propose(None if budgets is None else budgets[i])
            except Exception as exc:  # noqa: BLE001 - the sequence's own failure
                errors[i] = exc
            else:
                match_lens[i] = (d.rest_match_len, d.pld_match_len, d.learned_match_len)
                if chain > 0:
                    tree = best_chain(tree, chain).tree(tree.match_len)
        trees.append(tree)
    flat = FlatTrees.of_trees(trees, match_lens)
    return BatchStep(**vars(flat), used=flat.row_bits(), errors=errors)
