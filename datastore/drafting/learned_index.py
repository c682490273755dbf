"""Learned drafts: an in-memory suffix index over the outputs already generated.

Why: a corpus indexed offline knows nothing of what this model is saying now, and prompt
lookup only sees the current generation. Workloads that answer the same prompt many times
(best-of-N, self-consistency, reinforcement-learning rollouts) or repeat themselves (agents
calling the same tools) keep producing text they produced before; drafting from earlier
outputs turns that into accepted tokens.

Each generation's output is one document: the last `PROMPT_TAIL` tokens of its prompt (so
the start of an answer is found from the question it answers), then every token the decoder
accepted, appended as soon as it is accepted. An n-gram index maps each `LEVELS`-gram that
ends at a position to its most recent `KEEP` positions; a lookup finds the context's suffix
there, measures each occurrence's match (up to `MAX_MATCH` tokens) and merges the best
occurrences' continuations into one trie with prompt lookup's tree builder, labelled
`learned`.

Documents live in pools: one per tenant, so that text one tenant generated is never drafted
for another (`shared=True` puts every tenant in one pool). Memory is bounded by `max_tokens`:
whole documents are evicted oldest first, their index entries with them, and a pool left
without documents is dropped (memory stays bounded in the number of tenants too). All
methods are thread-safe.

A `journal` sees every output as it is written (the draft service logs them there, for its
other processes and for persisting); the index itself keeps nothing on disk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate
from typing import Protocol

from redraft.datastore.drafting.prompt_lookup import continuation_tree
from redraft.proto.tree import LEARNED, Tree

PROMPT_TAIL = 16  # prompt tokens stored in front of each output
LEVELS = (4, 2)  # n-gram lengths indexed, longest first (`_key` packs exactly these)
KEEP = 16  # positions kept per n-gram (the most recent; a lookup scans no more)
MAX_MATCH = 32  # longest match measured
MAX_OCCURRENCES = 8  # occurrences merged into one tree
_POS_BITS = 24  # an index entry is doc_id << _POS_BITS | position
_POS_MASK = (1 << _POS_BITS) - 1
MAX_DOC_TOKENS = _POS_MASK  # a longer output stops being recorded


def _ending_keys(tokens: Sequence[int], end: int) -> Iterator[int]:
    """The keys of the indexed n-grams ending at `end` (those with n tokens up to it)."""
    for n in LEVELS:
        if end + 1 >= n:
            yield _key(tokens, end, n)


def _key(tokens: Sequence[int], end: int, n: int) -> int:
    """The n tokens ending at `end` packed into one int (exact for ids below 2^21; a larger
    id can collide, which only proposes a candidate: every match is checked on the tokens)."""
    if n == 2:
        return tokens[end - 1] << 21 | tokens[end]
    return ((tokens[end - 3] << 21 | tokens[end - 2]) << 21 | tokens[end - 1]) << 21 | tokens[end]


class OutputJournal(Protocol):
    """Where writers also record their outputs, in the order they are written."""

    def begin(self, tenant: str) -> object:
        """A new output of `tenant`; returns its handle for `append` and `end`."""

    def append(self, output: object, tokens: Sequence[int]) -> None:
        """Tokens added to the output (the first call carries its prompt tail)."""

    def end(self, output: object) -> None:
        """The output is final."""


class JournaledOutput:
    """One writer's output as its journal sees it: begun by its first accepted tokens (the
    prompt tail in front of them), appended to, ended once. Shared by every writer kind, so
    what a journal receives never depends on which index recorded the output."""

    __slots__ = ("journal", "tenant", "head", "output")

    def __init__(self, journal: OutputJournal, tenant: str, head: Sequence[int]) -> None:
        self.journal = journal
        self.tenant = tenant
        self.head = head
        self.output: object | None = None  # the journal's handle, once begun

    def record(self, tokens: Sequence[int]) -> None:
        """Tokens just added to the output (none: nothing happens)."""
        if not len(tokens):
            return
        if self.output is None:
            self.output = self.journal.begin(self.tenant)
            self.journal.append(self.output, [*self.head, *tokens])
        else:
            self.journal.append(self.output, tokens)

    @staticmethod
    def record_all(items: Iterable[tuple[JournaledOutput, Sequence[int]]]) -> None:
        """record() of many outputs (a batched step's). The appends of outputs already begun
        go to their journal in one `append_all((output, tokens), ...)` call where the journal
        has one (one lock per step, not one per sequence); the rest one by one, in order."""
        batches: dict[int, tuple[OutputJournal, list]] = {}
        for journaled, tokens in items:
            output = journaled.output
            if output is None:
                journaled.record(tokens)
                continue
            journal = journaled.journal
            batch = batches.get(id(journal))
            if batch is None:
                if not hasattr(journal, "append_all"):
                    journaled.record(tokens)
                    continue
                batch = batches[id(journal)] = (journal, [])
            if len(tokens):
                batch[1].append((output, tokens))
        for journal, pairs in batches.values():
            journal.append_all(pairs)

    @staticmethod
    def record_flat(journaled: Sequence[JournaledOutput | None], tokens: list[int],
                    counts: list[int]) -> None:
        """record_all() with the tokens concatenated: outputs[i] (None: not journaled) got
        the next counts[i] of `tokens` (a batched step's packed tokens)."""
        JournaledOutput.record_all(
            (j, tokens[end - c:end]) for j, c, end in zip(journaled, counts, accumulate(counts))
            if j is not None and c)

    def end(self) -> None:
        output, self.output = self.output, None
        if output is not None:
            self.journal.end(output)


class _Doc:
    """One generation's output in the index."""

    __slots__ = ("id", "pool_name", "pool", "tokens")

    def __init__(self, doc_id: int, pool_name: str, pool: dict, tokens: list[int]) -> None:
        self.id = doc_id
        self.pool_name = pool_name
        self.pool = pool  # this doc's n-gram index: key -> positions (entries)
        self.tokens = tokens


class LearnedIndex:
    """Outputs of many generations, indexed for drafting; bounded to `max_tokens` tokens."""

    def __init__(self, max_tokens: int = 1_000_000, shared: bool = False,
                 journal: OutputJournal | None = None) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.shared = shared
        self.journal = journal
        self.n_tokens = 0
        self._docs: OrderedDict[int, _Doc] = OrderedDict()  # oldest first
        self._pools: dict[str, dict[int, int | list[int]]] = {}  # key -> entry or entries
        self._pool_docs: dict[str, int] = {}  # documents per pool: 0 drops the pool
        self._next_id = 0
        self._lock = threading.Lock()

    # ---- writing ------------------------------------------------------------------------
    def writer(self, tenant: str, prompt: Sequence[int], journal: bool = True
               ) -> LearnedWriter:
        """A handle that records one generation's accepted tokens for `tenant` (and in the
        journal, unless `journal` is False: outputs replayed from elsewhere)."""
        return LearnedWriter(self, tenant, list(prompt[-PROMPT_TAIL:]),
                             self.journal if journal else None)

    def _new_doc(self, tenant: str, head: list[int]) -> _Doc:
        name = "" if self.shared else tenant
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = {}
        self._pool_docs[name] = self._pool_docs.get(name, 0) + 1
        doc = _Doc(self._next_id, name, pool, [])
        self._next_id += 1
        self._docs[doc.id] = doc
        self._append(doc, head)
        return doc

    def _append(self, doc: _Doc, tokens: Iterable[int]) -> None:
        toks, pool, base = doc.tokens, doc.pool, doc.id << _POS_BITS
        for t in tokens:
            if len(toks) >= MAX_DOC_TOKENS:
                break
            toks.append(int(t))
            end = len(toks) - 1
            for key in _ending_keys(toks, end):
                # an int until the n-gram repeats, then a list (see PromptLookup.extend)
                positions = pool.get(key)
                if positions is None:
                    pool[key] = base | end
                elif type(positions) is int:
                    pool[key] = [positions, base | end]
                else:
                    positions.append(base | end)
                    if len(positions) > KEEP:
                        del positions[0]
            self.n_tokens += 1

    def _evict(self, keep: _Doc | None) -> None:
        """Drop the oldest documents until the bound holds (never `keep`, the one being
        written, unless it alone is over the bound)."""
        while self.n_tokens > self.max_tokens and self._docs:
            doc = next(iter(self._docs.values()))
            if doc is keep and len(self._docs) > 1:
                self._docs.move_to_end(doc.id)
                continue
            self._drop(doc)

    def _drop(self, doc: _Doc) -> None:
        del self._docs[doc.id]
        self.n_tokens -= len(doc.tokens)
        toks, pool, base = doc.tokens, doc.pool, doc.id << _POS_BITS
        for end in range(len(toks)):
            for key in _ending_keys(toks, end):
                positions = pool.get(key)
                if positions is None:
                    continue
                if type(positions) is int:
                    if positions == base | end:
                        del pool[key]
                    continue
                try:
                    positions.remove(base | end)
                except ValueError:  # already pushed out by newer positions
                    continue
                if not positions:
                    del pool[key]
        doc.tokens = toks[-PROMPT_TAIL:]  # what a writer still on this output continues from
        left = self._pool_docs[doc.pool_name] - 1
        if left:
            self._pool_docs[doc.pool_name] = left
        else:  # the tenant's last document: its pool goes too
            del self._pool_docs[doc.pool_name]
            if self._pools.get(doc.pool_name) is doc.pool:
                del self._pools[doc.pool_name]

    # ---- drafting -----------------------------------------------------------------------
    def propose(self, tenant: str, context: Sequence[int], budget: int, max_depth: int
                ) -> Tree:
        """A tree continuing `context` from the outputs of `tenant`'s pool."""
        if budget <= 0 or max_depth <= 0 or len(context) < LEVELS[-1]:
            return Tree()
        max_depth = min(max_depth, budget)
        ctx = list(context[-MAX_MATCH:])
        n = len(ctx)
        with self._lock:
            pool = self._pools.get("" if self.shared else tenant)
            if not pool:
                return Tree()
            docs = self._docs
            found: dict[int, tuple[int, _Doc, int]] = {}
            for level in LEVELS:
                if n < level or found:  # a shorter n-gram only when the longer found nothing
                    continue
                entries = pool.get(_key(ctx, n - 1, level), ())
                for entry in reversed((entries,) if type(entries) is int else entries):
                    if entry in found:
                        continue
                    doc = docs.get(entry >> _POS_BITS)
                    end = entry & _POS_MASK
                    if doc is None or end + 1 >= len(doc.tokens):
                        continue  # evicted, or nothing follows yet
                    m = _match_len(doc.tokens, end, ctx, level)
                    if m:
                        found[entry] = (m, doc, end)
            if not found:
                return Tree()
            best = sorted(found.items(), key=lambda kv: (-kv[1][0], -kv[0]))[:MAX_OCCURRENCES]
            continuations = [(doc.tokens[end + 1 : end + 1 + max_depth], m)
                             for _, (m, doc, end) in best]
        return continuation_tree(continuations, budget, LEARNED)

    # ---- loading ------------------------------------------------------------------------
    def load(self, documents: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Add finished documents (tenant, tokens), oldest first (outputs persisted earlier:
        not journaled again)."""
        with self._lock:
            for tenant, tokens in documents:
                self._new_doc(tenant, list(tokens))
            self._evict(None)

    def stats(self) -> dict:
        with self._lock:
            return {"learned_tokens": self.n_tokens, "learned_docs": len(self._docs),
                    "learned_max_tokens": self.max_tokens, "learned_pools": len(self._pools)}


def _match_len(doc_tokens: list[int], end: int, ctx: list[int], level: int) -> int:
    """How many tokens before and at `end` equal the context's last ones: 0 if fewer than
    `level` (a hash collision), else `level` doubled while whole slices still agree (a lower
    bound of the true length, found with a few slice comparisons instead of a loop)."""
    n = len(ctx)
    if end + 1 < level or doc_tokens[end + 1 - level : end + 1] != ctx[n - level :]:
        return 0
    m = level
    while m < n and m < end + 1:
        m2 = min(2 * m, n, end + 1)
        if doc_tokens[end + 1 - m2 : end + 1] != ctx[n - m2 :]:
            break
        m = m2
    return m


class LearnedWriter:
    """Records one generation's accepted tokens; the document is created by the first
    accepted token (a generation that produced nothing leaves nothing, in the journal too)."""

    def __init__(self, index: LearnedIndex, tenant: str, head: list[int],
                 journal: OutputJournal | None = None) -> None:
        self.index = index
        self.tenant = tenant
        self._head = head
        self._doc: _Doc | None = None
        self._journaled = JournaledOutput(journal, tenant, head) if journal is not None \
            else None

    def extend(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        index = self.index
        with index._lock:
            doc = self._doc
            if doc is None or doc.id not in index._docs:  # new, or evicted meanwhile
                head = self._head if doc is None else doc.tokens[-PROMPT_TAIL:]
                doc = self._doc = index._new_doc(self.tenant, head)
            index._append(doc, tokens)
            index._evict(doc)
        if self._journaled is not None:
            self._journaled.record(tokens)

    def close(self) -> None:
        """The generation ended: its output is final."""
        self._doc = None
        if self._journaled is not None:
            self._journaled.end()
