"""Merging candidate trees from several drafters into one tree under a budget, and calibration.

Why: the decoder verifies one tree per forward, and its cost grows with the node count, so
the nodes must be the ones most likely to be accepted, whoever proposed them. Shared
prefixes are merged: a token two sources agree on is one node.
"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.datastore.draft import Draft, path_and_depth, take_top


def join_sources(a: str, b: str) -> str:
    """The label of a node both `a` and `b` proposed, e.g. "pld+rest" (sorted, no repeats)."""
    if a == b:
        return a
    return "+".join(sorted(set(a.split("+")) | set(b.split("+"))))


def merge_drafts(drafts: Sequence[Draft], budget: int | None = None) -> Draft:
    """One tree from several: shared prefixes merged, best path probabilities first.

    Where two drafts propose the same token after the same path, the node keeps the higher of
    their probabilities and is labelled with both sources ("pld+rest"): two independent
    sources agreeing is a different, usually much better, bet than either alone, and the
    decoder calibrates each label separately from what the target accepts. `match_len` of the
    result is the longest of the inputs'. A single non-empty input within the budget comes
    back as it is (drafters already order nodes best first). `budget=None`: keep every node.
    """
    match_len = max((d.match_len for d in drafts), default=0)
    full = [d for d in drafts if len(d)]
    if budget is None:
        budget = sum(len(d) for d in full)
    if len(full) == 1 and len(full[0]) <= budget:
        d = full[0]
        return Draft(d.tokens, d.parents, d.probs, d.sources, match_len=match_len)
    if not full or budget <= 0:
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
            else:
                if prob > probs[node]:
                    probs[node] = prob
                sources[node] = join_sources(sources[node], src)
            remap[j] = node
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
