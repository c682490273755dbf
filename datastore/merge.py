"""Merging candidate trees from several drafters (REST, PLD) into one tree under a budget.

Why: the decoder verifies one tree per forward, and its cost grows with the node count, so
the nodes must be the ones most likely to be accepted, whoever proposed them. Shared
prefixes are merged (a token two sources agree on is one node), and each node keeps the
source that gave it the higher probability.
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.datastore.draft import Draft, path_and_depth


def select_top(draft: Draft, budget: int) -> Draft:
    """Keep the `budget` nodes with the highest path probability, best first, as a tree.

    A path probability never exceeds its parent's (probs are <= 1), so ordering by
    (path probability desc, depth asc) puts every parent before its children: the kept
    nodes form a tree, and so does any prefix of them (a caller may truncate further).
    """
    if budget <= 0 or not draft.tokens:
        return Draft(match_len=draft.match_len)
    path, depth = path_and_depth(draft.probs, draft.parents)
    return take_top(draft.tokens, draft.parents, draft.probs, draft.sources, path, depth, budget,
                    draft.match_len)


def take_top(tokens: list[int], parents: list[int], probs: list[float], sources: list[str],
             path: list[float], depth: list[int], budget: int, match_len: int) -> Draft:
    """The `budget` best nodes of a tree given as arrays with path probs and depths.

    Order: path probability descending, then depth, then index. Two sorts of plain indices
    by one key each (the second stable, `reverse` keeps ties in order) give that order
    without building a tuple per node. `path` and `depth` may have extra trailing entries.
    """
    n = len(tokens)
    order = sorted(range(n), key=depth.__getitem__)
    order.sort(key=path.__getitem__, reverse=True)
    new_id = [-2] * n + [-1]  # new_id[-1] == -1: a root's parent stays -1
    kept: list[int] = []
    kept_parents: list[int] = []
    for i in order[:budget]:
        parent = new_id[parents[i]]
        if parent == -2:  # a prob > 1 put a child before its parent: drop the orphan
            continue
        new_id[i] = len(kept)
        kept.append(i)
        kept_parents.append(parent)
    return Draft(
        tokens=[tokens[i] for i in kept],
        parents=kept_parents,
        probs=[float(probs[i]) for i in kept],
        sources=[sources[i] for i in kept],
        match_len=match_len,
    )


def merge_drafts(drafts: Sequence[Draft], budget: int) -> Draft:
    """One tree from several: shared prefixes merged, best expected acceptance first.

    Where two drafts propose the same token after the same path, the node takes the higher
    of their probabilities (and that draft's source): the estimates are of one event, and
    taking the larger one keeps each source's calibration instead of inventing a combined one.
    `match_len` of the result is the longest of the inputs'. A single non-empty input within
    the budget comes back as it is: drafters (Reader, PLD) already order nodes best first.
    """
    match_len = max((d.match_len for d in drafts), default=0)
    full = [d for d in drafts if len(d)]
    if len(full) == 1 and len(full[0]) <= budget:
        d = full[0]
        return Draft(d.tokens, d.parents, d.probs, d.sources, match_len=match_len)
    if not full:
        return Draft(match_len=match_len)
    first = full[0]
    tokens = list(first.tokens)
    parents = list(first.parents)
    probs = list(first.probs)
    sources = list(first.sources)
    # (merged parent, token) as one int: cheap to hash
    index = {((p + 1) << 32) | t: i for i, (p, t) in enumerate(zip(parents, tokens))}
    for d in full[1:]:
        remap = [-1] * (len(d) + 1)  # remap[-1] == -1: a root stays a root
        for j, (tok, par, prob, src) in enumerate(zip(d.tokens, d.parents, d.probs, d.sources)):
            mp = remap[par]
            key = ((mp + 1) << 32) | tok
            node = index.get(key)
            if node is None:
                node = len(tokens)
                index[key] = node
                tokens.append(tok)
                parents.append(mp)
                probs.append(prob)
                sources.append(src)
            elif prob > probs[node]:
                probs[node] = prob
                sources[node] = src
            remap[j] = node
    if budget <= 0 or not tokens:
        return Draft(match_len=match_len)
    path, depth = path_and_depth(probs, parents)
    return take_top(tokens, parents, probs, sources, path, depth, budget, match_len)


# Measured mapping of the Reader's raw REST probabilities to acceptance rates: replaying
# held-out code (this repository's sources) against the standard-library datastore, a REST
# node with raw probability p was accepted (given its parent was) at about 0.55 * p**1.5
# (p ~ 1: 0.5; 0.5: 0.19; 0.3: 0.12), while PLD's probabilities were within ~10% of their
# rates. Raw REST trees are 5-13x over-confident: a continuation seen once gets probability 1.
REST_CALIBRATION = (0.55, 1.5)


def calibrate(draft: Draft, scale: float, power: float) -> Draft:
    """The same tree with probs mapped to scale * p**power (so sources compare fairly)."""
    if scale == 1.0 and power == 1.0:
        return draft
    return Draft(
        tokens=draft.tokens,
        parents=draft.parents,
        probs=[scale * p**power for p in draft.probs],
        sources=draft.sources,
        match_len=draft.match_len,
    )
