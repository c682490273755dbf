"""Reading a single-file LMDB environment without LMDB, every offset checked first.

LMDB (and so py-lmdb) follows the page numbers and node offsets stored in the file without
checking them against the file: in a damaged file one flipped byte sends it outside the map
and the process dies of SIGBUS. A datastore reads only a few dozen keys of LMDB's main
database, so its readers parse the on-disk format themselves, from their own read-only map,
and check every page number, node offset, key length and value length against the page and
the file before slicing anything. A value comes back as its (offset, length) in the map:
zero-copy, and never outside the file. Only writers use LMDB, on files they create.

A file truncated while mapped (a served datastore refreshed in place, `cp -r new/. served/`)
would kill the process with SIGBUS at the first read past its new end. The map comes from
`_mapping` (compiled beside this module), where such a read gets zeros and marks the map
`truncated`; the Reader then refuses the data (`Reader.check_maps`, `files_changed`).

The format (LMDB 0.9, 64-bit, little-endian): every page starts with a 16-byte header —
page number (u64), pad (u16), flags (u16), then the bounds of the page's free space (lower,
upper: u16 each) or, on the first of a run of overflow pages, the run's length (u32).
Pages 0 and 1 are meta pages; the one with the larger transaction id is current and names
the main database's root page, depth and page counts. A branch or leaf page holds, after its
header, one u16 offset per node; a node is lo, hi, flags, key size (u16 each), the key, then
the value — inline, or (F_BIGDATA) the number of the first overflow page holding it. A
branch node's child is page lo | hi << 16 | flags << 32; its key 0 stands for "anything
smaller". Keys sort as bytes (memcmp, then shorter first), as Python compares bytes.

Tested by: tests/datastore/test_corrupt.py, tests/datastore/test_fuzz.py,
tests/datastore/test_mapping.py
"""

from __future__ import annotations

import mmap
import os
import struct
from bisect import bisect_left

from redraft.proto.errors import DatastoreCorrupt

try:  # a map whose truncation under the reader reads as zeros instead of killing it (SIGBUS)
    from redraft.datastore._mapping import Map, faults
except ImportError:  # not built: plain mmap, and a file truncated while mapped is fatal
    Map = None

    def faults() -> int:
        return 0

MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
PAGE_HEADER = 16
NODE_HEADER = 8
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
_KINDS = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP
F_BIGDATA = 0x01
P_INVALID = (1 << 64) - 1  # root of an empty database
MAX_DEPTH = 32  # LMDB's cursor stack: no tree it writes is deeper
_ORDER_FLAGS = 0x7E  # reverse keys, dupsort, integer keys...: layouts a datastore never uses
_META = struct.Struct("<II8xQ" + "IHHQQQQQ" * 2 + "QQ")  # after the page header
_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")
_NODE = struct.Struct("<HHHH")
_PAGE = struct.Struct("<Q2xHHH")  # page number, flags, lower, upper


class LmdbFile:
    """A read-only, bounds-checked view of one LMDB file's main database."""

    def __init__(self, file: str) -> None:
        self.file = file
        fd = os.open(file, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.ident = (st.st_dev, st.st_ino)
            self.size = st.st_size
            self._written = (st.st_size, st.st_mtime_ns)  # what changed() compares
            if self.size < PAGE_HEADER + _META.size:
                raise self._bad(f"not an LMDB file ({self.size} bytes)")
            # slices of either are bytes
            self.mm = Map(fd) if Map is not None else mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.view = memoryview(self.mm)  # slices of it are zero-copy views
        try:
            self._read_meta()
        except BaseException:
            self.close()
            raise

    # ---- meta ---------------------------------------------------------------------------
    def _bad(self, what: str) -> DatastoreCorrupt:
        return DatastoreCorrupt(f"{self.file}: damaged LMDB structure: {what}")

    def _meta(self, n: int, off: int) -> tuple:
        if off + PAGE_HEADER + _META.size > self.size:
            raise self._bad(f"meta page {n} lies past the end of the file")
        flags = _U16.unpack_from(self.mm, off + 10)[0]
        f = _META.unpack_from(self.mm, off + PAGE_HEADER)
        if not flags & P_META or f[0] != MDB_MAGIC:
            raise DatastoreCorrupt(f"{self.file}: not an LMDB file (meta page {n} is damaged)")
        if f[1] != MDB_DATA_VERSION:
            raise self._bad(f"LMDB data version {f[1]} on meta page {n}")
        return f

    def _read_meta(self) -> None:
        m0 = self._meta(0, 0)
        psize = m0[3]  # the free database's pad field holds the page size
        if psize < 512 or psize > 65536 or psize & (psize - 1):
            raise self._bad(f"page size {psize}")
        m1 = self._meta(1, psize)
        if m1[3] != psize:
            raise self._bad("the two meta pages disagree on the page size")
        m = m1 if m1[-1] > m0[-1] else m0  # LMDB's rule: the newer transaction wins
        self.psize = psize
        self.last_pg = m[-2]
        self.txnid = m[-1]
        (_, flags, depth, self.branch_pages, self.leaf_pages, self.overflow_pages,
         self.entries, self.root) = m[11:19]
        self.depth = depth
        need = (self.last_pg + 1) * psize
        if self.last_pg < 1 or need > self.size:
            raise DatastoreCorrupt(
                f"{self.file}: truncated ({self.size} bytes, the index needs {need})")
        if flags & _ORDER_FLAGS:
            raise self._bad(f"main database flags {flags:#x}")
        if self.root != P_INVALID and not 1 <= depth <= MAX_DEPTH:
            raise self._bad(f"tree depth {depth}")

    # ---- pages and nodes ----------------------------------------------------------------
    def _page(self, pgno: int, kind: int) -> tuple[int, int, int]:
        """(file offset, node count, upper) of branch/leaf page `pgno`, all checked."""
        if not 2 <= pgno <= self.last_pg:
            raise self._bad(f"page number {pgno} outside the file")
        off = pgno * self.psize
        stored, flags, lower, upper = _PAGE.unpack_from(self.mm, off)
        if stored != pgno:
            raise self._bad(f"page {pgno} is labelled {stored}")
        if flags & _KINDS != kind:
            raise self._bad(f"page {pgno} has flags {flags:#x}, expected {kind:#x}")
        if not PAGE_HEADER <= lower <= upper <= self.psize or (lower - PAGE_HEADER) % 2:
            raise self._bad(f"page {pgno} has free-space bounds {lower}..{upper}")
        return off, (lower - PAGE_HEADER) // 2, upper

    def _node(self, off: int, upper: int, i: int) -> tuple[int, int, int, int]:
        """(node offset in the file, lo | hi << 16, flags, key size) of node i, checked."""
        ptr = _U16.unpack_from(self.mm, off + PAGE_HEADER + 2 * i)[0]
        if ptr < upper or ptr + NODE_HEADER > self.psize:
            raise self._bad(f"node {i} of page {off // self.psize} at offset {ptr}")
        lo, hi, flags, ksize = _NODE.unpack_from(self.mm, off + ptr)
        if ptr + NODE_HEADER + ksize > self.psize:
            raise self._bad(f"node {i} of page {off // self.psize}: key of {ksize} bytes")
        return off + ptr, lo | hi << 16, flags, ksize

    def _key(self, off: int, upper: int, i: int) -> bytes:
        node, _, _, ksize = self._node(off, upper, i)
        return self.mm[node + NODE_HEADER:node + NODE_HEADER + ksize]

    def _child(self, off: int, upper: int, i: int) -> int:
        node, lohi, flags, _ = self._node(off, upper, i)
        return lohi | flags << 32

    def _value(self, off: int, upper: int, i: int) -> tuple[int, int, int]:
        """(offset, length, overflow pages or 0) of leaf node i's value, checked."""
        node, size, flags, ksize = self._node(off, upper, i)
        data = node + NODE_HEADER + ksize
        end_of_page = off + self.psize
        if not flags & F_BIGDATA:
            if flags or data + size > end_of_page:
                raise self._bad(f"value of node {i} on page {off // self.psize}")
            return data, size, 0
        if flags != F_BIGDATA or data + 8 > end_of_page:
            raise self._bad(f"value of node {i} on page {off // self.psize}")
        first, pages = self._overflow(_U64.unpack_from(self.mm, data)[0], size)
        return first + PAGE_HEADER, size, pages

    def _overflow(self, pgno: int, size: int) -> tuple[int, int]:
        """(file offset, page count) of the overflow run holding a `size`-byte value."""
        if not 2 <= pgno <= self.last_pg:
            raise self._bad(f"overflow page number {pgno} outside the file")
        off = pgno * self.psize
        stored, _, flags, pages = struct.unpack_from("<QHHI", self.mm, off)
        if stored != pgno or flags & _KINDS != P_OVERFLOW:
            raise self._bad(f"page {pgno} is not the overflow page it should be")
        if pages * self.psize < PAGE_HEADER + size or pgno + pages - 1 > self.last_pg:
            raise self._bad(f"overflow run of {pages} pages at page {pgno} "
                            f"for a value of {size} bytes")
        return off, pages

    def _search(self, off: int, upper: int, n: int, key: bytes, lo: int) -> int:
        """First node index in [lo, n) whose key is >= key (binary search, keys checked)."""
        return bisect_left(range(n), key, lo, n, key=lambda i: self._key(off, upper, i))

    # ---- public -------------------------------------------------------------------------
    def locate(self, key: bytes) -> tuple[int, int] | None:
        """(offset, length) of the value of `key` in the file, or None if there is none."""
        pgno = self.root
        if pgno == P_INVALID:
            return None
        for _level in range(self.depth):
            kind = P_LEAF if _level == self.depth - 1 else P_BRANCH
            off, n, upper = self._page(pgno, kind)
            if kind == P_LEAF:
                i = self._search(off, upper, n, key, 0)
                if i < n and self._key(off, upper, i) == key:
                    return self._value(off, upper, i)[:2]
                return None
            if n < 1:
                raise self._bad(f"branch page {pgno} is empty")
            i = self._search(off, upper, n, key, 1)
            if i == n or self._key(off, upper, i) != key:
                i -= 1  # the last child whose first key is below `key`
            pgno = self._child(off, upper, i)
        raise self._bad("empty tree of non-zero depth")

    def get(self, key: bytes) -> memoryview | None:
        """The value of `key` as a view of the map (valid until close), or None."""
        where = self.locate(key)
        return None if where is None else self.view[where[0]:where[0] + where[1]]

    def check(self) -> None:
        """Walk the whole main database: every page inside the file and used once, keys in
        order within their parents' bounds, every leaf at the recorded depth, overflow runs
        disjoint, and the page and entry counts of the meta page exact."""
        if self.root == P_INVALID:
            if self.entries or self.branch_pages or self.leaf_pages or self.overflow_pages:
                raise self._bad("an empty database with non-zero counts")
            return
        seen: set[int] = set()
        runs: list[tuple[int, int]] = []
        counts = {P_BRANCH: 0, P_LEAF: 0}
        entries = 0
        stack: list[tuple[int, int, bytes | None, bytes | None]] = [(self.root, 1, None, None)]
        while stack:
            pgno, level, lo_key, hi_key = stack.pop()
            if pgno in seen:
                raise self._bad(f"page {pgno} is used twice")
            seen.add(pgno)
            kind = P_LEAF if level == self.depth else P_BRANCH
            off, n, upper = self._page(pgno, kind)
            counts[kind] += 1
            keys = [self._key(off, upper, i) for i in range(n)]
            if kind == P_BRANCH:
                if n < 1:
                    raise self._bad(f"branch page {pgno} is empty")
                keys[0] = lo_key  # key 0 of a branch page is implicit
            inner = keys[1:] if kind == P_BRANCH else keys
            if any(a >= b for a, b in zip(inner, inner[1:])) or (inner and (
                    (lo_key is not None and inner[0] < lo_key)
                    or (hi_key is not None and inner[-1] >= hi_key))):
                raise self._bad(f"keys out of order on page {pgno}")
            if kind == P_LEAF:
                entries += n
                for i in range(n):
                    data, _, pages = self._value(off, upper, i)
                    if pages:
                        runs.append(((data - PAGE_HEADER) // self.psize, pages))
                continue
            for i in range(n):
                hi = keys[i + 1] if i + 1 < n else hi_key
                stack.append((self._child(off, upper, i), level + 1, keys[i], hi))
        runs.sort()
        tree = sorted(seen)
        for (a, na), (b, _) in zip(runs, runs[1:]):
            if a + na > b:
                raise self._bad(f"overflow runs at pages {a} and {b} overlap")
        for a, na in runs:
            j = bisect_left(tree, a)
            if j < len(tree) and tree[j] < a + na:
                raise self._bad(f"overflow run at page {a} overlaps page {tree[j]}")
        got = (counts[P_BRANCH], counts[P_LEAF], sum(n for _, n in runs), entries)
        want = (self.branch_pages, self.leaf_pages, self.overflow_pages, self.entries)
        if got != want:
            raise self._bad(f"the meta page counts (branch, leaf, overflow pages, entries) "
                            f"{want}, the tree holds {got}")

    @property
    def truncated(self) -> bool:
        """Whether a read of the map met a page past the file's end (the file was truncated
        after it was mapped): that read, and every later one there, saw zeros."""
        return bool(getattr(self.mm, "truncated", False))

    def changed(self) -> str | None:
        """Why the mapped file is no longer the one opened (None: it is): truncated under
        the map, or rewritten in place (another size or modification time, same inode). A
        file replaced by rename or unlinked is no change: the map keeps the old inode."""
        if self.truncated:
            return f"{self.file}: truncated while mapped (rewritten in place?)"
        try:
            st = os.stat(self.file)
        except OSError:
            return None
        if (st.st_dev, st.st_ino) == self.ident and (st.st_size, st.st_mtime_ns) != \
                self._written:
            return f"{self.file}: rewritten in place while mapped"
        return None

    def __enter__(self) -> LmdbFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the map (a view still exported elsewhere keeps it until that view goes)."""
        view, self.view = self.view, memoryview(b"")
        try:
            view.release()
            self.mm.close()
        except BufferError:
            pass
