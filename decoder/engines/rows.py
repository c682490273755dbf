"""Which sequence each row of an engine's batch holds, from the rows' contents alone.

Why: vLLM hands a custom proposer its persistent batch's token rows every step with no
request ids, moves rows into the holes finished requests leave, swaps rows to reorder the
batch, and says nothing when a request starts or ends. The draft service keeps a sequence's
context between calls, so each row must be matched to the sequence it continues.

A row continues sequence S iff S's context as last seen is a prefix of the row and the row
grew by exactly the tokens it accepted this step (when the engine says how many). The first
rule makes drafting exact whatever happens (the service is only ever sent a row's own
tokens); the second keeps a new request whose prompt extends a finished one's text (a chat's
next turn) from being taken for its continuation. Two sequences with equal contexts are
interchangeable, so either is a right match. A sequence no row continued for more than
`grace` steps is over (a request the engine paused and resumed within that is the same one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SIGNATURE = 16  # leading tokens a sequence is looked up by


@dataclass
class _Known:
    context: bytes  # the row's tokens when last seen, as bytes of `dtype`: compared at
    dtype: np.dtype  # memcmp speed (an engine step compares every row's whole context)
    n: int  # how many tokens
    signature: bytes  # its first tokens (up to SIGNATURE) when first seen
    signature_len: int
    missing: int = 0  # steps since a row last continued it


class RowIdentity:
    """Keys (ints, never reused) for the rows of successive steps (module docstring)."""

    def __init__(self, grace: int = 2) -> None:
        self.grace = grace
        self._known: dict[int, _Known] = {}
        self._by_signature: dict[bytes, set[int]] = {}
        self._lengths: dict[int, int] = {}  # signature length -> sequences using it
        self._row_keys: list[int] = []
        self._next = 0

    def __len__(self) -> int:
        return len(self._known)

    def assign(self, rows: Sequence[np.ndarray],
               grown: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
        """The key of each row (a 1-D integer array: the row's whole context), and the keys
        that ended (no row continued them for more than `grace` steps). `grown[i]`: how many
        tokens row i accepted since the last step, when the engine says."""
        keys: list[int | None] = [None] * len(rows)
        taken: set[int] = set()
        # Most rows stay where they were: try each row's previous sequence first.
        for i, row in enumerate(rows):
            if i < len(self._row_keys):
                key = self._row_keys[i]
                if key not in taken and self._continues(key, row, grown, i):
                    keys[i] = key
                    taken.add(key)
        for i, row in enumerate(rows):
            if keys[i] is None:
                keys[i] = self._find(row, grown, i, taken)
                taken.add(keys[i])
        ended = []
        for key in list(self._known):
            if key not in taken:
                known = self._known[key]
                known.missing += 1
                if known.missing > self.grace:
                    self._forget(key)
                    ended.append(key)
        for key, row in zip(keys, rows):
            self._remember(key, row)
        self._row_keys = keys
        return keys, ended

    def clear(self) -> list[int]:
        """Forget every sequence; returns their keys."""
        keys = list(self._known)
        for key in keys:
            self._forget(key)
        self._row_keys = []
        return keys

    # ---- internals ---------------------------------------------------------------------
    def _continues(self, key: int, row: np.ndarray, grown: Sequence[int] | None,
                   i: int) -> bool:
        known = self._known[key]
        n = known.n
        if grown is not None and len(row) != n + grown[i]:
            return False
        if len(row) < n:
            return False
        if row.dtype == known.dtype:
            return row[:n].tobytes() == known.context
        return np.array_equal(row[:n], np.frombuffer(known.context, known.dtype))

    def _find(self, row: np.ndarray, grown: Sequence[int] | None, i: int,
              taken: set[int]) -> int:
        for length in self._lengths:
            if length > len(row):
                continue
            for key in self._by_signature.get(_signature(row, length), ()):
                if key not in taken and self._continues(key, row, grown, i):
                    return key
        key = self._next
        self._next += 1
        return key

    def _remember(self, key: int, row: np.ndarray) -> None:
        known = self._known.get(key)
        if known is not None:
            known.context, known.dtype, known.n = row.tobytes(), row.dtype, len(row)
            known.missing = 0
            return
        length = min(SIGNATURE, len(row))
        signature = _signature(row, length)
        self._known[key] = _Known(row.tobytes(), row.dtype, len(row), signature, length)
        self._by_signature.setdefault(signature, set()).add(key)
        self._lengths[length] = self._lengths.get(length, 0) + 1

    def _forget(self, key: int) -> None:
        known = self._known.pop(key)
        same = self._by_signature[known.signature]
        same.discard(key)
        if not same:
            del self._by_signature[known.signature]
        length = known.signature_len
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]


def _signature(row: np.ndarray, length: int) -> bytes:
    return np.asarray(row[:length], dtype=np.int64).tobytes()
