"""A Reader's shard arrays as the compiled core reads them (one Store per open Reader).

Why a Store per Reader and not per session: its prefix tables (derived from the suffix
arrays, one byte per datastore token) are built once and shared by every session drafting
from that snapshot. A reader of a newer commit of the same datastore reuses the tables of
the shards the older snapshot already had (segments are immutable), so a reload costs only
its new segments. Once the Reader closes, the Store is kept only by the sessions still
holding it, and its maps go with the last of them.

Tested by: tests/datastore/drafting/native/test_native_session.py,
tests/datastore/test_mapping.py
"""

from __future__ import annotations

import sys
import threading
import weakref

import redraft.datastore.drafting.native._core as _core
from redraft.datastore.lmdbfile import faults
from redraft.proto.errors import DatastoreCorrupt

_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Reader -> Store
_latest: dict[str, weakref.ref] = {}  # datastore directory -> its newest Store
_lock = threading.Lock()
# Store -> faults() before its tables were built: a later Store shares them only if no map
# of the process was truncated since (a truncated map reads zeros: lmdbfile).
_built_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def store_of(reader) -> _core.Store:
    """The core's view of `reader`'s mapped arrays, made once per Reader.

    The Store holds buffers of the arrays, so the maps outlive a close() until the Store
    goes (the Reader tolerates that: a session still holding it finishes its step on valid
    memory); it asks the Reader whether it was closed before every step, so a closed Reader
    still refuses queries as the Python path does.
    """
    with _lock:
        store = _stores.get(reader)
        if store is not None:
            return store
        if reader.closed:  # no arrays left: a Store that only knows it is closed
            return _core.Store(reader, reader.token_width, reader.separator,
                               reader.vocab_size, [])
        if sys.byteorder != "little":  # the suffix arrays are little-endian on disk
            raise NotImplementedError("the compiled core reads datastores on little-endian "
                                      "machines only")
        shards = [(a.tokens, a.sa, a.bucket, a.length, a.key) for a in reader.shard_arrays()]
        directory = str(getattr(reader, "directory", reader.path))
        ref = _latest.get(directory)
        earlier = ref() if ref is not None else None
        seen = faults()
        if earlier is not None and _built_at.get(earlier) != seen:
            earlier = None  # a map was truncated since: its tables may hold zeros read then
        try:
            store = _core.Store(reader, reader.token_width, reader.separator,
                                reader.vocab_size, shards, earlier)
        except ValueError as exc:
            reader.check_maps()
            raise DatastoreCorrupt(f"{reader.file}: {exc}; verify it with "
                                   f"`redraft stats`") from exc
        reader.check_maps()  # truncated while its tables were built
        _stores[reader] = store
        _latest[directory] = weakref.ref(store)
        _built_at[store] = seen
        ref = weakref.ref(reader)
        reader.on_close(lambda: _forget(ref))
        return store


def _forget(ref: weakref.ref) -> None:
    """A reader closed: its Store stays only with the sessions that still hold it (until
    their next step on a newer snapshot), so its maps go with the last of them."""
    reader = ref()
    if reader is not None:
        with _lock:
            _stores.pop(reader, None)
