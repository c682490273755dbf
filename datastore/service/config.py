"""What one draft server allows: its limits and defaults (every limit enforced, never just
advertised), and the service's name on the wire.

Tested by: tests/datastore/service/test_serve_cli.py, tests/datastore/service/test_server.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from redraft.datastore.drafting import DraftSettings
from redraft.datastore.manifest import POLL_INTERVAL_S
from redraft.proto import draft_pb2
from redraft.proto.params import DraftParams
from redraft.proto.tree import DEFAULT_BUDGET, DEFAULT_MAX_DEPTH

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


@dataclass
class ServiceConfig:
    """Limits and defaults of one server. Every limit is enforced, never just advertised."""

    # A session costs ~300 bytes per context token (context + prompt-lookup index), so the
    # worst case is about max_sessions * max_context_len * 300 B (64 * 128 Ki: ~2.5 GB).
    max_context_len: int = 1 << 17  # tokens a session may hold
    max_budget: int = 1024  # nodes per tree a client may ask for
    max_depth: int = 128
    max_sessions: int = 64
    idle_timeout_s: float = 300.0
    max_message_bytes: int = 16 << 20
    default_budget: int = DEFAULT_BUDGET  # a request that asks no budget gets this
    default_depth: int = DEFAULT_MAX_DEPTH
    grace_s: float = 5.0  # how long in-flight calls may finish after SIGTERM
    rest_max_occurrences: int = DraftSettings.rest_max_occurrences
    rest_calibration: tuple[float, float] = DraftSettings.rest_calibration
    # Shared secrets expected as "authorization: Bearer <token>"; each one is a tenant.
    token: str | tuple[str, ...] | None = None
    # Learning from served outputs: "tenant" (drafts only for the same tenant), "global"
    # (shared by all) or "off"; at most learn_max_tokens tokens kept, oldest evicted first.
    learn: str = "tenant"
    learn_max_tokens: int = 1_000_000
    # Append what was learned to the datastore (corpus "learned") this often and at
    # shutdown; 0 = keep it in memory only. Two defaults on purpose: a server built in
    # code (tests, tools, an embedding process) writes nothing to the datastore unless told
    # to, while `redraft serve` persists every SERVE_LEARN_PERSIST_S seconds.
    learn_persist_s: float = 0.0
    # Share learned outputs with the other processes serving the datastore this often
    # (each output reaches them within about twice this).
    learn_sync_s: float = 0.25
    # How long a persist waits for another process's persist or write to finish.
    learn_persist_wait_s: float = 30.0
    # Check every array's crc32 in the background once serving (opening stays O(1)); a
    # damaged datastore turns health NOT_SERVING and drafting UNAVAILABLE.
    verify_checksums: bool = True
    # Look for a new commit of the datastore this often and serve it from the next step on
    # (reload.py); 0 = serve the snapshot opened at start until restart.
    reload_interval_s: float = POLL_INTERVAL_S
    # The drafting implementation (drafting.implementation): "auto" (the compiled core, or
    # $REDRAFT_DRAFTING), "native" or "python" (the reference; identical trees, slower).
    drafting: str = "auto"
    # A batched call drafts its sequences on this many threads (without the GIL; `redraft
    # serve` defaults to auto_batch_threads) ...
    batch_threads: int = 1
    # ... inline on the event loop below this many sequences, on a thread from it on (the
    # loop answers other calls and health checks meanwhile). 64 sequences draft in ~1.2 ms
    # of CPU; handing them to a thread added 0.5-1 ms to that on a loaded 2-core machine.
    batch_offload_min: int = 256
    # Entries plus packed steps one Batch call may carry, checked before any of them is
    # looked at: an engine steps a few hundred sequences, and one call of 200k entries held
    # every other session for seconds, then overflowed the reply.
    max_batch_entries: int = 4096
    # Sessions and sequences one bearer token (without auth, one declared tenant) may hold
    # at once, all workers; 0 = its fair share: with auth, max_sessions divided by the
    # tokens configured (all of them with one token); without, `fair_room` divided by the
    # tenants holding slots. One engine must not take every slot from the others.
    tenant_sessions: int = 0

    def draft_settings(self, params: DraftParams) -> DraftSettings:
        """How a request's parameters (checked against the limits) draft on this server: a 0
        budget or depth is this server's default, the retrieval knobs are its own."""
        return DraftSettings(params.with_defaults(self.default_budget, self.default_depth),
                             rest_max_occurrences=self.rest_max_occurrences,
                             rest_calibration=self.rest_calibration)

    def tokens(self) -> list[str]:
        """The bearer tokens configured (none: no auth)."""
        tokens = self.token if isinstance(self.token, tuple) else (self.token,)
        return [t for t in tokens if t]

    def tenant_slots(self) -> int:
        """Tenant slots sessions count against: one per token with auth; without, declared
        tenants hashed into TENANT_BUCKETS (each bounded apart, by --tenant-sessions or its
        fair share)."""
        return len(self.tokens()) or TENANT_BUCKETS

    def tenant_share(self) -> int:
        """The sessions and sequences one token may hold (see `tenant_sessions`); without
        auth, by default, the most one tenant may ever hold (`fair_room`)."""
        if self.tenant_sessions > 0:
            return self.tenant_sessions
        n = len(self.tokens())
        if n == 0:
            return self.max_sessions - self.kept_free()
        return max(1, self.max_sessions // n) if n > 1 else self.max_sessions

    def fair_shares(self) -> bool:
        """Whether shares follow the tenants holding slots (without auth or
        --tenant-sessions: no tenant is known before it comes, so none may take every slot
        and lock the next one out)."""
        return not self.tokens() and self.tenant_sessions <= 0

    def kept_free(self) -> int:
        """Slots one tenant alone never takes (fair shares only): kept for the next one."""
        return self.max_sessions // KEEP_FREE if self.fair_shares() else 0

    def fair_room(self) -> int | None:
        """The slots the tenants holding some share equally (fair shares: each at most this
        divided by how many hold some); None: shares are fixed (`tenant_share`)."""
        return self.max_sessions - self.kept_free() if self.fair_shares() else None


# Without auth or --tenant-sessions, this part of max_sessions (rounded down: none under 8
# slots) is kept for a tenant that comes next: one tenant alone holds at most the rest.
KEEP_FREE = 8

# Without auth, declared tenants (and the default one) count against their share in
# this many slots, by a hash of their name: bounded memory whatever names clients declare
# (each slot counts up to `stats.LANES` tenants apart; only more at once share a count).
TENANT_BUCKETS = 64

# The longest client or sequence id a Batch call may name, in UTF-8 bytes: the server keeps
# every held id, and those of recently swept sequences, so their memory is bounded by it.
MAX_ID_BYTES = 256

# `redraft serve`'s --learn-persist-seconds default (`ServiceConfig.learn_persist_s` is 0:
# a server built in code keeps what it learns in memory unless told to persist it).
SERVE_LEARN_PERSIST_S = 300.0

MAX_AUTO_BATCH_THREADS = 8  # more threads than this gain little on an engine's batch
# A call of fewer sequences drafts on one thread (about 0.4 ms of drafting): waking another
# costs about what it would save, and lengthened the tail (8 sequences on two threads: p99
# 1.2 -> 3.5-5 ms on the 2-core development machine).
THREADS_MIN_SEQUENCES = 32


def auto_batch_threads(workers: int = 1) -> int:
    """`redraft serve`'s --batch-threads default: the cores this process may use, shared by
    its --workers processes (each drafts its calls on its own threads), at least 1 and at
    most MAX_AUTO_BATCH_THREADS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_BATCH_THREADS, cores // max(1, workers)))


LEARN_MODES = ("tenant", "global", "off")
DRAFTING_CHOICES = ("auto", "native", "python")
