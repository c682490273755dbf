"""Merging candidate trees from several drafters (REST, PLD) into one tree under a budget.

Why: the decoder verifies one tree per forward, and its cost grows with the node count, so
the nodes must be the ones most likely to be accepted, whoever proposed them. Shared
prefixes are merged (a token two sources agree on is one node), and each node keeps the
source that gave it the higher probability.
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.datastore.draft import Draft


def select_top(draft: Draft, budget: int) -> Draft:
    """Keep the `budget` nodes with the highest path probability, best first, as a tree.

    A path probability never exceeds its parent's (probs are <= 1), so ordering by
    (path probability desc, depth asc) puts every parent before its children: the kept
    nodes form a tree, and so does any prefix of them (a caller may truncate further).
    """
    n = len(draft)
    if budget <= 0 or n == 0:
        return Draft(match_len=draft.match_len)
    path = draft.path_probs()
    depth: list[int] = []
    for p in draft.parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    order = sorted(range(n), key=lambda i: (-path[i], depth[i], i))[:budget]
    placed: set[int] = set()
    kept: list[int] = []
    for i in order:  # a prob > 1 could put a child before its parent: drop such orphans
        p = draft.parents[i]
        if p < 0 or p in placed:
            placed.add(i)
            kept.append(i)
    order = kept
    new_id = {old: k for k, old in enumerate(order)}
    return Draft(
        tokens=[draft.tokens[i] for i in order],
        parents=[-1 if draft.parents[i] < 0 else new_id[draft.parents[i]] for i in order],
        probs=[float(draft.probs[i]) for i in order],
        sources=[draft.sources[i] for i in order],
        match_len=draft.match_len,
    )


def merge_drafts(drafts: Sequence[Draft], budget: int) -> Draft:
    """One tree from several: shared prefixes merged, best expected acceptance first.

    Where two drafts propose the same token after the same path, the node takes the higher
    of their probabilities (and that draft's source): the estimates are of one event, and
    taking the larger one keeps each source's calibration instead of inventing a combined one.
    `match_len` of the result is the longest of the inputs'.
    """
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    sources: list[str] = []
    index: dict[tuple[int, int], int] = {}
    for d in drafts:
        remap: list[int] = []
        for tok, par, prob, src in zip(d.tokens, d.parents, d.probs, d.sources):
            mp = -1 if par < 0 else remap[par]
            key = (mp, tok)
            node = index.get(key)
            if node is None:
                node = len(tokens)
                index[key] = node
                tokens.append(tok)
                parents.append(mp)
                probs.append(float(prob))
                sources.append(src)
            elif prob > probs[node]:
                probs[node] = float(prob)
                sources[node] = src
            remap.append(node)
    match_len = max((d.match_len for d in drafts), default=0)
    merged = Draft(tokens, parents, probs, sources, match_len=match_len)
    return select_top(merged, budget)
