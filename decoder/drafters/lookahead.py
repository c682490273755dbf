"""`lookahead`: Lookahead decoding (after Fu et al. 2024, "Break the Sequential Dependency of
LLM Inference Using Lookahead Decoding"): the target drafts for itself by Jacobi iteration.

The drafter keeps a window of guesses for the next W positions, in up to N - 1 levels (one
per past iteration). Every verification forward also computes the window as side rows (the
*lookahead branch*), so each step runs one Jacobi iteration for free of an extra forward:

- level 0 is a chain of W guesses after the root; each later level's guess in column j
  hangs under the level before it in the same column. As a tree that is exactly the attention
  each guess needs: the root, level 0 up to its column, and its own column above it (the
  paper's lookahead mask), with positions = depth.
- the target's top-1 after the newest level is one more level of guesses. With N - 1 levels
  full, each column spells an n-gram (its N - 1 guesses, then the new token), which goes into
  the pool under its first token; the oldest level is dropped and the new one appended.
- the *verification branch* is the draft tree: the pool's n-grams that start with the root
  token, the G most recent, merged into a trie.

The pool and the window outlive a generation (what the model says after a token in one
answer is a fair guess in the next, and a warm window is as good a guess as a cold one), so
one drafter should serve one model. The very first level's guesses come from the prompt.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from redraft.decoder.drafter import Drafter, UnknownDrafter
from redraft.proto.tree import DEFAULT_MAX_DEPTH, Tree, trie

SOURCE = "lookahead"
WINDOW_SOURCE = "lookahead-window"


class LookaheadDrafter(Drafter):
    """Jacobi window (side rows) + n-gram pool (draft tree); W, N, G as in the paper."""

    name = "lookahead"

    def __init__(self, window: int = 3, ngram: int = 4, guesses: int = 6,
                 max_depth: int = DEFAULT_MAX_DEPTH, seed: int = 0) -> None:
        if window < 1 or ngram < 2 or guesses < 1:
            raise UnknownDrafter(f"lookahead needs W >= 1, N >= 2, G >= 1 "
                                 f"(got W={window}, N={ngram}, G={guesses})")
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.max_depth = max_depth
        self.seed = seed
        self.levels: list[list[int]] = []  # oldest first, each of `window` guesses
        # first token -> its n-grams' continuations (N - 1 tokens), most recent last
        self.pool: dict[int, OrderedDict[tuple[int, ...], int]] = {}

    def begin(self, prompt: Sequence[int]) -> None:
        if not self.levels:  # later generations go on from the last one's window
            rng = random.Random(self.seed + len(prompt))
            self.levels = [[int(rng.choice(prompt)) for _ in range(self.window)]]

    def side_rows(self, context: Sequence[int]) -> Tree:
        """The window as a tree under the root: level 0 a chain, each column's later levels
        a chain under its level-0 guess."""
        self.begin(context)
        w = self.window
        tokens, parents = [], []
        for level, row in enumerate(self.levels):
            for j, tok in enumerate(row):
                tokens.append(tok)
                parents.append((j - 1 if j else -1) if level == 0 else (level - 1) * w + j)
        n = len(tokens)
        return Tree(tokens, parents, [0.0] * n, [WINDOW_SOURCE] * n)

    def observe_side(self, ids, probs) -> None:
        """One Jacobi iteration done: a new level from the newest one, n-grams to the pool."""
        w = self.window
        new = [int(t) for t in ids[-w:, 0]]
        if len(self.levels) == self.ngram - 1:
            for j in range(w):
                column = [row[j] for row in self.levels] + [new[j]]
                self._remember(column[0], tuple(column[1:]))
            self.levels.pop(0)
        self.levels.append(new)

    def _remember(self, first: int, rest: tuple[int, ...]) -> None:
        grams = self.pool.setdefault(first, OrderedDict())
        grams[rest] = grams.pop(rest, 0) + 1
        if len(grams) > self.guesses:
            grams.popitem(last=False)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        """The pool's n-grams after the root token, as a trie; a node's probability is its
        share of its parent's n-grams (the budget's calibration turns it into a rate)."""
        grams = self.pool.get(int(context[-1]))
        if not grams or budget <= 0:
            return Tree()
        # the n-grams' trie (a node weighs the count of n-grams through it), taken
        # shallower nodes first, so parents come first
        t = trie((rest[: self.max_depth], count, 0) for rest, count in grams.items())
        total = sum(grams.values())
        tree = Tree()
        index: dict[int, int] = {}
        for i in sorted(range(len(t.tokens)), key=t.depth.__getitem__)[:budget]:
            parent = t.parents[i]
            index[i] = len(tree)
            tree.tokens.append(t.tokens[i])
            tree.parents.append(index[parent] if parent >= 0 else -1)
            tree.probs.append(t.weight[i] / (t.weight[parent] if parent >= 0 else total))
            tree.sources.append(SOURCE)
        return tree


def make(ctx) -> LookaheadDrafter:
    return LookaheadDrafter(int(ctx.option("lookahead_window")), int(ctx.option("lookahead_ngram")),
                            int(ctx.option("lookahead_guesses")), max_depth=ctx.max_depth)
