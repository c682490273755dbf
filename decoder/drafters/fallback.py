"""`fallback`: the copying drafters while they hit, the Medusa heads when they do not.

Every step both trees are made: the copying drafters' (prompt lookup, retrieval when given,
token recycling: one merged tree) and the heads' (a top-k pass over one hidden state, ~5%
of a one-token forward with the subset projection). Only one is verified.

The retrieval hit rate, concretely. For each source s and step, E_s is what its tree claims:
the expected number of accepted tokens, the sum of the path probabilities of its best
`COMPARE_NODES` nodes (about the size the budget verifies on a CPU). A_s is what the tree
actually would have given: the number of its tokens, along one path, that equal the real
continuation, measured once the continuation is known (a few steps later) for both trees,
the verified one and the other, so neither record depends on which one was chosen. The hit
rate is rho_s = sum(A_s) / sum(E_s) over recent steps (exponential weights, decay 0.8: about
the last five steps), i.e. how far the source's own claims are to be trusted right now; a
step verifies the copying tree when rho_ret * E_ret >= rho_medusa * E_medusa. A long
prompt-lookup or retrieval match shows up as a high E_ret (its nodes are confident), and a
run of misses as a low rho_ret, so a step switches as soon as either changes.

Tested by: tests/decoder/drafters/test_medusa.py, tests/decoder/test_acceptance.py
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from pathlib import Path

from redraft.decoder.drafter import Drafter, MergedDrafter
from redraft.decoder.drafters import medusa
from redraft.decoder.drafters.hybrid import copying_members
from redraft.proto.tree import Tree

COMPARE_NODES = 16
DECAY = 0.8


def matched_length(tree: Tree, continuation: Sequence[int]) -> tuple[int, bool]:
    """Tokens of `continuation` the tree has along one path from its root, and whether that
    count is final (the walk left the tree before the known continuation ran out)."""
    children = tree.children()
    node_children = children[0]
    for i, tok in enumerate(continuation):
        nxt = next((c for c in node_children if tree.tokens[c] == tok), None)
        if nxt is None:
            return i, True
        node_children = children[nxt + 1]
        if not node_children:
            return i + 1, True
    return len(continuation), False


class HitRate:
    """Realised over claimed acceptance of one source, exponentially weighted."""

    def __init__(self) -> None:
        self.realised = 1.0  # a prior of one step in which the source's claim came true
        self.claimed = 1.0

    def record(self, realised: float, claimed: float) -> None:
        self.realised = DECAY * self.realised + realised
        self.claimed = DECAY * self.claimed + claimed

    @property
    def rate(self) -> float:
        return self.realised / max(self.claimed, 1e-9)


class FallbackDrafter(Drafter):
    """Verifies the copying drafters' tree or the heads' tree, whichever is expected to give
    more accepted tokens this step (see the module docstring)."""

    name = "fallback"
    hidden_wanted = True

    def __init__(self, copying: Drafter, medusa: Drafter) -> None:
        self.copying = copying
        self.medusa = medusa
        self._members = MergedDrafter([copying, medusa])  # hooks and failures, as usual
        self.rates = {"copy": HitRate(), "medusa": HitRate()}
        self.chosen = {"copy": 0, "medusa": 0}
        self._log: list[int] = []  # tokens since begin (update appends)
        self._pending: deque[tuple[int, str, Tree, float]] = deque()

    def check_tokenizer(self, tokenizer) -> None:
        self._members.check_tokenizer(tokenizer)

    def begin(self, prompt: Sequence[int]) -> None:
        self._members.begin(prompt)
        self._log = []
        self._pending.clear()

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        trees = {"copy": self.copying.propose(context, budget),
                 "medusa": self.medusa.propose(context, budget)}
        score = {}
        for source, tree in trees.items():
            top = tree.prune(COMPARE_NODES)
            claimed = top.expected_accepted
            score[source] = self.rates[source].rate * claimed
            if len(top):
                self._pending.append((len(self._log), source, top, claimed))
        pick = "copy" if score["copy"] >= score["medusa"] else "medusa"
        self.chosen[pick] += 1
        return trees[pick].prune(budget)

    def update(self, accepted: Sequence[int]) -> None:
        self._members.update(accepted)
        self._log.extend(int(t) for t in accepted)
        still = deque()
        for start, source, tree, claimed in self._pending:
            n, final = matched_length(tree, self._log[start:])
            if final:
                self.rates[source].record(n, claimed)
            else:
                still.append((start, source, tree, claimed))
        self._pending = still

    @property
    def drafters(self) -> list[Drafter]:
        """Every member, the copying ones first (as `MergedDrafter.drafters` lists them)."""
        members = getattr(self.copying, "drafters", [self.copying])
        return [*members, self.medusa]

    @property
    def candidates_wanted(self) -> int:  # type: ignore[override]
        return self._members.candidates_wanted

    def observe(self, context: Sequence[int], tree: Tree, ids, probs) -> None:
        self._members.observe(context, tree, ids, probs)

    def observe_hidden(self, context: Sequence[int], hidden) -> None:
        self._members.observe_hidden(context, hidden)

    def end(self) -> None:
        self._members.end()

    def load_state(self, directory: Path, model_name: str, vocab_size: int) -> None:
        self._members.load_state(directory, model_name, vocab_size)

    def save_state(self, directory: Path, model_name: str) -> None:
        self._members.save_state(directory, model_name)

    def close(self) -> None:
        self._members.close()

    @property
    def failures(self) -> int:  # type: ignore[override]
        return self._members.failures


def make(ctx) -> FallbackDrafter:
    members = copying_members(ctx, "fallback")
    copying = MergedDrafter(members)
    try:
        heads = medusa.make(ctx)
    except BaseException:
        copying.close()
        raise
    return FallbackDrafter(copying, heads)
