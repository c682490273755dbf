"""`recycle`: token recycling, drafts made from the target's own earlier predictions.

Every verification forward computes the target's distribution after *every* tree node, and
plain decoding throws all but one row away. Recycling keeps, for each token id, the top-k
next tokens (and their probabilities) the target last predicted after that token, and
drafts by walking this table from the context's last token, best path first. It needs no
corpus and no extra model: a few MB of table, refreshed for free by every forward (the
idea of Luo et al., 2024, "Turning Trash into Treasure"). The table outlives a generation:
what the model predicted in one answer is a good guess for the same token in the next.

It complements the other drafters: prompt lookup and retrieval copy spans that exist
somewhere, recycling proposes what this model tends to say after a token, which covers the
model's own phrasing and the code it writes from scratch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from redraft.decoder.drafter import Drafter
from redraft.proto.files import cache_root, write_cache
from redraft.proto.tree import DEFAULT_MAX_DEPTH, Tree, grow

SOURCE = "recycle"


class CandidateTable:
    """token id -> the target's last top-k next tokens after it, probabilities descending."""

    def __init__(self, k: int = 8) -> None:
        self.k = k
        self.ids = np.zeros((0, k), dtype=np.int32)
        self.probs = np.zeros((0, k), dtype=np.float32)  # 0 = never seen

    def record(self, tokens: Sequence[int], ids: np.ndarray, probs: np.ndarray) -> None:
        """Row i of ids/probs is the target's prediction after tokens[i] (the latest wins)."""
        if not len(tokens):
            return
        toks = np.asarray(tokens, dtype=np.int64)
        need = int(toks.max()) + 1
        if need > len(self.ids):
            size = max(need, 2 * len(self.ids))
            grown_ids = np.zeros((size, self.k), dtype=np.int32)
            grown_probs = np.zeros((size, self.k), dtype=np.float32)
            grown_ids[: len(self.ids)] = self.ids
            grown_probs[: len(self.probs)] = self.probs
            self.ids, self.probs = grown_ids, grown_probs
        k = min(self.k, ids.shape[1])
        self.ids[toks, :k] = ids[:, :k]
        self.probs[toks, :k] = probs[:, :k]

    # -- persistence: a new process starts from what earlier runs saw --------------------

    def save(self, path: Path) -> None:
        """Write the table (atomically); failures only cost the next process its head start."""
        write_cache(path, lambda tmp: np.savez(tmp, ids=self.ids, probs=self.probs))

    def load(self, path: Path, vocab_size: int) -> bool:
        """Read a saved table; a missing, damaged or mismatched file is ignored."""
        try:
            with np.load(path) as data:
                ids, probs = data["ids"], data["probs"]
        except (OSError, ValueError, KeyError, EOFError):
            return False
        ok = (ids.shape == probs.shape and ids.ndim == 2 and ids.shape[1] == self.k
              and ids.dtype == np.int32 and probs.dtype == np.float32
              and bool(((ids >= 0) & (ids < vocab_size)).all())
              # rows grow by doubling, so a table may have rows past the vocabulary: they
              # must be ones no prediction was recorded in (they are dropped)
              and not probs[vocab_size:].any())
        if ok:
            self.ids, self.probs = ids[:vocab_size].copy(), probs[:vocab_size].copy()
        return ok

    def draft(self, root: int, budget: int, max_depth: int, min_prob: float = 0.02) -> Tree:
        """The `budget` most probable paths from `root`, taking each step as independent.

        Best-first over the table: a node's path probability never exceeds its parent's, so
        nodes come out parents first, as a Tree needs. Paths below `min_prob` are not worth
        the heap work: the budget logic would never verify them.
        """
        if budget <= 0:
            return Tree()
        ids, probs = self.ids, self.probs

        def expand(token: int, depth: int, path: float) -> list[tuple[int, float]]:
            children = []
            if depth >= max_depth or not 0 <= token < len(ids):
                return children
            for tok, p in zip(ids[token].tolist(), probs[token].tolist()):
                if p * path < min_prob:
                    break  # probabilities are descending
                children.append((tok, p))
            return children

        parents, tokens, node_probs, _ = grow(expand, root, budget)
        return Tree(tokens, parents, node_probs, [SOURCE] * len(tokens))


def table_path(model_name: str, directory: Path | None = None) -> Path:
    """Where the recycling table of one model is kept between processes (under `directory`,
    by default the cache root)."""
    key = hashlib.sha256(model_name.encode()).hexdigest()[:16]
    return Path(directory or cache_root()) / "recycle" / f"{key}.npz"


class RecycleDrafter(Drafter):
    """Token recycling: drafts from the target's own top-k predictions seen after each token.

    The table is kept across generations (it is what this model says, not what a prompt
    says), so one drafter should serve one model.
    """

    name = "recycle"

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, k: int = 8) -> None:
        self.max_depth = max_depth
        self.candidates_wanted = k
        self.table = CandidateTable(k)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        return self.table.draft(int(context[-1]), budget, self.max_depth)

    def observe(self, context: Sequence[int], tree: Tree, ids, probs) -> None:
        self.table.record([int(context[-1]), *tree.tokens], ids, probs)

    def load_state(self, directory: Path, model_name: str, vocab_size: int) -> None:
        self.table.load(table_path(model_name, directory), vocab_size)

    def save_state(self, directory: Path, model_name: str) -> None:
        self.table.save(table_path(model_name, directory))


def make(ctx) -> RecycleDrafter:
    return RecycleDrafter(max_depth=ctx.max_depth)
