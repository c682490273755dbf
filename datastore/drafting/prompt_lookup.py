"""Prompt lookup (PLD): draft by copying what followed the current suffix earlier in the context.

Why not Hugging Face's version: it copies one fixed-length continuation after the left-most
match. Here the context's own n-gram index finds the *longest* recent match, several earlier
occurrences are merged into a tree (so two plausible continuations can both be verified),
and each node carries an estimated acceptance probability (higher after a longer match) so
the decoder can size its tree to the hardware. Drafts are not cut to a fixed length by the
match length: how deep to verify is the budget's call, from those probabilities.

The index is incremental: a decoding session appends a few accepted tokens per step, and
`extend` costs O(len(levels)) dict appends per token, never a rescan of the context.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from redraft.proto.tree import PLD, Tree, take_top, trie


def _key(toks: list[int], end: int, n: int) -> int:
    """An int key for the n-gram ending at `end` (a hash: a third of a tuple's memory).

    A collision only proposes a candidate; its true match length is measured on the
    tokens themselves, so a colliding n-gram can never be reported as a longer match.
    """
    return toks[end] if n == 1 else hash(tuple(toks[end + 1 - n : end + 1]))


class _Occurrence(NamedTuple):
    """An earlier occurrence of the context's suffix (a NamedTuple: several are made per
    step, and a frozen dataclass is slower to build)."""

    end: int  # index of the last token of the matched n-gram in the context
    match_len: int


def match_confidence(match_len: int) -> float:
    """Estimated chance that the token after an n-token match is right.

    Longer matches are likelier to be true repetitions; the curve is a simple saturating
    prior (1 token: 0.4, 2: 0.57, 4: 0.73, 8: 0.84), capped below 1 so no draft is "certain".
    """
    return min(0.95, match_len / (match_len + 1.5))


# match_confidence of short matches, looked up once per node instead of called
_CONFIDENCE = tuple(match_confidence(m) for m in range(64))


class PromptLookup:
    """Incremental prompt-lookup drafter over a growing context (prompt + accepted output).

    `levels` are the n-gram lengths indexed; a query looks up the longest level first and
    then shorter ones, and measures each occurrence's true match length (up to `max_ngram`)
    by comparing backwards, so a long match is found without indexing every length.
    """

    def __init__(
        self,
        max_ngram: int = 8,
        min_ngram: int = 1,
        max_occurrences: int = 8,
        scan_limit: int = 16,
    ) -> None:
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_occurrences < 1 or scan_limit < 1:
            raise ValueError("max_occurrences and scan_limit must be positive")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_occurrences = max_occurrences
        self.scan_limit = scan_limit
        long_level = min(max_ngram, max(min_ngram, 4))
        self.levels: tuple[int, ...] = tuple(sorted({min_ngram, long_level}, reverse=True))
        self.tokens: list[int] = []
        # level n -> key of an n-gram -> end positions in increasing order
        self._index: dict[int, dict[int, int | list[int]]] = {n: {} for n in self.levels}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the context and index the n-grams that end at each of them."""
        toks = self.tokens
        index = self._index
        for t in tokens:
            toks.append(int(t))
            end = len(toks) - 1
            for n in self.levels:
                if end + 1 >= n:
                    # An int until the n-gram repeats, then a list: most n-grams never do,
                    # and ints are no work for the garbage collector (a list each made a
                    # long context cost ~0.1 s pauses).
                    level, key = index[n], _key(toks, end, n)
                    ends = level.get(key)
                    if ends is None:
                        level[key] = end
                    elif type(ends) is int:
                        level[key] = [ends, end]
                    else:
                        ends.append(end)

    def _match_len(self, end: int) -> int:
        """Length of the common suffix of context[:end+1] and the whole context (capped)."""
        toks = self.tokens
        last = len(toks) - 1
        m = 0
        while m < self.max_ngram and end - m >= 0 and toks[end - m] == toks[last - m]:
            m += 1
        return m

    def occurrences(self) -> list[_Occurrence]:
        """Earlier occurrences of the context's suffix: longest match first, then most recent."""
        toks = self.tokens
        last = len(toks) - 1
        found: dict[int, int] = {}
        for n in self.levels:
            if last + 1 < n or len(found) >= self.max_occurrences:
                continue
            ends = self._index[n].get(_key(toks, last, n))
            if ends is None:
                continue
            if type(ends) is int:
                ends = (ends,)
            scanned = 0
            for end in reversed(ends):
                if end >= last or end in found:
                    continue  # the suffix itself has no continuation to copy
                found[end] = self._match_len(end)
                scanned += 1
                if scanned >= self.scan_limit:
                    break
        occ = [_Occurrence(e, m) for e, m in found.items() if m >= self.min_ngram]
        occ.sort(key=lambda o: (-o.match_len, -o.end))
        return occ[: self.max_occurrences]

    def propose(self, budget: int = 16, max_depth: int = 16) -> Tree:
        """A tree of at most `budget` nodes, each at most `max_depth` deep, best paths first."""
        if budget <= 0 or max_depth <= 0 or not self.tokens:
            return Tree()
        max_depth = min(max_depth, budget)  # a deeper node could not fit with its ancestors
        occ = self.occurrences()
        if not occ:
            return Tree()
        return self._tree(occ, budget, max_depth)

    def _tree(self, occ: Sequence[_Occurrence], budget: int, max_depth: int) -> Tree:
        toks = self.tokens
        return continuation_tree([(toks[o.end + 1 : o.end + 1 + max_depth], o.match_len)
                                  for o in occ], budget, PLD)


def continuation_tree(continuations: Sequence[tuple[Sequence[int], int]], budget: int,
                      source: str) -> Tree:
    """The trie of several copied continuations, as a tree of at most `budget` nodes.

    `continuations` are (the tokens that followed an earlier occurrence of the context's
    suffix, that occurrence's match length), best first; the first one's match length is
    the result's `match_len`. Shared by prompt lookup and learned drafts, which copy the same
    way from different token stores.
    """
    if not continuations:
        return Tree()
    # Identical continuations (text that repeats) are walked once, with their summed weight:
    # the trie comes out the same, for a fraction of the work.
    votes: dict[tuple[int, ...], list[int]] = {}
    for cont, m in continuations:
        vote = votes.get(key := tuple(cont))
        if vote is None:
            votes[key] = [m * m, m]  # longer matches dominate the vote
        else:
            vote[0] += m * m
            vote[1] = max(vote[1], m)
    t = trie((cont, w, m) for cont, (w, m) in votes.items())
    tokens, parents, depth, weight, best = t.tokens, t.parents, t.depth, t.weight, t.best
    # probs[i] = confidence of the supporting match (which grows with depth: after d
    # accepted tokens the match is d longer) x the node's share of its siblings' weight.
    # Lists with one extra last entry for the roots' parent (-1): no branch per node.
    n_nodes = len(tokens)
    sibling_total = [0.0] * (n_nodes + 1)
    for p, w in zip(parents, weight):
        sibling_total[p] += w
    probs = [0.0] * n_nodes
    path = [1.0] * (n_nodes + 1)  # 1.0 * prob == prob for a root
    n_conf = len(_CONFIDENCE)
    for i, p in enumerate(parents):
        m = best[i] + depth[i]
        conf = _CONFIDENCE[m] if m < n_conf else match_confidence(m)
        prob = conf * weight[i] / sibling_total[p]
        probs[i] = prob
        path[i] = path[p] * prob
    return take_top(tokens, parents, probs, [source] * n_nodes, path, depth, budget,
                    continuations[0][1])


def prompt_lookup(
    context: Sequence[int],
    budget: int = 16,
    max_depth: int = 16,
    max_ngram: int = 8,
    min_ngram: int = 1,
    max_occurrences: int = 8,
) -> Tree:
    """One-off prompt lookup over a whole context (builds a throwaway index)."""
    pl = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram, max_occurrences=max_occurrences)
    pl.extend(context)
    return pl.propose(budget=budget, max_depth=max_depth)
