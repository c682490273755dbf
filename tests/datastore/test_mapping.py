"""Segment maps whose file is truncated under them (issue 31.6): a read past the new end
reads zeros and the Reader refuses the data with DatastoreCorrupt, instead of the process
dying of SIGBUS; a SIGBUS anywhere else still reaches the handler before ours (or kills).

Each case runs in a child process of its own, which truncates a real segment file it has
mapped: what is checked is how that process ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from redraft.datastore import build_datastore

_mapping = pytest.importorskip("redraft.datastore._mapping")

VOCAB = 3000


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """About 4 MB of one segment: pages enough that a truncation leaves most unmapped."""
    rng = np.random.default_rng(31)
    docs = [rng.integers(1, VOCAB, 2000).tolist() for _ in range(400)]
    path = str(tmp_path_factory.mktemp("map") / "ds")
    build_datastore(None, path, documents=docs, fingerprint="sha256:map", vocab_size=VOCAB)
    return path


def run_child(code: str, *args: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120)


TRUNCATE_UNDER_A_READER = """
    import os, shutil, sys
    from redraft.datastore import DatastoreCorrupt, Reader
    src, work = sys.argv[1], sys.argv[2]
    shutil.copytree(src, work)
    r = Reader(work)
    seg = os.path.join(work, r.segments[0])
    docs = r.shard_documents(0)
    context = docs[7][:20].tolist()
    assert r.longest_match(context) == 16
    os.truncate(seg, 8192)  # what `cp` does first to a file it overwrites
    refused = 0
    for verb in (lambda: r.count(context), lambda: r.find(docs[300][:8].tolist()),
                 lambda: r.longest_match(docs[399][-20:].tolist()), r.verify):
        try:
            verb()
        except DatastoreCorrupt as exc:
            refused += 1
            print(exc)
    print("refused", refused)
    r.close()
"""


def test_a_segment_truncated_under_a_reader_is_refused_not_a_sigbus(store, tmp_path):
    done = run_child(TRUNCATE_UNDER_A_READER, store, str(tmp_path / "w"))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused 4" in done.stdout
    assert "truncated while mapped" in done.stdout


TRUNCATE_UNDER_THE_CORE = """
    import os, shutil, sys
    from redraft.datastore import DatastoreCorrupt, Reader
    from redraft.datastore.drafting import DraftSettings, new_session_drafter
    from redraft.proto.params import DraftParams
    src, work = sys.argv[1], sys.argv[2]
    shutil.copytree(src, work)
    r = Reader(work)
    docs = r.shard_documents(0)
    d = new_session_drafter(docs[7][:20].tolist(), DraftSettings(DraftParams(16, 16, ("rest",))),
                            r, choice="native")
    assert d.propose().tokens[0] == docs[7][20]
    os.truncate(os.path.join(work, r.segments[0]), 8192)
    for i in range(50):  # steps into other documents: their pages are gone
        try:
            d.step(docs[(i * 37) % 400][:20].tolist())
        except DatastoreCorrupt as exc:
            print(exc)
            break
    else:
        print("never refused")
"""


def test_a_segment_truncated_under_the_compiled_core_is_refused(store, tmp_path):
    done = run_child(TRUNCATE_UNDER_THE_CORE, store, str(tmp_path / "w"))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "truncated while mapped" in done.stdout


OTHER_SIGBUS = """
    import mmap, os, sys
    from redraft.datastore import Reader
    Reader(sys.argv[1]).close()  # the handler is installed
    path = sys.argv[2]
    with open(path, "wb") as f:
        f.write(b"x" * 65536)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    os.truncate(path, 0)
    print("read", m[40000])  # not a datastore's map: SIGBUS as ever
"""


@pytest.mark.parametrize("flags", [(), ("-X", "faulthandler")], ids=["default", "faulthandler"])
def test_a_sigbus_outside_the_maps_still_kills(store, tmp_path, flags):
    done = run_child(OTHER_SIGBUS, store, str(tmp_path / "plain"), flags=flags)
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr[-2000:])
    assert "read" not in done.stdout
    if flags:  # the handler installed before ours still runs
        assert "Bus error" in done.stderr


def test_a_map_reads_as_the_file_and_refuses_to_close_while_viewed(tmp_path):
    path = tmp_path / "f"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = _mapping.Map(fd)
    finally:
        os.close(fd)
    assert len(m) == len(data) and m[5:300] == data[5:300] and m[-1] == data[-1]
    assert m[::7] == data[::7] and bytes(memoryview(m)) == data
    view = memoryview(m)[10:20]
    with pytest.raises(BufferError):
        m.close()
    view.release()
    m.close()
    assert m.closed and not m.truncated
    with pytest.raises(ValueError, match="closed"):
        m[0]
