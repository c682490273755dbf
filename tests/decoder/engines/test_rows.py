"""RowIdentity: an engine's rows matched to their sequences by content alone (a row continues a
sequence only if that sequence's whole last-seen context is its prefix)."""

from __future__ import annotations

import numpy as np
from redraft.decoder.engines.rows import RowIdentity


def rows_of(*contexts, dtype=np.int64) -> list[np.ndarray]:
    return [np.asarray(c, dtype=dtype) for c in contexts]


def test_rows_that_grow_moved_or_swapped_keep_their_sequences():
    ids = RowIdentity()
    a, b = list(range(100, 140)), list(range(200, 260))
    keys, ended = ids.assign(rows_of(a, b))
    assert len(set(keys)) == 2 and ended == []
    a2, b2 = a + [7, 8], b + [9]
    again, _ = ids.assign(rows_of(b2, a2), [1, 2])  # swapped, each grown by what it accepted
    assert again == [keys[1], keys[0]]


def test_a_changed_early_token_or_a_shared_signature_is_a_new_sequence():
    ids = RowIdentity()
    shared = list(range(1, 17))  # the 16 tokens a sequence is looked up by
    first = shared + [50, 51, 52]
    (key,), _ = ids.assign(rows_of(first))
    other = shared + [60, 61, 62, 63]  # same signature, another text after it
    (k2,), _ = ids.assign(rows_of(other), [1])
    assert k2 != key
    edited = list(first)
    edited[18] = 99  # grew by one but its last-seen context is not its prefix
    (k3,), _ = ids.assign(rows_of(edited + [5]), [1])
    assert k3 not in (key, k2)


def test_rows_of_another_integer_width_are_compared_by_value():
    ids = RowIdentity()
    ctx = list(range(300, 340))
    (key,), _ = ids.assign(rows_of(ctx, dtype=np.int64))
    (same,), _ = ids.assign(rows_of(ctx + [1], dtype=np.int32), [1])
    assert same == key
    (new,), _ = ids.assign(rows_of(ctx[:-1] + [0, 1, 2], dtype=np.int64), [1])
    assert new != key


def test_a_sequence_no_row_continues_ends_after_the_grace_steps():
    ids = RowIdentity(grace=1)
    (key,), _ = ids.assign(rows_of(list(range(10, 30))))
    _, ended = ids.assign(rows_of(list(range(500, 520))))
    assert ended == []
    _, ended = ids.assign(rows_of(list(range(500, 521))))
    assert ended == [key]
