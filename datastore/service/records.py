"""Which logged outputs a serving process may use: a log is written by another process (a
replica still serving an old snapshot after a rebuild with another tokenizer, another
version, a damaged disk), so a record with a right length and checksum can still hold token
ids past this datastore's vocabulary or a tenant key no session could have had. Such an
output is neither drafted nor persisted (persisting it would fail every persist), and the
rest of the log is used as usual.

Tested by: tests/datastore/service/test_persisting.py"""

from __future__ import annotations

from collections.abc import Sequence

from redraft.datastore.service.tenants import is_key


def record_problem(tenant: str, tokens: Sequence[int], vocab_size: int) -> str | None:
    """Why an output (its tenant key, its tokens so far) cannot be used; None when it can."""
    if not is_key(tenant):
        return f"tenant key {tenant[:40]!r} is not a tenant key"
    if tokens:
        top = max(tokens)
        if top >= vocab_size:
            return f"token id {top} past the vocabulary ({vocab_size} ids)"
    return None
