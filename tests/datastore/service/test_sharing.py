"""What one serving process learns drafts on the others: two `redraft serve` replicas (two
processes, two ports, one datastore directory) and `--workers 2`, each with a session; the
second drafts (source `learned`) what the first is learning, within the default bound; a
memory-only server killed with SIGKILL leaves nothing any later server uses."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import time

import pytest
from redraft.datastore import Reader, build_datastore
from redraft.datastore.drafting import LearnedIndex
from redraft.datastore.learned_log import list_logs, read_log
from redraft.datastore.service.client import DraftClient, DraftParams
from redraft.datastore.service.persisting import persist_outputs
from redraft.datastore.service.sharing import LogFollower, OutputJournal
from redraft.proto.errors import DatastoreError

FP = "sha256:sharing-test"
VOCAB = 3000
RNG = random.Random(23)
DOCS = [[RNG.randrange(1, 1000) for _ in range(80)] for _ in range(20)]
PROMPT = [RNG.randrange(1, 1000) for _ in range(30)]
SECRET = [RNG.randrange(1000, VOCAB) for _ in range(120)]  # in no corpus: only learnable
LEARNED_ONLY = DraftParams(budget=16, max_depth=8, sources=("learned",))
BOUND_S = 2.0  # the default bound on sharing between processes


@pytest.fixture()
def store(tmp_path) -> str:
    path = str(tmp_path / "ds")
    build_datastore(None, path, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    return path


def learn(client: DraftClient, tenant: str, text=SECRET, close: bool = True):
    """A session of `tenant` whose decoder accepts `text` after PROMPT."""
    s = client.session(PROMPT, DraftParams(budget=8), FP, tenant=tenant).__enter__()
    for i in range(0, len(text), 10):
        s.step(text[i:i + 10])
    if close:
        s.close()
    return s


def delay_until_drafted(watcher, step_s: float = 0.01, timeout: float = 30.0) -> float:
    """Seconds until `watcher` (a session sitting at PROMPT + SECRET[:8]) drafts the rest of
    SECRET from learned outputs."""
    t0 = time.monotonic()
    while True:
        draft = watcher.step([])
        if draft.tokens[:4] == SECRET[8:12]:
            assert set(draft.sources) == {"learned"}
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, "never drafted"
        time.sleep(step_s)


def watcher(client: DraftClient, tenant: str):
    s = client.session(PROMPT, LEARNED_ONLY, FP, tenant=tenant).__enter__()
    assert s.step(SECRET[:8]).tokens == []  # nothing learned yet, anywhere
    return s


def test_a_replica_drafts_what_another_replica_is_learning(store, servers):
    a = servers.start(store, "--port", "0")
    b = servers.start(store, "--port", "0")
    with DraftClient(a.address) as on_a, DraftClient(b.address) as on_b:
        assert on_a.stats()["pid"] != on_b.stats()["pid"]
        alice_b, bob_b = watcher(on_b, "alice"), watcher(on_b, "bob")
        writing = learn(on_a, "alice", close=False)  # still generating on replica A
        assert delay_until_drafted(alice_b) < BOUND_S
        writing.close()
        time.sleep(1.0)  # twice the bound's worth of syncs: nothing reaches another tenant
        assert bob_b.step([]).tokens == []
        replayed = on_b.stats()
        assert replayed["learned_logs_followed"] == 1 and replayed["learned_records_replayed"] > 0
        # and the other way round, for a new tenant
        carol_a = watcher(on_a, "carol")
        learn(on_b, "carol")
        assert delay_until_drafted(carol_a) < BOUND_S
        for s in (alice_b, bob_b, carol_a):
            s.close()
    assert a.stop() == 0 and b.stop() == 0
    assert list_logs(store) == []  # persisted at shutdown, then removed
    with Reader(store) as r:
        assert r.corpora["learned"]["n_docs"] == 5  # each session's output, once


def test_workers_of_one_server_draft_what_each_other_learns(store, servers):
    serve = servers.start(store, "--port", str(servers.free_port()), "--workers", "2",
                          "--learn-persist-seconds", "0")  # memory only: logs share still
    by_pid: dict[int, DraftClient] = {}
    clients = []
    try:
        while len(by_pid) < 2 and len(clients) < 40:  # the kernel spreads connections
            c = DraftClient(serve.address, own_connection=True)
            clients.append(c)
            by_pid.setdefault(c.stats()["pid"], c)
        assert len(by_pid) == 2
        first, second = by_pid.values()
        alice = watcher(second, "alice")
        learn(first, "alice", close=False)
        assert delay_until_drafted(alice) < BOUND_S
        alice.close()
    finally:
        for c in clients:
            c.close()
    assert serve.stop() == 0
    assert list_logs(store) == []  # each worker removed its own log
    with Reader(store) as r:
        assert "learned" not in r.corpora


def test_a_process_rotates_its_log_and_a_retired_log_goes_once_persisted(store):
    """The journal and a follower as two processes see them (each its own open files): a
    full log is retired, released when its last open output ends, then persisted and
    removed; the follower replays every output once, across the rotation."""
    journal = OutputJournal(store, rotate_bytes=1000)
    index = LearnedIndex()
    follower = LogFollower(store, index, own=set())
    long_running = journal.begin("t:long")
    journal.append(long_running, SECRET[:20])
    outputs = {"t:long": SECRET[:20]}
    for i in range(6):  # ~185 bytes each: the fifth fills the first log
        out = journal.begin(f"t:{i}")
        journal.append(out, DOCS[i][:40])
        journal.end(out)
        outputs[f"t:{i}"] = DOCS[i][:40]
        journal.flush()
    first, second = sorted(journal.names, key=lambda n: n != long_running.log.file.name)
    assert len(journal.names) == 2 and journal.locked_names() == {first, second}
    persist_outputs(store, journal.locked_names(), FP, 5.0)
    assert {p.name for p in list_logs(store)} == {first, second}  # `long` still open
    journal.append(long_running, SECRET[20:40])
    journal.end(long_running)
    outputs["t:long"] = SECRET[:40]
    journal.flush()
    assert journal.locked_names() == {second}  # the retired log is released
    follower.poll()
    for tenant, tokens in outputs.items():
        assert index.propose(tenant, tokens[:10], 8, 8).tokens[:4] == tokens[10:14], tenant
    assert index.stats()["learned_docs"] == len(outputs)
    done = persist_outputs(store, journal.locked_names(), FP, 5.0)
    assert done.removed_logs == 1 and {p.name for p in list_logs(store)} == {second}
    follower.poll()  # it reads the rest of a removed log, then lets it go
    assert index.stats()["learned_docs"] == len(outputs)
    journal.close()
    assert persist_outputs(store, set(), FP, 5.0).outputs == 0 and list_logs(store) == []
    with Reader(store) as r:
        found = sorted((name, tokens) for _, name, tokens in r.documents("learned"))
    assert found == sorted(outputs.items())


FULL_DISK = """
import os, resource, signal, sys
from redraft.datastore.learned_log import list_logs, read_log
from redraft.datastore.service.sharing import OutputJournal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
journal = OutputJournal(sys.argv[1])
path = list_logs(sys.argv[1])[0]

def output(tenant, tokens):
    out = journal.begin(tenant)
    journal.append(out, tokens)
    journal.end(out)

output("t:a", list(range(1, 50)))
journal.flush()
size = os.path.getsize(path)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, hard))  # the disk is full
output("t:b", list(range(100, 400)))  # ~1.2 KB: part of it fits, then the write fails
try:
    journal.flush()
except OSError as exc:
    print("failed", exc.errno, os.path.getsize(path) == size, flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space again
output("t:c", [7, 8, 9])
journal.flush()
journal.close()
"""


def test_a_log_write_failing_on_a_full_disk_keeps_its_outputs_for_the_next_write(store):
    """A real process whose file size limit stands for a full disk: the failed write leaves
    no partial record behind (it would hide every later one), and the outputs it carried
    are written by the next flush."""
    done = subprocess.run([sys.executable, "-c", FULL_DISK, store], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["failed", str(errno.EFBIG), "True"]
    (path,) = list_logs(store)
    outputs, damaged = read_log(path)
    assert not damaged
    assert {o.tenant: (o.tokens, o.final) for o in outputs.values()} == {
        "t:a": (list(range(1, 50)), True), "t:b": (list(range(100, 400)), True),
        "t:c": ([7, 8, 9], True)}


def killed_memory_only_server(store, servers, until, tenant: str):
    """A memory-only server that learned one output of `tenant`, then was SIGKILLed (it
    could not remove its log): the log it leaves."""
    a = servers.start(store, "--port", "0", "--learn-persist-seconds", "0")
    with DraftClient(a.address) as c:
        learn(c, tenant)
    (path,) = list_logs(store)
    until(lambda: any(o.final for o in read_log(path)[0].values()))
    a.kill()
    return path


def test_a_killed_memory_only_server_leaves_nothing_a_later_server_replays_or_persists(
        store, servers, until):
    path = killed_memory_only_server(store, servers, until, "alice")
    later = servers.start(store, "--port", "0", "--learn-persist-seconds", "0")
    until(lambda: path not in list_logs(store))  # the next server removes it
    with DraftClient(later.address) as c:
        stats = c.stats()
        assert stats["learned_docs"] == 0 and stats["learned_records_replayed"] == 0
        alice = watcher(c, "alice")  # drafts nothing of it
        alice.close()
    assert later.stop() == 0 and list_logs(store) == []
    path = killed_memory_only_server(store, servers, until, "bob")
    persisting = servers.start(store, "--port", "0", "--learn-persist-seconds", "0.2")
    until(lambda: path not in list_logs(store))
    assert persisting.stop() == 0 and list_logs(store) == []
    with Reader(store) as r:
        assert "learned" not in r.corpora  # nothing of either run reached the datastore
    assert not any(n.startswith(path.name) for n in os.listdir(path.parent))


def test_a_journal_that_cannot_write_keeps_its_bound_counts_what_it_gives_up_then_writes(
        tmp_path):
    """A datastore that takes no log (here a file stands where the log folder goes): what
    is learned waits in memory, at most `max_pending_tokens` of it (the outputs waiting
    longest are given up whole and counted), and is written once a log can be."""
    store = tmp_path / "ds"
    store.mkdir()
    (store / "learned").write_text("in the way")
    journal = OutputJournal(str(store), max_pending_tokens=100)
    assert "cannot create a learned-output log" in journal.unwritable
    outs = []
    for i in range(5):
        out = journal.begin(f"t:{i}")
        journal.append(out, list(range(40 * i, 40 * i + 40)))
        journal.end(out)
        outs.append(out)
        with pytest.raises(DatastoreError, match="cannot create"):
            journal.flush()
    assert journal.dropped == [3, 120] and journal.unwritten() == (2, 80)
    journal.append(outs[0], [1, 2, 3])  # given up: it takes nothing more
    (store / "learned").unlink()
    journal.flush()
    journal.close()
    (path,) = list_logs(store)
    outputs, damaged = read_log(path)
    assert not damaged
    assert {o.tenant: o.tokens for o in outputs.values()} == {
        "t:3": list(range(120, 160)), "t:4": list(range(160, 200))}
