"""Shared fixtures: a brute-force reference of every Reader verb, and small datastores."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from redraft.datastore import build_datastore
from redraft.datastore import format as fmt
from redraft.datastore import manifest as mf
from redraft.datastore.lmdbfile import LmdbFile

MASS = 1 << 40  # the Reader's integer weight budget per tree


class Ref:
    """The datastore's semantics, computed the slow and obvious way over plain lists."""

    def __init__(self, docs, deleted=(), corpus_of=None, shard_docs=None, sep=None):
        self.docs = [list(map(int, d)) for d in docs]
        self.deleted = set(deleted)
        self.corpus_of = corpus_of or ["default"] * len(self.docs)
        # shard_docs: list of lists of global doc ids per shard (for suffix-array order)
        self.shard_docs = shard_docs or [list(range(len(self.docs)))]
        self.sep = 1 << 40 if sep is None else sep  # sorts after every token, like the real one
        self._sorted: dict[int, tuple] = {}

    def live(self, corpora=None):
        for i, d in enumerate(self.docs):
            if i in self.deleted or (corpora and self.corpus_of[i] not in corpora):
                continue
            yield i, d

    def occurrences(self, pat, corpora=None):
        pat = list(pat)
        n = len(pat)
        return [(i, o) for i, d in self.live(corpora) for o in range(len(d) - n + 1)
                if d[o:o + n] == pat]

    def count(self, pat, corpora=None):
        return len(self.occurrences(pat, corpora))

    def next_counts(self, pat, corpora=None):
        n = len(pat)
        return dict(Counter(self.docs[i][o + n] for i, o in self.occurrences(pat, corpora)
                            if o + n < len(self.docs[i])))

    def longest(self, ctx, max_len=16, min_len=1, corpora=None):
        ctx = list(ctx)[-max_len:]
        for L in range(len(ctx), min_len - 1, -1):
            if self.count(ctx[len(ctx) - L:], corpora):
                return L
        return 0

    def sa_order(self, pat, corpora=None):
        """Occurrences of pat in suffix-array order, shard by shard (live docs only)."""
        out = []
        n = len(pat)
        for s, ids in enumerate(self.shard_docs):
            if s not in self._sorted:
                arr, where = [], []
                for g in ids:
                    for o, t in enumerate(self.docs[g]):
                        arr.append(t)
                        where.append((g, o))
                    arr.append(self.sep)
                    where.append(None)
                self._sorted[s] = (arr, where, sorted(range(len(arr)), key=lambda p: arr[p:]))
            arr, where, sufs = self._sorted[s]
            for p in sufs:
                if where[p] is None or arr[p:p + n] != list(pat):
                    continue
                g, o = where[p]
                if g in self.deleted or (corpora and self.corpus_of[g] not in corpora):
                    continue
                out.append((g, o))
        return out

    def tree_masses(self, rows, weights):
        """Path -> share of total weight over sampled continuation rows."""
        acc: Counter = Counter()
        for row, w in zip(rows, weights):
            for d in range(1, len(row) + 1):
                acc[tuple(row[:d])] += w
        total = sum(weights)
        return {p: m / total for p, m in acc.items()}

    def continuation(self, occ, L, depth):
        g, o = occ
        return self.docs[g][o + L:o + L + depth]

    def propose_masses(self, ctx, *, max_depth=16, max_match_len=16, min_match_len=2,
                       max_occurrences=256, min_support=4, corpora=None):
        """Expected path probabilities of Reader.propose (all nodes, before the budget)."""
        ctx = list(ctx)[-max_match_len:]
        L = self.longest(ctx, len(ctx), min_match_len, corpora)
        if L == 0:
            return 0, {}
        levels = [L]
        n1 = self.count(ctx[len(ctx) - L:], corpora)
        if n1 < min_support and L > min_match_len:
            for L2 in range(L - 1, min_match_len - 1, -1):
                if self.count(ctx[len(ctx) - L2:], corpora) >= min_support or L2 == min_match_len:
                    levels.append(L2)
                    break
        lam = n1 / (n1 + 1.0) if len(levels) > 1 else 1.0
        rows, weights = [], []
        for n, lv in enumerate(levels):
            occ = self.occurrences(ctx[len(ctx) - lv:], corpora)
            if len(occ) > max_occurrences:  # which ones are sampled depends on SA order
                occ = self.sa_order(ctx[len(ctx) - lv:], corpora)
            k = min(len(occ), max_occurrences)
            picks = [occ[(i * len(occ)) // k] for i in range(k)]
            share = lam if n == 0 else 1.0 - lam
            w = max(1, int(MASS * share) // k) if len(levels) > 1 else 1
            for p in picks:
                rows.append(self.continuation(p, lv, max_depth))
                weights.append(w)
        return L, self.tree_masses(rows, weights)


def draft_paths(d) -> dict[tuple, float]:
    """Path (tuple of tokens from the root) -> path probability of every node of a Tree."""
    paths: list[tuple] = []
    out = {}
    for t, p, pp in zip(d.tokens, d.parents, d.path_probs()):
        path = (paths[p] if p >= 0 else ()) + (t,)
        paths.append(path)
        out[path] = pp
    return out


def random_docs(rng, n_docs, vocab, max_len=60, alphabet=None):
    alphabet = np.arange(vocab) if alphabet is None else np.asarray(alphabet)
    return [rng.choice(alphabet, size=int(rng.integers(1, max_len))).tolist()
            for _ in range(n_docs)]


@pytest.fixture
def make_store(tmp_path):
    """Build a datastore from pre-tokenized docs: make_store(docs, vocab=..., **kw) -> path."""
    counter = iter(range(1000))

    def make(docs, vocab=8, name=None, **kw):
        out = tmp_path / (name or f"ds{next(counter)}")
        build_datastore(None, out, documents=docs, fingerprint=f"test-vocab-{vocab}",
                        vocab_size=vocab, **kw)
        return out

    return make


def compare_tree(d, L, want, budget):
    """A retrieval tree against the reference's path masses: the best `budget` of them."""
    d.validate()
    assert d.match_len == L
    assert set(d.sources) <= {"rest"}
    got = draft_paths(d)
    assert len(d) == min(budget, len(want))
    for path, p in got.items():
        assert path in want, path
        assert p == pytest.approx(want[path], rel=1e-9, abs=1e-12), path
    # the chosen nodes are the best ones: their scores are the top of the reference's
    top = sorted(want.values(), reverse=True)[:len(d)]
    assert sorted(got.values(), reverse=True) == pytest.approx(top, rel=1e-9, abs=1e-12)
    # best first: path probabilities never increase along the output order
    pp = d.path_probs()
    assert all(a >= b - 1e-12 for a, b in zip(pp, pp[1:]))


@pytest.fixture
def helpers():
    return SimpleNamespace(Ref=Ref, draft_paths=draft_paths, random_docs=random_docs, MASS=MASS,
                           compare_tree=compare_tree)


# ---- the files of a datastore directory ------------------------------------------------
def segment_files(store) -> list[Path]:
    """The segment files the current manifest names, in document order."""
    m = json.loads((Path(store) / mf.MANIFEST_FILE).read_text())
    return [Path(store) / s["file"] for s in m["segments"]]


def only_segment(store) -> Path:
    (seg,) = segment_files(store)
    return seg


def directory_bytes(store) -> dict[str, bytes]:
    """Every file of the directory (the lock file aside) and its bytes: "nothing changed"."""
    return {f: (Path(store) / f).read_bytes() for f in sorted(os.listdir(store))
            if f != fmt.WRITE_LOCK}


def resync(store) -> None:
    """After a segment was edited in place, make manifest.json name it as it now is (size,
    crc32 of its own manifest): damage the commit point cannot see, for the per-segment
    checks to find."""
    path = Path(store) / mf.MANIFEST_FILE
    m = json.loads(path.read_text())
    for s in m["segments"]:
        f = Path(store) / s["file"]
        s["bytes"] = f.stat().st_size
        with LmdbFile(str(f)) as lm:
            raw = lm.get(fmt.KEY_MANIFEST)
            if raw is not None:
                s["crc32"] = fmt.crc32(raw)
    path.write_bytes(mf.encode(m))


def as_legacy(store) -> Path:
    """Turn a one-segment datastore into the single-file layout of format 2 (what redraft
    wrote before segments); returns its file."""
    seg = only_segment(store)
    os.replace(seg, Path(store) / fmt.DATA_FILE)
    (Path(store) / mf.MANIFEST_FILE).unlink()
    return Path(store) / fmt.DATA_FILE


@pytest.fixture
def files():
    return SimpleNamespace(segment_files=segment_files, only_segment=only_segment,
                           directory_bytes=directory_bytes, resync=resync, as_legacy=as_legacy)


@pytest.fixture
def core_only_damage(tmp_path):
    """A datastore with one id past the vocabulary (517 of 512) written into its token
    array, where the compiled core's retrieval reads it on a session over document 6 (from
    about its 26th token on) and the Python reference's lookup of the same context does
    not: (path, docs, 6). Found by a fuzzer; such damage is what the background check
    finds, but a step may read it first."""
    import random

    rng = random.Random(317)
    docs = [[rng.randrange(1, 12) for _ in range(200)] for _ in range(30)]
    path = tmp_path / "damaged"
    build_datastore(None, path, documents=docs, fingerprint="sha256:core-only-damage",
                    vocab_size=512)
    seg = only_segment(path)
    with LmdbFile(str(seg)) as lm:
        off = lm.locate(fmt.shard_key(0, "tokens"))[0]
    with open(seg, "r+b") as f:
        f.seek(off + 2 * 5657)  # a token of document 28
        f.write(b"\x02\x05")
    return str(path), docs, 6
