"""Tenant keys: the names learned outputs are kept, logged and persisted under.

Why keys and not the names sessions declare: a learned output outlives the server's
configuration. Outputs learned under a bearer token are keyed `k:<sha256 hex>` of the token
as sent ("Bearer <token>"), a name no one can produce without the token; declared tenants are
keyed `t:<name>`, so no declared name can ever equal a token's key, whatever the server's
configuration is later (restarted without auth, a session declaring anything still gets a
`t:` key). A token with a declared tenant is `k:<hex>/<name>`.

Outputs persisted before keys (`learned:<tenant>`) map safely: `learned:token-<hex16>[/name]`
(a token's tenant then) only to a token configured now whose digest starts with those 16
digits (else it is not loaded at all), any other `learned:<name>` to `t:<name>`.

Without auth, a declared tenant's sessions count against its share of max_sessions in one of
a few tenant slots, by a hash of its key (`TenantSlot`): what the statistics are kept by.
The slot also names the tenant exactly, so that the server counts the tenants of one slot
apart (two tenants of one slot would otherwise refuse each other while the server has room).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Iterable

TOKEN_PREFIX = "k:"
DECLARED_PREFIX = "t:"
LEGACY_PREFIX = "learned:"
_LEGACY_TOKEN = re.compile(r"token-([0-9a-f]{16})(/.*)?", re.DOTALL)
_DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_DECLARED = 200  # the longest tenant a session may declare (printable characters)


def token_key(token: str) -> str:
    """The tenant key of a bearer token."""
    return TOKEN_PREFIX + hashlib.sha256(f"Bearer {token}".encode()).hexdigest()


def session_key(authenticated: str, declared: str) -> str:
    """The key of a session: its token's key (`authenticated`, "" without auth), subdivided
    by the tenant it declares, or the declared tenant alone."""
    if authenticated:
        return f"{authenticated}/{declared}" if declared else authenticated
    return DECLARED_PREFIX + declared


def persisted_key(name: str, token_keys: Iterable[str]) -> str | None:
    """The tenant key of a persisted output named `name`; None when no session of this
    server may ever draft it (a legacy token tenant whose token is not configured, or a
    name that is no key)."""
    if name.startswith((TOKEN_PREFIX, DECLARED_PREFIX)):
        return name
    if not name.startswith(LEGACY_PREFIX):
        return None
    tenant = name[len(LEGACY_PREFIX):]
    m = _LEGACY_TOKEN.fullmatch(tenant)
    if m is None:
        return DECLARED_PREFIX + tenant
    for key in token_keys:
        if key[len(TOKEN_PREFIX):].startswith(m.group(1)):
            return key + (m.group(2) or "")
    return None


def _declared_ok(name: str) -> bool:
    return len(name) <= MAX_DECLARED and name.isprintable()


def is_key(key: str) -> bool:
    """Whether `key` is a tenant key some session could have had (`t:<declared>`,
    `k:<digest>`, `k:<digest>/<declared>`): anything else read from a log is damage."""
    if key.startswith(DECLARED_PREFIX):
        return _declared_ok(key[len(DECLARED_PREFIX):])
    if not key.startswith(TOKEN_PREFIX):
        return False
    digest, slash, declared = key[len(TOKEN_PREFIX):].partition("/")
    return _DIGEST.fullmatch(digest) is not None and (not slash or _declared_ok(declared))


def token_of(key: str) -> str:
    """The token part of a key (`k:<digest>`), "" for a declared tenant's."""
    return key.partition("/")[0] if key.startswith(TOKEN_PREFIX) else ""


def shareable(key: str, token_keys: Iterable[str]) -> bool:
    """Whether `--learn global` may draft an output of `key` for every session of a server
    configured with `token_keys`: a declared tenant's, or a token's configured now (whose
    holders may share). An output learned under any other token drafts for no session that
    did not present that token, after a restart without auth or on a replica either."""
    token = token_of(key)
    return not token or token in set(token_keys)


class TenantSlot(int):
    """A declared tenant's slot: the int is its hash bucket (what statistics and metrics
    count by); `tenant` names the tenant within it (48 bits of its key's digest: exact in
    the shared counters' doubles); `lane`: where its session is counted, once it is (the
    statistics set it, and read it back when the session ends)."""

    tenant: int
    lane: int | None

    def __new__(cls, key: str, buckets: int) -> TenantSlot:
        raw = key.encode("utf-8", "surrogatepass")
        slot = super().__new__(cls, zlib.crc32(raw) % buckets)
        slot.tenant = int.from_bytes(hashlib.blake2b(raw, digest_size=6).digest(), "big")
        slot.lane = None
        return slot
