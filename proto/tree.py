"""The one candidate-tree type, `Tree`: what every drafter returns and the decoder verifies.

Flat arrays: `parents[i] == -1` means node i follows the context's last token, parents come
before children, `probs[i]` is the estimated probability that node i is accepted given that
its parent was, `sources[i]` names who proposed it ("rest", "pld", "learned", ..., or several
joined by "+" where sources agreed). The service converts it 1:1 to the proto `Tree` (sources
as the wire's bits). Flat arrays let the verifier build its mask and positions with no
pointer chasing.

Besides the type: the tree operations both halves share (best-first cuts, merging several
trees into one, joining side by side, the best chain for engines that verify one path) and
the two ways drafters grow trees (a trie of token sequences, best-first growth of an
implicit tree), so each exists once.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

REST = "rest"
PLD = "pld"
LEARNED = "learned"

# On the wire (proto enum redraft.v1.Source) each source is one bit, and a node that several
# sources proposed carries their OR (REST | PLD = 3 is "pld+rest"). Defined here only: the
# compiled core is given these bits and their labels when redraft.datastore.drafting.native
# is imported, and the proto's enum is tested to hold the same values.
SOURCE_BITS = {REST: 1, PLD: 2, LEARNED: 4}

# The tree drafted when nobody says otherwise: its nodes (the budget) and its depth. One home
# for the service's defaults (`ServiceConfig`), `DraftSettings`, `retrieval_tree`, `redraft
# query`, the decoder's drafters and the engines' settings, so they cannot drift apart.
DEFAULT_BUDGET = 64
DEFAULT_MAX_DEPTH = 16


def source_bits(label: str) -> int:
    """Wire value of a source label ("pld+rest" -> 3); unknown names contribute nothing."""
    return sum(SOURCE_BITS.get(s, 0) for s in set(label.split("+")))


def source_label(bits: int) -> str:
    """Source label of a wire value (3 -> "pld+rest"; 0 or unknown bits -> "unknown")."""
    names = sorted(name for name, bit in SOURCE_BITS.items() if bits & bit)
    return "+".join(names) or "unknown"


# The label of every value of the three bits (`SOURCE_LABELS[bits & 7]` is
# `source_label(bits)`): where a Tree or Chain is made of a reply's or a batch's bits, one
# look-up per node.
SOURCE_LABELS = tuple(source_label(bits) for bits in range(8))


def path_and_depth(probs: Sequence[float], parents: Sequence[int]
                   ) -> tuple[list[float], list[int]]:
    """Path probability and depth of each node, each list with one extra last entry.

    The extra entries (path 1.0, depth -1) stand for the roots' parent, so that index -1 needs
    no branch in this per-node loop: 1.0 * p == p exactly, -1 + 1 == 0.
    """
    n = len(parents)
    path = [1.0] * (n + 1)
    depth = [-1] * (n + 1)
    for i, (prob, parent) in enumerate(zip(probs, parents)):
        path[i] = path[parent] * prob
        depth[i] = depth[parent] + 1
    return path, depth


def path_probs(probs: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Probability that each node is accepted: the product of probs along its path."""
    return path_and_depth(probs, parents)[0][:-1]


def best_first(path: Sequence[float], depth: Sequence[int], n: int) -> list[int]:
    """Node indices by path probability descending, then depth, then index.

    Path probabilities never grow along a path (probs <= 1), so this order puts every parent
    before its children and any prefix of it is a tree. Two sorts of plain indices by one key
    each (the second stable; `reverse` keeps ties in order) avoid building a tuple per node.
    """
    order = sorted(range(n), key=depth.__getitem__)
    order.sort(key=path.__getitem__, reverse=True)
    return order


def take_top(tokens: list[int], parents: list[int], probs: list[float], sources: list[str],
             path: list[float], depth: list[int], budget: int, match_len: int) -> Tree:
    """The `budget` best nodes of a tree given as arrays with path probs and depths, best first.

    `path` and `depth` may have extra trailing entries. A node whose parent was not kept
    (possible only when a prob above 1 put a child before its parent) is dropped.
    """
    new_id = [-2] * len(tokens) + [-1]  # new_id[-1] == -1: a root's parent stays -1
    kept: list[int] = []
    kept_parents: list[int] = []
    for i in best_first(path, depth, len(tokens))[: max(budget, 0)]:
        parent = new_id[parents[i]]
        if parent == -2:
            continue
        new_id[i] = len(kept)
        kept.append(i)
        kept_parents.append(parent)
    return Tree(
        tokens=[tokens[i] for i in kept],
        parents=kept_parents,
        probs=[float(probs[i]) for i in kept],
        sources=[sources[i] for i in kept],
        match_len=match_len,
    )


@dataclass
class Tree:
    """A candidate tree. Every node is a guess for one future token."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    match_len: int = 0  # length of the context suffix the drafter matched (0 = none)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int], prob: float = 0.5, source: str = "unknown") -> Tree:
        """A single path (what a linear drafter such as HF prompt lookup proposes)."""
        n = len(tokens)
        return cls(list(tokens), list(range(-1, n - 1)), [prob] * n, [source] * n)

    # -- structure ---------------------------------------------------------------------

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError unless the arrays form a tree in the documented order.

        A tree without a probability (or source) for every node is invalid: nothing is
        filled in, because a made-up probability would mislead the budget.
        """
        n = len(self.tokens)
        if not (len(self.parents) == len(self.probs) == len(self.sources) == n):
            raise ValueError("tree arrays differ in length")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first")
        for p in self.probs:
            if not 0.0 <= p <= 1.0 + 1e-6:  # also rejects NaN
                raise ValueError(f"node probability {p} outside [0, 1]")
        if vocab_size is not None:
            for t in self.tokens:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"token id {t} outside the vocabulary (size {vocab_size})")

    def depths(self) -> list[int]:
        """Depth of each node; children of the root (parent -1) have depth 1."""
        return [d + 1 for d in path_and_depth(self.probs, self.parents)[1][:-1]]

    def children(self) -> list[list[int]]:
        """children()[0] lists the root's children; children()[i + 1] lists node i's."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            out[parent + 1].append(i)
        return out

    def path_probs(self) -> list[float]:
        """P(node accepted): the product of the conditional probs along its path."""
        return path_probs(self.probs, self.parents)

    @property
    def expected_accepted(self) -> float:
        """Expected number of accepted draft tokens (before the bonus token)."""
        return float(sum(self.path_probs()))

    def subset(self, keep: Iterable[int]) -> Tree:
        """The sub-tree made of `keep` (must be closed under taking parents), order preserved."""
        keep = sorted(set(keep))
        remap = {old: new for new, old in enumerate(keep)}
        parents = []
        for old in keep:
            parent = self.parents[old]
            if parent >= 0 and parent not in remap:
                raise ValueError(f"node {old} kept without its parent {parent}")
            parents.append(-1 if parent < 0 else remap[parent])
        return Tree([self.tokens[i] for i in keep], parents, [self.probs[i] for i in keep],
                     [self.sources[i] for i in keep], self.match_len)

    def best_nodes(self) -> list[int]:
        """Node indices ordered by path probability, best first, each after its parent.

        Any prefix of this order is a valid sub-tree, which is what lets the budget logic
        cut a tree at any size. (Nodes left orphaned by a prob above 1 come last.)
        """
        path, depth = path_and_depth(self.probs, self.parents)
        order = best_first(path, depth, len(self))
        placed: set[int] = set()
        out: list[int] = []
        while order:
            rest = []
            for i in order:
                if self.parents[i] < 0 or self.parents[i] in placed:
                    placed.add(i)
                    out.append(i)
                else:
                    rest.append(i)
            order = rest
        return out

    def prune(self, budget: int) -> Tree:
        """The `budget` nodes with the highest path probability, best first (a valid tree)."""
        if budget >= len(self):
            return self
        path, depth = path_and_depth(self.probs, self.parents)
        return take_top(self.tokens, self.parents, self.probs, self.sources, path, depth,
                        budget, self.match_len)

    def limit_depth(self, max_depth: int) -> Tree:
        """Drop nodes deeper than max_depth."""
        depth = self.depths()
        if not depth or max(depth) <= max_depth:
            return self
        return self.subset(i for i, d in enumerate(depth) if d <= max_depth)


# -- several trees into one ---------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def join_sources(a: str, b: str) -> str:
    """The label of a node both `a` and `b` proposed, e.g. "pld+rest" (sorted, no repeats;
    cached: there are few labels and merging asks for them once per shared node)."""
    if a == b:
        return a
    return "+".join(sorted(set(a.split("+")) | set(b.split("+"))))


def merge(trees: Sequence[Tree], budget: int | None = None) -> Tree:
    """One tree from several: shared prefixes merged, best path probabilities first.

    Why: the decoder verifies one tree per forward, and its cost grows with the node count,
    so the nodes must be the ones most likely to be accepted, whoever proposed them. Where
    two trees propose the same token after the same path, the node keeps the higher of their
    probabilities and is labelled with both sources ("pld+rest"): two independent sources
    agreeing is a different, usually much better, bet than either alone, and the decoder
    calibrates each label separately from what the target accepts. `match_len` of the result
    is the longest of the inputs'. A single non-empty input within the budget comes back as
    it is (drafters already order nodes best first). `budget=None`: keep every node.
    """
    match_len = max((d.match_len for d in trees), default=0)
    full = [d for d in trees if len(d)]
    if budget is None:
        budget = sum(len(d) for d in full)
    if len(full) == 1 and len(full[0]) <= budget:
        d = full[0]
        return Tree(d.tokens, d.parents, d.probs, d.sources, match_len=match_len)
    if not full or budget <= 0:
        return Tree(match_len=match_len)
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


def join(first: Tree, second: Tree) -> Tree:
    """Both trees side by side under the same root, `second`'s nodes after `first`'s.

    Unlike `merge`, nothing is shared: no node of one is an ancestor of a node of the other,
    so in a verification forward neither attends to the other (how a drafter's side rows ride
    along with the draft tree).
    """
    if not len(second):
        return first
    if not len(first):
        return second
    n = len(first)
    return Tree(first.tokens + second.tokens,
                first.parents + [p if p < 0 else p + n for p in second.parents],
                first.probs + second.probs, first.sources + second.sources, first.match_len)


# -- the best chain -----------------------------------------------------------------------
# llama-cpp-python and vLLM's custom proposers verify a chain: the target accepts drafts left
# to right until the first miss. The chain worth sending is the root-to-leaf path with the
# most expected accepted tokens, the sum of its nodes' path probabilities; that is not always
# the path of the single most probable first node (a likely short branch can lose to a
# slightly less likely long one). The draft service sends it to engines that ask for chains.


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

    def tree(self, match_len: int = 0) -> Tree:
        """The chain as a Tree (node i's parent is node i - 1)."""
        n = len(self.tokens)
        return Tree(list(self.tokens), list(range(-1, n - 1)), list(self.probs),
                    list(self.sources), match_len)


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


# -- growing trees ------------------------------------------------------------------------


@dataclass
class Trie:
    """Nodes of a trie of token sequences, in order of first appearance (parents first)."""

    tokens: list[int]
    parents: list[int]
    depth: list[int]  # 0 for the root's children
    weight: list[float]  # summed weights of the sequences through the node
    best: list[int]  # largest rank of the sequences through the node


def trie(sequences: Iterable[tuple[Sequence[int], float, int]]) -> Trie:
    """The trie of (tokens, weight, rank) sequences: one node per distinct prefix.

    Shared by the drafters that copy continuations (prompt lookup, learned outputs: weighted
    by their match) and by Lookahead's n-gram pool (weighted by count).
    """
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    weight: list[float] = []
    best: list[int] = []
    children: dict[int, int] = {}
    for seq, w, m in sequences:
        parent = -1
        d = 0
        for tok in seq:
            key = ((parent + 1) << 32) | tok  # (parent, token) as one int: cheap to hash
            node = children.get(key)
            if node is None:
                node = len(tokens)
                children[key] = node
                tokens.append(tok)
                parents.append(parent)
                depth.append(d)
                weight.append(w)
                best.append(m)
            else:
                weight[node] += w
                if m > best[node]:
                    best[node] = m
            parent = node
            d += 1
    return Trie(tokens, parents, depth, weight, best)


def grow(expand: Callable[[Any, int, float], Iterable[tuple[Any, float]]], root: Any,
         size: int) -> tuple[list[int], list[Any], list[float], list[int]]:
    """The `size` most probable nodes of an implicit tree, best first, parents first.

    `expand(label, depth, path)` gives the (label, prob) children of a node (the root: `root`,
    depth 0, path 1.0); a node's path probability is its parent's times its prob, which never
    grows along a path, so a best-first search yields parents before their children. Ties
    in probability: first found, first out. Returns (parents, labels, probs, depths), depth 1
    for the root's children. Shared by token recycling and the Medusa tree shape.
    """
    parents: list[int] = []
    labels: list[Any] = []
    probs: list[float] = []
    depths: list[int] = []
    heap: list[tuple[float, int, int, Any, float]] = []
    order = itertools.count()

    def push(parent: int, label: Any, path: float, depth: int) -> None:
        for child, p in expand(label, depth, path):
            heapq.heappush(heap, (-path * p, next(order), parent, child, p))

    push(-1, root, 1.0, 0)
    while heap and len(parents) < size:
        neg_path, _, parent, label, p = heapq.heappop(heap)
        d = 1 if parent < 0 else depths[parent] + 1
        parents.append(parent)
        labels.append(label)
        probs.append(p)
        depths.append(d)
        push(len(parents) - 1, label, -neg_path, d)
    return parents, labels, probs, depths
