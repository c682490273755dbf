"""Sessions and sequences within max_sessions and the tenants' fair shares, against real
`redraft serve` processes: tenants whose names hash to one tenant slot are counted apart, so
they never refuse each other while the server has room (before, 60 tenants holding one session
each on 64 slots refused each other: two tenants of one slot shared a share of one), and one
of them stays bounded by its own share, on one worker or several."""

from __future__ import annotations

import contextlib
import random
import zlib
from collections import Counter

import pytest
from redraft.datastore import build_datastore
from redraft.datastore.service.client import (
    DraftClient,
    DraftParams,
    LimitExceeded,
    SequenceEnd,
    SequenceOpen,
)
from redraft.datastore.service.config import TENANT_BUCKETS
from redraft.datastore.service.tenants import session_key

FP = "sha256:session-limits-test"
VOCAB = 300
RNG = random.Random(40)
DOCS = [[RNG.randrange(1, VOCAB) for _ in range(60)] for _ in range(20)]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("limits") / "ds")
    build_datastore(None, path, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    return path


def hash_slot(tenant: str) -> int:
    """The tenant slot a declared tenant counts in (and its metrics are kept by)."""
    return zlib.crc32(session_key("", tenant).encode()) % TENANT_BUCKETS


def test_sixty_tenants_holding_one_session_each_all_open_across_workers(store, servers):
    """Two workers, the default 64 slots (56 shared, 8 kept): 60 tenants each hold one
    session or sequence, on 15 connections. Several pairs share a hash slot; before, the
    second of a pair was refused once a share came down to one."""
    tenants = [f"tenant-{i}" for i in range(60)]
    assert sum(n - 1 for n in Counter(map(hash_slot, tenants)).values()) >= 10
    serve = servers.start(store, "--port", str(servers.free_port()), "--workers", "2")
    address = serve.addresses[0]
    pids: set[int] = set()
    sequences = []  # (the connection holding it, its tenant)
    with contextlib.ExitStack() as held:
        for k in range(15):
            c = held.enter_context(DraftClient(address, own_connection=True, timeout=30))
            mine = tenants[4 * k:4 * k + 4]
            for t in mine[:2]:  # Session streams ...
                s = held.enter_context(c.session(DOCS[k][:20], DraftParams(), FP, tenant=t))
                s.step(DOCS[k][20:22])
            for t in mine[2:]:  # ... and Batch sequences, held between calls
                r = c.batch([SequenceOpen("s", DOCS[k][:20])], None, FP, client_id=t,
                            tenant=t)
                assert r.errors == [None], (t, r.errors)
                sequences.append((c, t))
            pids.add(c.stats()["pid"])
        stats = c.stats()
        assert stats["sessions_active"] == 60 and stats["refused_sessions"] == 0
        assert len(pids) == 2  # both workers counted them, in one shared table
        for c, t in sequences:  # each ended on the worker that holds it
            assert c.batch([SequenceEnd("s")], None, FP, client_id=t,
                           tenant=t).errors == [None]
        assert c.stats()["sessions_active"] == 30
    assert serve.stop() == 0


def test_two_tenants_of_one_hash_slot_each_have_their_own_share(store, servers):
    """16 slots: `a` alone stops at 14 (two kept); `b`, in `a`'s hash slot, is a newcomer and
    takes the kept two (before: it was refused with `a`'s share of 14, as if it were `a`);
    with two tenants holding slots each share is 7, and `a` back under it opens up to 7."""
    a, b = "tenant-29", "tenant-57"
    assert hash_slot(a) == hash_slot(b)
    srv = servers.start(store, "--port", "0", "--max-sessions", "16")
    good = DOCS[1][:12]
    with DraftClient(srv.address, timeout=30) as c:
        r = c.batch([SequenceOpen(str(i), good) for i in range(15)], None, FP, client_id=a,
                    tenant=a)
        assert r.errors[:14] == [None] * 14
        assert "this tenant holds its share of 14 sessions and sequences" in str(r.errors[14])
        r = c.batch([SequenceOpen(str(i), good) for i in range(3)], None, FP, client_id=b,
                    tenant=b)
        assert r.errors[:2] == [None, None]
        assert "server has max_sessions=16 sessions and sequences open" in str(r.errors[2])
        r = c.batch([SequenceEnd(str(i)) for i in range(10)]
                    + [SequenceOpen(f"n{i}", good) for i in range(4)], None, FP, client_id=a,
                    tenant=a)
        assert r.errors[:13] == [None] * 13
        assert "its share of 7 sessions and sequences (of max_sessions=16: 14 shared by 2 " \
            "tenants now, 2 kept for tenants to come)" in str(r.errors[13])
        with c.session(good, DraftParams(), FP, tenant=b):  # b is under its share of 7
            assert c.stats()["sessions_active"] == 10
            with pytest.raises(LimitExceeded, match="this tenant holds its share of 7"):
                c.session(good, DraftParams(), FP, tenant=a).open()  # a holds its 7
