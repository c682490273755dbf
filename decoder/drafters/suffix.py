"""`suffix`: SuffixDecoding (arctic-inference's suffix trees), as vLLM's `suffix` method drafts.

Why here: to compare redraft's drafters with SuffixDecoding on the same verifier and the same
forward (`redraft bench --methods redraft-suffix,...`), not only inside vLLM where the engines
differ in more than their drafts. The drafter keeps what vLLM's `SuffixDecodingProposer`
keeps (vllm/v1/spec_decode/suffix_decoding.py): a suffix tree of the prompt per generation,
and a global one of the outputs of the last `max_cached_requests` generations of this
process; each step it speculates from the last `max_tree_depth` tokens with vLLM's defaults
(spec factor 1, min token probability 0.1). Its tree's probabilities are SuffixDecoding's
path estimates (frequency counts), turned into redraft's per-node ones.

It needs the `arctic-inference` package (`make install` builds it, about a minute on two
cores); without it, naming the drafter is one clear error.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from redraft.decoder.drafter import Drafter, UnknownDrafter
from redraft.proto.tree import DEFAULT_MAX_DEPTH, Tree

SOURCE = "suffix"


class SuffixDrafter(Drafter):
    """SuffixDecoding's trees over the prompt and this process's earlier outputs."""

    name = "suffix"

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        try:
            # lazy: an optional compiled package, needed only when this drafter is chosen
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError:
            raise UnknownDrafter("the suffix drafter needs arctic-inference (SuffixDecoding): "
                                 "make install builds it") from None
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth,
                                         max_cached_requests=max_cached_requests)
        self.max_depth = max_depth
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._ids = itertools.count()
        self._request: int | None = None

    def begin(self, prompt: Sequence[int]) -> None:
        self.end()
        self._request = next(self._ids)
        self.cache.start_request(self._request, np.asarray(prompt, dtype=np.int32))

    def update(self, accepted: Sequence[int]) -> None:
        if self._request is not None and len(accepted):
            self.cache.add_active_response(self._request, [int(t) for t in accepted])

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        if self._request is None:
            self.begin(context)
        pattern = np.asarray(context[-self.max_tree_depth:], dtype=np.int32)
        draft = self.cache.speculate(self._request, pattern,
                                     max_spec_tokens=max(0, min(budget, self.max_depth)),
                                     max_spec_factor=self.max_spec_factor,
                                     min_token_prob=self.min_token_prob)
        parents = list(draft.parents)
        path = list(draft.probs)
        probs = [p / (path[q] if q >= 0 and path[q] > 0 else 1.0)
                 for p, q in zip(path, parents)]
        return Tree(list(draft.token_ids), parents, [min(1.0, p) for p in probs],
                    [SOURCE] * len(parents), int(draft.match_len))

    def end(self) -> None:
        """The generation's output joins the global tree (later generations draft it)."""
        if self._request is not None:
            self.cache.stop_request(self._request)
            self._request = None


def make(ctx) -> SuffixDrafter:
    return SuffixDrafter(max_depth=ctx.max_depth)
