"""Learned-output logs: whole records or nothing, damage stops the reading, and a log's
lock tells a live owner from a dead one (a real process, killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from redraft.datastore.learned_log import (
    MAGIC,
    LogTail,
    OwnedLog,
    Record,
    decode,
    encode,
    list_logs,
    owner_alive,
    persist_lock,
    read_log,
)

RECORDS = [Record(0, "t:alice", [1, 2, 3, 70000], False), Record(1, "k:" + "ab" * 32, [], True),
           Record(0, "t:alice", [4], True), Record(2, "t:ü/ß", list(range(1000)), False)]


def test_records_round_trip_and_a_log_reads_as_its_outputs(tmp_path):
    data = encode(RECORDS)
    assert decode(data) == (RECORDS, len(data), False)
    log = OwnedLog(tmp_path)
    log.append(RECORDS[:2])
    log.append(RECORDS[2:])
    assert list_logs(tmp_path) == [log.path] and log.size == len(MAGIC) + len(data)
    outputs, damaged = read_log(log.path)
    assert not damaged
    assert outputs[0].tokens == [1, 2, 3, 70000, 4] and outputs[0].final
    assert outputs[1].tokens == [] and outputs[1].final
    assert outputs[2].tenant == "t:ü/ß" and not outputs[2].final


def test_a_tail_sees_whole_records_only_and_waits_for_the_rest(tmp_path):
    log = OwnedLog(tmp_path)
    tail = LogTail(log.path)
    assert tail.read() == []
    data = encode(RECORDS)
    with open(log.path, "ab") as f:  # a record written in pieces: nothing until it is whole
        cuts = (0, 3, 20, 40)
        for start, end in zip(cuts, cuts[1:]):
            f.write(data[start:end])
            f.flush()
            assert tail.read() == []
        f.write(data[40:])
    assert tail.read() == RECORDS and tail.read() == []
    log.append(RECORDS[:1])
    assert tail.read() == RECORDS[:1]


def test_damage_ends_the_reading_of_a_log_and_says_so(tmp_path):
    log = OwnedLog(tmp_path)
    log.append(RECORDS[:2])
    with open(log.path, "r+b") as f:
        f.seek(-3, os.SEEK_END)  # a token of the second record
        f.write(b"\xff")
    log.append(RECORDS[2:])
    outputs, damaged = read_log(log.path)
    assert damaged and list(outputs) == [0] and outputs[0].tokens == [1, 2, 3, 70000]
    tail = LogTail(log.path)
    assert tail.read() == RECORDS[:1] and tail.damaged and tail.read() == []
    junk = tmp_path / "learned" / "junk.log"
    junk.write_bytes(b"not a log at all, long enough")
    assert read_log(junk) == ({}, True)


OWNER = """
import sys, time
from redraft.datastore.learned_log import OwnedLog, Record
log = OwnedLog(sys.argv[1])
log.append([Record(0, "t:x", [1, 2], False)])
print(log.path, flush=True)
time.sleep(600)
"""


def test_a_log_s_lock_is_held_while_its_owner_lives_and_freed_by_sigkill(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        path = proc.stdout.readline().strip()
        assert owner_alive(path)
        assert owner_alive(path)  # probing takes nothing away
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert not owner_alive(path)
        assert read_log(path)[0][0].tokens == [1, 2]  # what it wrote stays readable
    finally:
        if proc.poll() is None:
            proc.kill()
    mine = OwnedLog(tmp_path)
    assert owner_alive(mine.path)  # in this process too: the probe is another open file
    mine.release()
    assert not owner_alive(mine.path)
    assert not owner_alive(tmp_path / "learned" / "gone.log")


def test_a_log_appears_only_once_its_owner_holds_it(tmp_path):
    seen_unowned = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for path in list_logs(tmp_path):
                if not owner_alive(path) and path.exists():
                    seen_unowned.append(path)

    t = threading.Thread(target=watch)
    t.start()
    logs = [OwnedLog(tmp_path) for _ in range(200)]
    stop.set()
    t.join()
    assert len(list_logs(tmp_path)) == 200 and not seen_unowned
    for log in logs:
        assert read_log(log.path) == ({}, False)


def test_the_persist_lock_is_one_holder_at_a_time_with_a_bounded_wait(tmp_path):
    with persist_lock(tmp_path, 1.0) as held:
        assert held
        t0 = time.monotonic()
        with persist_lock(tmp_path, 0.3) as second:  # another open file: it must wait
            assert not second
        assert 0.3 <= time.monotonic() - t0 < 5
    with persist_lock(tmp_path, 0.0) as again:
        assert again
