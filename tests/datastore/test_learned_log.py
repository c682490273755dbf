"""Learned-output logs: whole records or nothing, damage stops the reading (a scan reads
past it and counts what it cost), an owner writes its log again when it is deleted or
damaged under it, and a log's lock tells a live owner from a dead one (a real process,
killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from redraft.datastore import learned_log
from redraft.datastore.learned_log import (
    MAGIC_V1,
    LogHeader,
    LogTail,
    OwnedLog,
    Record,
    decode,
    encode,
    encode_header,
    list_logs,
    owner_alive,
    persist_lock,
    read_log,
    scan_log,
)

from ..conftest import flip_byte

RECORDS = [Record(0, "t:alice", [1, 2, 3, 70000], False), Record(1, "k:" + "ab" * 32, [], True),
           Record(0, "t:alice", [4], True), Record(2, "t:ü/ß", list(range(1000)), False)]


def test_records_round_trip_and_a_log_reads_as_its_outputs(tmp_path):
    data = encode(RECORDS)
    assert decode(data) == (RECORDS, len(data), False)
    log = OwnedLog(tmp_path)
    log.append(RECORDS[:2])
    log.append(RECORDS[2:])
    assert list_logs(tmp_path) == [log.path]
    assert log.size == len(encode_header(LogHeader())) + len(data)
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


def test_a_legacy_version_1_log_is_still_read(tmp_path):
    folder = tmp_path / "learned"
    folder.mkdir()
    old = folder / "old.log"
    old.write_bytes(MAGIC_V1 + encode(RECORDS, version=1))
    assert list_logs(tmp_path) == [old]
    outputs, damaged = read_log(old)
    assert not damaged and outputs[0].tokens == [1, 2, 3, 70000, 4] and outputs[0].final
    tail = LogTail(old)
    assert tail.read() == RECORDS and tail.header == LogHeader("", False, 1)
    scan = scan_log(old)
    assert not scan.damaged and scan.outputs[2].tokens == list(range(1000))


def test_an_output_longer_than_a_record_is_split_and_reads_whole(tmp_path, monkeypatch):
    """An output of 17 Mi tokens would be one record past MAX_RECORD, which every reader
    calls damage: the writer splits at RECORD_TOKENS (small here, to stay fast)."""
    assert 4 * learned_log.RECORD_TOKENS + 1024 < learned_log.MAX_RECORD
    monkeypatch.setattr(learned_log, "RECORD_TOKENS", 1000)
    tokens = list(range(2500))
    log = OwnedLog(tmp_path)
    log.append([Record(0, "t:long", tokens, True), Record(1, "t:next", [5, 6], True)])
    records, _, damaged = decode(log.path.read_bytes(), log.size - len(encode([
        Record(0, "t:long", tokens, True), Record(1, "t:next", [5, 6], True)])))
    assert not damaged and [len(r.tokens) for r in records] == [1000, 1000, 500, 2]
    assert [r.final for r in records] == [False, False, True, True]
    scan = scan_log(log.path)
    assert not scan.damaged and scan.outputs[0].final and scan.outputs[1].tokens == [5, 6]
    assert scan.outputs[0].tokens == tokens
    outputs, damaged = read_log(log.path)
    assert not damaged and outputs[0].tokens == tokens


def test_a_scan_reads_past_damage_and_counts_what_it_cost(tmp_path):
    log = OwnedLog(tmp_path)
    head = log.size
    sizes = []
    for n in range(6):  # output 1 in two records; the flip hits its second one
        records = [Record(n, f"t:{n}", [n] * 50, n != 1)]
        if n == 2:
            records.insert(0, Record(1, "t:1", [9] * 50, True, 50))
        log.append(records)
        sizes.append(log.size)
    flip_byte(log.path, sizes[1] + 40)  # inside output 1's second record
    scan = scan_log(log.path)
    assert scan.damaged and scan.damage_at is not None and scan.damaged_bytes > 0
    assert sorted(scan.outputs) == [0, 1, 2, 3, 4, 5] and scan.cut == set()
    assert scan.outputs[1].tokens == [1] * 50 and not scan.outputs[1].final
    assert all(scan.outputs[n].final for n in (0, 2, 3, 4, 5))
    flip_byte(log.path, head + 30)  # and output 0's only record: lost whole
    scan = scan_log(log.path)
    assert scan.lost() == {0} and sorted(scan.outputs) == [1, 2, 3, 4, 5]
    # a record missing from the middle of an output: kept up to the gap
    log2 = OwnedLog(tmp_path)
    log2.append([Record(0, "t:a", [1, 2], False)])
    at = log2.size
    log2.append([Record(0, "t:a", [3, 4], False, 2)])
    log2.append([Record(0, "t:a", [5], True, 4)])
    flip_byte(log2.path, at + 30)
    scan = scan_log(log2.path)
    assert scan.cut == {0} and scan.outputs[0].tokens == [1, 2] and not scan.outputs[0].final


@pytest.mark.parametrize("harm", ["delete", "cut", "flip", "replace"])
def test_an_owner_writes_its_log_again_when_it_is_harmed_and_readers_keep_their_place(
        tmp_path, harm):
    log = OwnedLog(tmp_path, fingerprint="sha256:x")
    log.append(RECORDS[:2])
    tail = LogTail(log.path)
    assert tail.read() == RECORDS[:2]
    written = log.path.read_bytes()
    assert log.check(full=True) is None  # nothing happened: nothing to do
    if harm == "delete":
        os.unlink(log.path)
    elif harm == "cut":
        os.truncate(log.path, len(written) // 2)
    elif harm == "flip":
        flip_byte(log.path, len(written) - 5)
    else:
        log.path.with_name("other").write_bytes(b"x" * 100)
        os.rename(log.path.with_name("other"), log.path)
    said = log.check(full=True)
    assert said is not None and "written again from memory" in said
    assert log.path.read_bytes() == written and owner_alive(log.path)
    log.append(RECORDS[2:])
    assert tail.read() == RECORDS[2:]  # from where it was, in the new file
    outputs, damaged = read_log(log.path)
    assert not damaged and outputs[0].tokens == [1, 2, 3, 70000, 4]
    assert log.check() is None
