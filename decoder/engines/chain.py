"""The best chain of a draft tree, for engines that verify one path per step.

llama-cpp-python and vLLM's custom proposers verify a chain: the target accepts drafts left to
right until the first miss. The chain worth sending is the root-to-leaf path with the most
expected accepted tokens, the sum of its nodes' path probabilities; that is not always the
path of the single most probable first node (a likely short branch can lose to a slightly
less likely long one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redraft.proto.tree import Tree, path_probs


@dataclass
class Chain:
    """A path of a draft tree: its tokens with each node's conditional prob and source."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def head(self, n: int) -> Chain:
        """The first n nodes."""
        return Chain(self.tokens[:n], self.probs[:n], self.sources[:n])


def best_chain(draft: Tree, max_len: int) -> Chain:
    """The path of at most `max_len` nodes that maximises the sum of path probabilities."""
    n = len(draft)
    if n == 0 or max_len <= 0:
        return Chain()
    pp = path_probs(draft.probs, draft.parents)
    depth = [0] * n
    for i, parent in enumerate(draft.parents):
        depth[i] = 1 if parent < 0 else depth[parent] + 1
    # gain[i]: best sum over a path starting at node i (itself included) within max_len;
    # children come after their parents, so one reverse pass sees every child first.
    gain = [0.0] * n
    best_child = [-1] * n
    root_best, root_gain = -1, 0.0
    for i in range(n - 1, -1, -1):
        if depth[i] > max_len:
            continue
        gain[i] += pp[i]
        parent = draft.parents[i]
        if parent < 0:
            if root_best < 0 or gain[i] > root_gain:
                root_best, root_gain = i, gain[i]
        elif best_child[parent] < 0 or gain[i] > gain[best_child[parent]]:
            if best_child[parent] >= 0:
                gain[parent] -= gain[best_child[parent]]
            best_child[parent] = i
            gain[parent] += gain[i]
    chain = Chain()
    node = root_best
    while node >= 0:
        chain.tokens.append(int(draft.tokens[node]))
        chain.probs.append(float(draft.probs[node]))
        chain.sources.append(draft.sources[node])
        node = best_child[node]
    return chain
