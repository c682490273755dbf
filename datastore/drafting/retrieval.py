"""The retrieval (REST) tree: what followed the context's longest suffix in a datastore.

The longest suffix of the context (max_match_len down to min_match_len) that occurs is
located; up to `max_occurrences` of its occurrences, evenly spread over its suffix-array
range, give their next `max_depth` tokens. Those continuations form a trie whose node score
is count(node) / count(root), i.e. the product of count(child) / count(parent) along the
path. When the match has fewer than `min_support` occurrences, the continuations of the
longest shorter suffix that has that support are mixed in with weight 1 / (n + 1) (n = the
long match's count). The `budget` best nodes are returned, best first (so any prefix is a
valid tree); `probs[i]` is node i's score over its parent's. Empty when nothing matches.

The lookups themselves are the Reader's (`Reader.suffixes`); this module only decides which
suffixes to read and turns their continuations into a tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from redraft.datastore.reader import Match, Reader, SuffixQuery
from redraft.proto.errors import InvalidQuery
from redraft.proto.tree import DEFAULT_BUDGET, DEFAULT_MAX_DEPTH, REST, Tree

_MASS = 1 << 40  # total integer weight of a tree's samples: exact sums, no float ties

# Measured mapping of raw REST probabilities to acceptance rates: replaying held-out code
# (this repository's sources) against the standard-library datastore, a REST node with raw
# probability p was accepted (given its parent was) at about 0.55 * p**1.5 (p ~ 1: 0.5; 0.5:
# 0.19; 0.3: 0.12), while PLD's probabilities were within ~10% of their rates. Raw REST trees
# are 5-13x over-confident: a continuation seen once gets probability 1.
REST_CALIBRATION = (0.55, 1.5)


def retrieval_tree(
    reader: Reader,
    context: Sequence[int],
    budget: int = DEFAULT_BUDGET,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_match_len: int = 16,
    min_match_len: int = 2,
    max_occurrences: int = 256,
    corpora=None,
    min_support: int = 4,
) -> Tree:
    """A candidate tree continuing `context` from `reader`'s documents (module docstring)."""
    if budget < 0 or max_depth < 1 or max_occurrences < 1:
        raise InvalidQuery("budget must be >= 0; max_depth and max_occurrences >= 1")
    if min_match_len < 1 or max_match_len < min_match_len:
        raise InvalidQuery(
            f"need 1 <= min_match_len ({min_match_len}) <= max_match_len ({max_match_len})")
    if max_depth > 1024:
        raise InvalidQuery("max_depth must be at most 1024")
    query = reader.suffixes(context, max_match_len, corpora)
    if budget == 0 or len(query) < min_match_len:
        return Tree()
    longest = query.longest(min_match_len)
    if longest.length == 0:
        return Tree()
    levels = [longest]
    support = longest.count
    if support < min_support and longest.length > min_match_len:
        for length in range(longest.length - 1, min_match_len - 1, -1):
            shorter = query.occurrences(length)
            if shorter.count >= min_support or length == min_match_len:
                levels.append(shorter)
                break
    return _tree(query, levels, support, budget, max_depth, max_occurrences)


def calibrate(tree: Tree, scale: float, power: float) -> Tree:
    """The same tree with probs mapped to scale * p**power (so sources compare fairly)."""
    if scale == 1.0 and power == 1.0:
        return tree
    return Tree(
        tokens=tree.tokens,
        parents=tree.parents,
        probs=[scale * p**power for p in tree.probs],
        sources=tree.sources,
        match_len=tree.match_len,
    )


def _tree(query: SuffixQuery, levels: list[Match], support: int, budget: int, depth: int,
          k_max: int) -> Tree:
    """Continuation samples of each level (one column per occurrence) -> trie -> Tree."""
    parts, shares = [], []
    lam = support / (support + 1.0) if len(levels) > 1 else 1.0
    for n, match in enumerate(levels):
        W = query.continuations(match, k_max, depth)
        if W is None:
            continue
        parts.append(W)
        shares.append(lam if n == 0 else 1.0 - lam)
    if not parts:
        return Tree()
    L = levels[0].length
    if len(parts) == 1 and len(levels[0].ranges) == 1:
        # One SA range sampled in order: columns are already lexicographically sorted.
        return _trie_tree(parts[0], None, query.separator, budget, L)
    W = np.concatenate(parts, axis=1)
    wt = np.concatenate([np.full(P.shape[1], max(1, int(_MASS * share) // P.shape[1]),
                                 np.int64) for P, share in zip(parts, shares)])
    order = np.lexsort(W[::-1])
    return _trie_tree(W[:, order], wt[order], query.separator, budget, L)


def _trie_tree(W: np.ndarray, wt: np.ndarray | None, sep: int, budget: int,
               match_len: int) -> Tree:
    """Top-`budget` trie nodes of continuations given as sorted columns of W (depth x k).

    Column i opens a new node at depth d unless it equals column i-1 on rows 0..d; a node's
    mass is the weight of the columns it spans (unit weights when `wt` is None). Cells after
    a document's end (the separator) belong to no node.
    """
    D, k = W.shape
    valid = np.logical_and.accumulate(W != sep, axis=0)
    new = valid.copy()
    if k > 1:
        new[:, 1:] &= np.logical_or.accumulate(W[:, 1:] != W[:, :-1], axis=0)
    flat = new.ravel()  # depth-major: every parent precedes its children
    starts = flat.nonzero()[0]
    if not len(starts):
        return Tree(match_len=match_len)
    # Cells between two starts belong to the first (cells no node spans are empty).
    if wt is None:
        mass = np.add.reduceat(valid.ravel(), starts, dtype=np.int64)
        root = k
    else:
        mass = np.add.reduceat((valid * wt).ravel(), starts)
        root = int(wt.sum())
    dep = starts // k
    nid = np.cumsum(flat) - 1
    parent = nid[starts - k]
    parent[dep == 0] = -1
    # Ranked by mass, then shallower first (parents precede), then by node id: ascending
    # order of dep - mass * (D + 1), i.e. of -(mass * (D + 1) + D - dep) shifted by D, in
    # a stable sort. (argpartition would pick among equal nodes at the budget's edge, and
    # order the kept ones, by whatever its SIMD kernel does: trees would differ by machine.)
    neg = dep - mass * (D + 1)
    nn = len(starts)
    sel = np.argsort(neg, kind="stable")[:budget]
    remap = np.empty(nn + 1, dtype=np.int64)
    remap[sel] = np.arange(len(sel))
    remap[-1] = -1  # parent -1 maps to -1
    par = parent[sel]
    pmass = np.concatenate((mass, (root,)))[par]
    return Tree(
        tokens=W.ravel()[starts[sel]].tolist(),
        parents=remap[par].tolist(),
        probs=(mass[sel] / pmass).tolist(),
        sources=[REST] * len(sel),
        match_len=match_len,
    )
