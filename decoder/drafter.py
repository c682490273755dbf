"""The drafter interface the decoding loop talks to, and the drafter that merges several.

The loop only knows the small `Drafter` interface: `propose(context, budget) -> Tree` plus
optional hooks. The drafters themselves (one module each under `redraft.decoder.drafters`)
are listed once, with their options and factories, in `redraft.decoder.drafters.registry`;
the loop never imports them.

Drafters that learn from the verifier read what each forward computed through hooks the loop
calls only for drafters that ask: `observe` (the target's top-k after every row, when
`candidates_wanted` > 0) and `observe_hidden` (the final hidden state of the last accepted
row, when `hidden_wanted`). Neither costs an extra target forward.

A drafter may also put rows of its own into the verification forward (`side_rows`): they hang
off the root beside the draft tree, neither sees the other, they are never accepted, the
budget always keeps them (and counts their cost when it sizes the tree), and `observe_side`
then gets the target's top-k after each of them. Lookahead's Jacobi window is such rows.

A drafter that learns something worth keeping across processes (token recycling's table)
persists it through `load_state` / `save_state`; composites forward them to their members,
and the `Generator` calls them (with `persist_state`), so every caller persists alike.

Tested by: tests/decoder/drafters/test_registry.py, tests/decoder/drafters/test_recycle.py,
tests/decoder/test_generate.py
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from redraft.proto.errors import RedraftError
from redraft.proto.tree import Tree, join, merge

log = logging.getLogger("redraft.decoder")


class UnknownDrafter(RedraftError):
    """A drafter name that is not one of the known ones, or one missing what it needs."""


class Drafter:
    """Base class: subclasses implement `propose`; the hooks default to doing nothing."""

    name = "drafter"
    failures = 0  # times this drafter gave up on its source (e.g. a dead draft service)
    candidates_wanted = 0  # > 0: the loop calls `observe` with the target's top-k per node
    hidden_wanted = False  # True: the loop calls `observe_hidden` after every step

    def check_tokenizer(self, tokenizer) -> None:
        """Raise TokenizerMismatch if this drafter's drafts are the ids of another tokenizer
        than `tokenizer` (the target's). The Generator calls it once, when it is made; only
        drafters that read ids from elsewhere (a datastore, a draft service) have anything
        to check."""

    def begin(self, prompt: Sequence[int]) -> None:
        """A generation starts with this context (prompt tokens)."""

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        """A tree of at most `budget` nodes continuing `context` (whose last token is the root)."""
        raise NotImplementedError

    def update(self, accepted: Sequence[int]) -> None:
        """Tokens appended to the context by the last step (accepted drafts + bonus)."""

    def observe(self, context: Sequence[int], tree: Tree, ids, probs) -> None:
        """The target's top-k next tokens (ids, probs: arrays [len(tree) + 1, k]) after the
        context (row 0; its last token was the root) and after each node of the tree just
        verified (row i + 1). Only called when `candidates_wanted` > 0."""

    def observe_hidden(self, context: Sequence[int], hidden) -> None:
        """The target's final hidden state (a tensor [H]) at the position of `context[-2]`:
        the row whose prediction is `context[-1]`, the root of the next `propose`. Called
        after `update`, only when `hidden_wanted`."""

    def side_rows(self, context: Sequence[int]) -> Tree:
        """Rows to compute in the next verification forward besides the draft tree, as a tree
        hanging off the root (`context[-1]`). Never accepted; see the module docstring."""
        return Tree()

    def observe_side(self, ids, probs) -> None:
        """The target's top-k next tokens (arrays [len(side rows), k]) after each side row of
        the forward just run. Called only after a step that ran this drafter's side rows."""

    def end(self) -> None:
        """The generation is over (release sessions)."""

    def load_state(self, directory: Path, model_name: str, vocab_size: int) -> None:
        """Start from what earlier processes learned drafting for the target `model_name`
        (whose vocabulary has `vocab_size` ids), kept under `directory`. Missing, damaged or
        mismatched state is ignored: it only costs the head start. Drafters that learn
        nothing worth keeping do nothing."""

    def save_state(self, directory: Path, model_name: str) -> None:
        """Keep what this drafter learned for the target `model_name` under `directory`, for
        the next process (`load_state`). A cache that cannot be written is no error."""

    def close(self) -> None:
        """Release files and connections for good."""


class MergedDrafter(Drafter):
    """One tree from several drafters: shared prefixes merged, best path probabilities kept.

    A member that raises is dropped for the rest of the generation (and counted in
    `failures`); the others keep drafting.
    """

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        self.drafters = list(drafters)
        self.name = ",".join(d.name for d in self.drafters)
        self._live = list(self.drafters)
        self._own_failures = 0
        self._side: list[tuple[Drafter, int]] = []  # who put how many rows in the last forward

    def _call(self, d: Drafter, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # drafts are optional: lose one source, not the others
            self._own_failures += 1
            self._live = [x for x in self._live if x is not d]
            log.warning("drafter %s failed (%s); continuing without it", d.name, exc)
            return None

    def check_tokenizer(self, tokenizer) -> None:
        for d in self.drafters:  # a mismatch is an error, not a member to drop
            d.check_tokenizer(tokenizer)

    def begin(self, prompt: Sequence[int]) -> None:
        self._live = list(self.drafters)
        for d in list(self._live):
            self._call(d, d.begin, prompt)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        trees = []
        for d in list(self._live):
            tree = self._call(d, d.propose, context, budget)
            if tree is not None and len(tree):
                trees.append(tree)
        if not trees:
            return Tree()
        if len(trees) == 1:
            return trees[0].prune(budget)
        return merge(trees, budget)

    def update(self, accepted: Sequence[int]) -> None:
        for d in list(self._live):
            self._call(d, d.update, accepted)

    @property
    def candidates_wanted(self) -> int:  # type: ignore[override]
        return max((d.candidates_wanted for d in self._live), default=0)

    def observe(self, context: Sequence[int], tree: Tree, ids, probs) -> None:
        for d in list(self._live):
            if d.candidates_wanted:
                self._call(d, d.observe, context, tree, ids, probs)

    def side_rows(self, context: Sequence[int]) -> Tree:
        rows, self._side = Tree(), []
        for d in list(self._live):
            side = self._call(d, d.side_rows, context)
            if side is not None and len(side):
                rows = join(rows, side)
                self._side.append((d, len(side)))
        return rows

    def observe_side(self, ids, probs) -> None:
        start = 0
        for d, n in self._side:
            if d in self._live:
                self._call(d, d.observe_side, ids[start : start + n], probs[start : start + n])
            start += n

    @property
    def hidden_wanted(self) -> bool:  # type: ignore[override]
        return any(d.hidden_wanted for d in self._live)

    def observe_hidden(self, context: Sequence[int], hidden) -> None:
        for d in list(self._live):
            if d.hidden_wanted:
                self._call(d, d.observe_hidden, context, hidden)

    def end(self) -> None:
        for d in self.drafters:
            try:
                d.end()
            except Exception as exc:  # ending must not fail a finished generation
                log.warning("drafter %s failed to end (%s)", d.name, exc)

    def load_state(self, directory: Path, model_name: str, vocab_size: int) -> None:
        for d in self.drafters:
            d.load_state(directory, model_name, vocab_size)

    def save_state(self, directory: Path, model_name: str) -> None:
        for d in self.drafters:
            d.save_state(directory, model_name)

    def close(self) -> None:
        for d in self.drafters:
            d.close()

    @property
    def failures(self) -> int:  # type: ignore[override]
        return self._own_failures + sum(d.failures for d in self.drafters)


