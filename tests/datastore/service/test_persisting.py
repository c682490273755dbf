"""Learned outputs persisted exactly once, with real `redraft serve` processes: replicas and
workers persisting at the same moment, a replica killed with SIGKILL in the middle of a
persist, another writer holding the datastore's lock through persists and a shutdown, a
log damaged or deleted under its server or after it, a log of another tokenizer.
Every output is found once in the datastore afterwards, by its name (each test session has
its own tenant, and a persisted output is named by its tenant's key)."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from redraft.datastore import Reader, build_datastore, persist_learned
from redraft.datastore.format import WRITE_LOCK
from redraft.datastore.learned_log import OwnedLog, Record, list_logs, read_log
from redraft.datastore.manifest import MANIFEST_FILE
from redraft.datastore.manifest import encode as encode_manifest
from redraft.datastore.service.client import DraftClient, DraftParams
from redraft.datastore.service.persisting import MarksDamaged, Ranges, log_marks

from ...conftest import flip_byte

FP = "sha256:persisting-test"
VOCAB = 30000
RNG = random.Random(211)
DOCS = [[RNG.randrange(1, 1000) for _ in range(80)] for _ in range(20)]
PROMPT = [RNG.randrange(1, 1000) for _ in range(30)]


@pytest.fixture()
def store(tmp_path) -> str:
    path = str(tmp_path / "ds")
    build_datastore(None, path, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    return path


def output_of(tenant: str, n_tokens: int = 40) -> list[int]:
    rng = random.Random(tenant)
    return [rng.randrange(1000, VOCAB) for _ in range(n_tokens)]


def learn(address: str, tenants, n_tokens: int = 40, chunk: int = 10) -> None:
    """One session per tenant, each accepting its own output after PROMPT; they all end
    together (so that one persist has them all)."""
    with DraftClient(address, timeout=30) as c:
        sessions = []
        for tenant in tenants:
            text = output_of(tenant, n_tokens)
            s = c.session(PROMPT, DraftParams(budget=4), FP, tenant=tenant).__enter__()
            for i in range(0, len(text), chunk):
                s.step(text[i:i + chunk])
            sessions.append(s)
        for s in sessions:
            s.close()


def persisted(store: str) -> Counter:
    """How often each tenant's output is in the datastore (checked to be that output)."""
    found: Counter = Counter()
    with Reader(store) as r:
        if "learned" not in r.corpora:
            return found
        for _, name, tokens in r.documents("learned"):
            tenant = name.removeprefix("t:")
            text = output_of(tenant, len(tokens) - 16)
            assert tokens == PROMPT[-16:] + text, f"{name} persisted with other tokens"
            found[tenant] += 1
    return found


def test_ranges_hold_a_log_s_persisted_outputs():
    r = Ranges()
    order = list(range(200))
    random.Random(1).shuffle(order)
    for i, n in enumerate(order):
        r.add(n)
        r.add(n)  # twice is once
        assert all(m in r for m in order[:i + 1]) and sum(m in r for m in range(200)) == i + 1
    assert r.to_json() == [[0, 200]]
    assert Ranges(r.to_json()).to_json() == [[0, 200]]
    gaps = Ranges([[0, 5], [7, 9]])
    assert 4 in gaps and 5 not in gaps and 7 in gaps and 9 not in gaps


@pytest.mark.parametrize("layout", ["replicas", "workers"])
def test_processes_persisting_at_the_same_moment_persist_each_output_once(
        store, servers, until, layout):
    often = ("--learn-persist-seconds", "0.2")  # they keep colliding while serving too
    if layout == "replicas":
        procs = [servers.start(store, "--port", "0", *often) for _ in range(2)]
        addresses = [p.address for p in procs]
    else:
        procs = [servers.start(store, "--port", str(servers.free_port()), "--workers", "2",
                               *often)]
        addresses = procs[0].addresses
    tenants = [f"{layout}-{i}" for i in range(20)]
    with ThreadPoolExecutor(4) as pool:  # sessions on every process at once
        list(pool.map(lambda k: learn(addresses[k % 2], tenants[k::4]), range(4)))
    stopping = [threading.Thread(target=p.stop) for p in procs]
    for t in stopping:  # SIGTERM at once: their shutdown persists race
        t.start()
    for t in stopping:
        t.join()
    assert [p.proc.returncode for p in procs] == [0] * len(procs)
    assert persisted(store) == Counter(tenants)
    assert list_logs(store) == []  # every log persisted and removed
    # a restart loads them, once each
    again = servers.start(store, "--port", "0")
    with DraftClient(again.address) as c:
        until(lambda: c.stats()["learned_docs"] == 20)  # loading runs in the background
    assert again.stop() == 0
    assert persisted(store) == Counter(tenants)


def holds_write_lock(store: str, pid: int) -> bool:
    """Whether process `pid` holds the datastore's write lock (read from /proc/locks, which
    takes nothing away from the writer)."""
    inode = os.stat(os.path.join(store, WRITE_LOCK)).st_ino
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "FLOCK" in parts and parts[4] == str(pid) and parts[5].endswith(f":{inode}"):
                return True
    return False


def test_a_replica_killed_in_the_middle_of_a_persist_loses_and_doubles_nothing(
        store, servers, until):
    # no timed persist: the one at shutdown writes every output (all in the log by then; a
    # timed persist could start within a sync of the last step, and a kill then loses what
    # the log did not have yet, as documented)
    # 60 tenants at once, on the default fair shares (tenants of one hash slot are counted
    # apart, so none refuses another)
    a = servers.start(store, "--port", "0", "--learn-persist-seconds", "600")
    tenants = [f"big-{i}" for i in range(60)]
    # a large batch: the persist that commits it holds the write lock for long enough
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda k: learn(a.address, tenants[k::2], n_tokens=8000, chunk=2000),
                      range(2)))
    a.proc.send_signal(signal.SIGTERM)
    until(lambda: holds_write_lock(store, a.pid), timeout=30, step=0.002)
    a.kill()  # SIGKILL while it writes
    assert persisted(store) == Counter()  # the commit never happened: nothing published
    b = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.5")
    try:
        until(lambda: persisted(store) == Counter(tenants), timeout=60, step=0.2)
    except AssertionError:
        b.kill()
        raise AssertionError(f"persisted {persisted(store)}; logs {list_logs(store)}; "
                             f"the restarted replica said: {b.stderr}") from None
    assert b.stop() == 0
    assert persisted(store) == Counter(tenants) and list_logs(store) == []


def test_a_writer_holding_the_lock_delays_persists_and_loses_nothing(store, servers, until):
    serve = ("--port", "0", "--learn-persist-seconds", "0.3", "--learn-persist-wait", "0.2")
    a = servers.start(store, *serve)
    lock = os.open(os.path.join(store, WRITE_LOCK), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as `redraft index --append` holds it
        learn(a.address, ["held-0", "held-1", "held-2"])
        until(lambda: "the next persist retries" in a.stderr, timeout=10)
        assert persisted(store) == Counter()
        fcntl.flock(lock, fcntl.LOCK_UN)  # the writer is done: the next persist gets them
        until(lambda: persisted(store) == Counter(["held-0", "held-1", "held-2"]), timeout=10)
        fcntl.flock(lock, fcntl.LOCK_EX)  # and again, this time through a shutdown
        learn(a.address, ["late-0", "late-1"])
        warned = a.stderr.count("the next persist retries")
        assert a.stop() == 0
        assert a.stderr.count("the next persist retries") > warned  # the shutdown persist gave up
        assert len(list_logs(store)) == 1  # what it could not persist stays logged
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
    b = servers.start(store, *serve)  # any process persists it later
    until(lambda: persisted(store) == Counter(
        ["held-0", "held-1", "held-2", "late-0", "late-1"]), timeout=10)
    assert b.stop() == 0
    assert list_logs(store) == []


def dead_owner_log(store: str, records) -> str:
    """A log as a process that died wrote it: whole records (the project's own encoder,
    checksums right), its lock free."""
    log = OwnedLog(store)
    log.append(records)
    log.release()
    return log.name


def test_a_logged_token_id_past_the_vocabulary_is_quarantined_and_the_rest_persisted(
        store, servers, until):
    # as a replica still serving an old snapshot after a rebuild with another tokenizer
    # writes: right length and checksum, ids the datastore does not have
    good = [Record(0, "t:logged-0", PROMPT[-16:] + output_of("logged-0", 24), True),
            Record(2, "t:logged-2", PROMPT[-16:] + output_of("logged-2", 24), True)]
    bad = [Record(1, "t:bad", PROMPT[-16:] + [5, 6, VOCAB + 7, 8], True),
           Record(3, "not a key", PROMPT[-16:] + [9, 10], True)]
    name = dead_owner_log(store, [good[0], bad[0], bad[1], good[1]])
    a = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.3")
    with DraftClient(a.address) as c:
        until(lambda: c.stats()["learned_docs"] == 2)  # the good ones are replayed
        ids = c.propose(PROMPT + [5, 6], DraftParams(budget=16, max_depth=8,
                                                     sources=("learned",)), tenant="bad")
        assert all(t < VOCAB for t in ids.tokens)  # never drafted
    learn(a.address, ["new-0", "new-1", "new-2"])
    until(lambda: persisted(store) == Counter(["logged-0", "logged-2", "new-0", "new-1",
                                               "new-2"]), timeout=10)
    assert a.stop() == 0
    assert persisted(store) == Counter(["logged-0", "logged-2", "new-0", "new-1", "new-2"])
    assert list_logs(store) == []  # the quarantined outputs are not read again
    said = [line for line in a.stderr.splitlines() if name in line]
    assert len(said) == 2 and "past the vocabulary" in said[0] and "Traceback" not in a.stderr


BAD_MARKS = [{"logs": "nonsense"}, {"logs": [[0, 1]]}, {"logs": {"a.log": [[5, 2]]}},
             {"logs": {"a.log": [[0, "x"]]}}, {"logs": {"a.log": [[0, 3], [2, 5]]}},
             {"logs": {"a.log": 7}}, {"logs": {"a.log": [[0, True]]}}]


def test_marks_of_another_shape_are_damage():
    for marks in BAD_MARKS:
        with pytest.raises(MarksDamaged, match="learned marks"):
            log_marks(marks)
    assert log_marks({}) == {} and log_marks({"logs": {}}) == {}
    assert log_marks({"logs": {"a.log": [[0, 3], [3, 5]]}})["a.log"].to_json() == [[0, 3],
                                                                                     [3, 5]]


@pytest.mark.parametrize("marks", BAD_MARKS[:3])
def test_a_server_over_marks_of_another_shape_says_so_once_and_keeps_serving(
        store, servers, until, marks):
    persist_learned(store, [("t:before", PROMPT[-16:] + output_of("before", 24))], marks,
                    fingerprint=FP)
    a = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.2")
    with DraftClient(a.address) as c:
        until(lambda: c.stats()["learned_docs"] == 1)  # what was persisted still loads
    learn(a.address, ["kept-0", "kept-1"])
    until(lambda: "learned marks" in a.stderr, timeout=10)
    with DraftClient(a.address) as c:  # persists came and went: it still serves
        with c.session(PROMPT, DraftParams(budget=4), FP, tenant="after") as s:
            s.step(output_of("after", 10))
    assert a.stop() == 0
    assert "Traceback" not in a.stderr, a.stderr
    said = [line for line in a.stderr.splitlines() if "learned marks" in line]
    assert len(said) == 1, a.stderr  # one line, not one per persist
    assert persisted(store) == Counter(["before"])  # nothing doubled on bad marks
    (log,) = list_logs(store)  # and nothing lost: the outputs wait in their log
    assert sorted(o.tenant for o in read_log(log)[0].values()) == ["t:after", "t:kept-0",
                                                                   "t:kept-1"]


def finals(path) -> int:
    return sum(o.final for o in read_log(path)[0].values())


@pytest.mark.parametrize("harm", ["flip", "cut", "delete"])
def test_a_live_server_s_log_damaged_or_deleted_under_it_loses_nothing_and_says_so(
        store, servers, until, harm):
    # one bit flipped, the log cut to half (the writer goes on at the new end), or the log
    # deleted (a cleanup job, `rsync --delete`): the server still holds what it wrote
    a = servers.start(store, "--port", "0", "--learn-persist-seconds", "600")
    learn(a.address, ["early-0", "early-1", "early-2"])
    (path,) = list_logs(store)
    until(lambda: finals(path) == 3)
    size = os.path.getsize(path)
    if harm == "flip":
        flip_byte(path, size // 2)
    elif harm == "cut":
        os.truncate(path, size // 2)
    else:
        os.unlink(path)
    learn(a.address, ["late-0", "late-1", "late-2"])
    assert a.stop() == 0
    assert persisted(store) == Counter(["early-0", "early-1", "early-2", "late-0", "late-1",
                                        "late-2"])
    assert list_logs(store) == []
    said = [line for line in a.stderr.splitlines() if "written again from memory" in line]
    assert len(said) == 1 and path.name in said[0], a.stderr
    assert "Traceback" not in a.stderr


def test_a_damaged_log_of_a_gone_owner_is_persisted_past_the_damage_kept_and_counted(
        store, servers, until):
    log = OwnedLog(store, FP)
    ends = []
    for n in range(6):
        log.append([Record(n, f"t:logged-{n}", PROMPT[-16:] + output_of(f"logged-{n}", 24),
                           True)])
        ends.append(log.size)
    log.release()  # its owner is gone
    flip_byte(log.path, ends[0] + 60)  # inside output 1: every later output is still whole
    a = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.3")
    until(lambda: "kept as" in a.stderr, timeout=15)
    assert persisted(store) == Counter([f"logged-{n}" for n in (0, 2, 3, 4, 5)])
    assert a.stop() == 0
    assert list_logs(store) == []  # never read again, and never removed:
    assert (log.path.parent / f"{log.name}.damaged").exists()
    (said,) = [line for line in a.stderr.splitlines() if "kept as" in line]
    assert "1 output(s) lost whole (output 1)" in said and "bytes unreadable" in said
    assert persisted(store) == Counter([f"logged-{n}" for n in (0, 2, 3, 4, 5)])


def test_outputs_learned_for_another_tokenizer_are_neither_replayed_nor_persisted(
        store, servers, until, tmp_path):
    # the datastore rebuilt with another tokenizer of the same vocabulary size while an
    # old replica still serves the old snapshot
    old = servers.start(store, "--port", "0", "--learn-persist-seconds", "600")
    build_datastore(None, store, documents=DOCS, fingerprint=FP + "-new", vocab_size=VOCAB,
                    corpus="c")
    learn(old.address, ["old-0", "old-1"])  # ids of the old tokenizer
    (path,) = list_logs(store)
    until(lambda: finals(path) == 2)
    new = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.2")
    until(lambda: "another tokenizer" in new.stderr)
    assert old.stop() == 0  # its shutdown persist, or the new server's, sets its log aside
    aside = path.parent / f"{path.name}.other-tokenizer"
    until(aside.exists, timeout=10)
    with DraftClient(new.address) as c:
        assert c.stats()["learned_docs"] == 0
    assert new.stop() == 0
    assert persisted(store) == Counter() and list_logs(store) == []
    assert "2 output(s) not persisted" in old.stderr + new.stderr
    assert "Traceback" not in old.stderr + new.stderr


def set_shard_tokens(store: str, value) -> None:
    """Edit the manifest by hand (its crc32 sealed again): the shard size `value`."""
    path = os.path.join(store, MANIFEST_FILE)
    with open(path) as f:
        m = json.load(f)
    m["build"]["shard_tokens"] = value
    with open(path + ".edit", "wb") as f:
        f.write(encode_manifest(m))
    os.replace(path + ".edit", path)


def test_a_manifest_field_of_the_wrong_type_stops_no_persister_and_no_shutdown(
        store, servers, until):
    # before: the persist raised a ValueError, which ended the persisting silently; the
    # shutdown then exited 1 with a traceback, the outputs unpersisted
    a = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.3")
    with open(os.path.join(store, MANIFEST_FILE)) as f:
        size = json.load(f)["build"]["shard_tokens"]
    set_shard_tokens(store, "x")
    learn(a.address, ["typed-0", "typed-1"])
    until(lambda: "could not persist learned outputs" in a.stderr, timeout=10)
    set_shard_tokens(store, size)  # repaired: the same persister goes on
    until(lambda: persisted(store) == Counter(["typed-0", "typed-1"]), timeout=10)
    set_shard_tokens(store, "x")
    learn(a.address, ["typed-2"])
    assert a.stop() == 0
    assert "Traceback" not in a.stderr and "build.shard_tokens" in a.stderr
    set_shard_tokens(store, size)
    b = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.3")
    until(lambda: persisted(store) == Counter(["typed-0", "typed-1", "typed-2"]), timeout=10)
    assert b.stop() == 0


def test_a_gone_owner_s_log_cut_inside_its_header_is_kept_and_said(store, servers, until):
    log = OwnedLog(store, FP)
    log.append([Record(0, "t:cut-0", PROMPT[-16:] + output_of("cut-0", 24), True)])
    log.release()
    os.truncate(log.path, 30)  # inside the header: nothing in it can be read
    a = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.3")
    until(lambda: "kept as" in a.stderr, timeout=15)
    assert a.stop() == 0
    assert list_logs(store) == [] and (log.path.parent / f"{log.name}.damaged").exists()
    assert "header is damaged or cut" in a.stderr and persisted(store) == Counter()
