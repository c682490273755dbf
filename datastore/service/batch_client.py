"""An engine's sequences drafted by the service with one batched call per engine step.

Why a tracker over `DraftClient.batch`: engines hand their drafter every running sequence's
whole context each step (vLLM's `token_ids_cpu` rows, SGLang's request ids and token lists),
reorder rows without notice and never say when a request ended. `SequenceBatch.draft` takes
exactly that, {key: whole context}, and sends the server only what it has not seen of each
sequence (an open with the prompt the first time, the new tokens afterwards); a sequence the
server lost (swept after idling, restarted, failed over to another replica) is opened again
with its whole context within the same `draft`. What the server learns is each sequence's
output, for its tenant, as with sessions.

    batch = SequenceBatch(client, DraftParams(budget=64), fingerprint, chain=5)
    drafts = batch.draft({req_id: token_ids for req_id, token_ids in rows})
    drafts[req_id].tokens            # the chain (or the tree) for that sequence
    batch.end(finished_ids)          # or let the server sweep them when idle
    batch.send({req_id: token_ids})  # a step that wants no drafts: learned, not waited for

Tested by: tests/datastore/service/test_batch_rpc.py
"""

from __future__ import annotations

import secrets
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

import grpc
from redraft.datastore.service.client import DraftClient
from redraft.datastore.service.client_errors import (
    ServiceError,
    ServiceUnavailable,
    UnknownSequence,
    error_for,
)
from redraft.datastore.service.refusals import over_context
from redraft.datastore.service.wire import (
    BatchResults,
    DraftParams,
    PackedSteps,
    SequenceEnd,
    SequenceOpen,
)
from redraft.proto.tree import Tree

# Entry failures that the same context would meet again: the sequence is not sent again
# until its key is ended (anything else is tried afresh, with an open, at the next draft).
_STICKY = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


class SequenceDrafts(Mapping):
    """The trees of one `draft` call by key (a tree is built when first looked up; `results`
    holds them all as arrays). A key that failed maps to an empty tree; why is in
    `errors`."""

    def __init__(self, results: BatchResults | None, index: dict[Hashable, int],
                 errors: dict[Hashable, ServiceError]) -> None:
        self.results = results
        self.index = index
        self.errors = errors
        self._trees: dict[Hashable, Tree] = {}

    def __getitem__(self, key: Hashable) -> Tree:
        tree = self._trees.get(key)
        if tree is None:
            i = self.index.get(key)
            if i is None:
                if key in self.errors:
                    return Tree()
                raise KeyError(key)
            tree = self._trees[key] = self.results.tree(i)
        return tree

    def __iter__(self) -> Iterator[Hashable]:
        yield from self.index
        yield from (k for k in self.errors if k not in self.index)

    def __len__(self) -> int:
        return len(self.index) + sum(1 for k in self.errors if k not in self.index)


class SequenceBatch:
    """An engine's sequences on the draft service (module docstring). Not thread-safe: one
    engine loop calls it."""

    def __init__(self, client: DraftClient, params: DraftParams | None = None,
                 tokenizer_fingerprint: str = "", tenant: str = "", chain: int = 0,
                 timeout: float | None = None) -> None:
        self.client = client
        self.params = params or DraftParams()
        self.fingerprint = tokenizer_fingerprint
        self.tenant = tenant
        self.chain = chain
        self.timeout = timeout
        self.client_id = secrets.token_hex(8)  # this batch's namespace on the server
        self.reopened = 0  # sequences opened again after the server lost them
        self._held: dict[Hashable, tuple[int, int]] = {}  # key -> (tokens held, last one)
        self._failed: dict[Hashable, ServiceError] = {}  # sticky failures, until ended
        self._ids: dict[Hashable, str] = {}  # key -> its sequence id on the wire
        self._keys: dict[str, Hashable] = {}
        self._next_id = 0
        self._max_context: int | None = None
        self._sent = None  # a `send` not settled yet: (results, opens, steps, contexts, first)

    def __len__(self) -> int:
        """Sequences the server holds for this batch (as far as it knows)."""
        return len(self._held)

    def draft(self, contexts: Mapping[Hashable, Sequence[int]],
              budgets: Mapping[Hashable, int] | None = None,
              end: Iterable[Hashable] = ()) -> SequenceDrafts:
        """Trees (chains with `chain` > 0) for every sequence of `contexts` ({key: its
        whole context: prompt and every token since}), in one call (two when the server had
        lost some). `budgets`: per key, else the params' budget. `end`: keys whose
        sequences are over, ended in the same call (as `end` does, without their last
        tokens: pass their contexts here one last time to have those learned). A failure of
        the call itself raises a ServiceError; a sequence's own failure gives it an empty
        tree."""
        self._settle()
        errors: dict[Hashable, ServiceError] = {}
        index: dict[Hashable, int] = {}
        ends = self._ends(end, None)
        opens, steps = self._entries(list(contexts), contexts, budgets, errors)
        first = len(ends)  # ends go first: the slots they free serve this call's opens
        try:
            results = self._call(ends + opens, steps)
        except ServiceUnavailable:
            if not steps:
                raise
            # Restarted, or failed over: whoever answers now holds none of these sequences.
            self.reopened += len(self._held)
            self._held.clear()
            errors.clear()
            opens, steps = self._entries(list(contexts), contexts, budgets, errors)
            results, first = self._call(opens, steps), 0
        lost = self._collect(opens, steps, results, contexts, index, errors, first, 0)
        if lost:  # swept or never there: open them again, whole, at once
            self.reopened += len(lost)
            again, none = self._entries(lost, contexts, budgets, errors)
            second = self._call(again, none)
            base = len(results) if results is not None else 0
            self._collect(again, none, second, contexts, index, errors, 0, base)
            results = _joined(results, second) if results is not None else second
        return SequenceDrafts(results, index, errors)

    def send(self, contexts: Mapping[Hashable, Sequence[int]],
             end: Iterable[Hashable] = ()) -> None:
        """`draft` for a step that wants no drafts: the same entries (the server learns the
        same tokens, opens the same sequences and ends those of `end`), sent without
        waiting; the reply is read at the next call. `contexts` must not change after
        (copies of an engine's rows). A failure of the call shows then: every sequence is
        opened again, whole, at the next `draft`."""
        self._settle()
        ends = self._ends(end, None)
        opens, steps = self._entries(list(contexts), contexts, None, {})
        if not ends and not opens and not steps:
            return
        results = self.client.batch_async(
            ends + opens, self.params, self.fingerprint, self.tenant, self.chain,
            self.client_id, self.timeout, steps or None)
        self._sent = (results, opens, steps, contexts, len(ends))

    def _settle(self) -> None:
        """Read the reply of the last `send` (the server's view of each sequence)."""
        if self._sent is None:
            return
        results, opens, steps, contexts, first = self._sent
        self._sent = None
        try:
            reply = results()
        except ServiceError:
            self.reopened += len(self._held)
            self._held.clear()  # what the server holds is not known: open them all again
            return
        self._collect(opens, steps, reply, contexts, {}, {}, first, 0)  # lost: reopened

    def end(self, keys: Iterable[Hashable],
            contexts: Mapping[Hashable, Sequence[int]] | None = None) -> None:
        """These sequences are over (their generations finished or were aborted): the server
        frees them and their outputs are final. `contexts`: their whole contexts, so the
        tokens the server has not seen yet are learned first."""
        self._settle()
        entries = self._ends(keys, contexts)
        if entries:
            self.client.batch(entries, tokenizer_fingerprint=self.fingerprint,
                              client_id=self.client_id, timeout=self.timeout)

    def close(self) -> None:
        """End every sequence this batch holds (an engine shutting down)."""
        try:
            self.end(list(self._ids))
        except ServiceError:
            self._held.clear()  # the server sweeps them when they idle

    # ---- internals -------------------------------------------------------------------
    def _ends(self, keys: Iterable[Hashable],
              contexts: Mapping[Hashable, Sequence[int]] | None) -> list[SequenceEnd]:
        """Forget these keys; an end entry for each sequence the server holds."""
        entries = []
        for key in keys:
            self._failed.pop(key, None)
            held = self._held.pop(key, None)
            sid = self._ids.pop(key, None)
            if sid is not None:
                del self._keys[sid]
            if held is None or sid is None:
                continue
            ctx = contexts.get(key) if contexts is not None else None
            tail = [int(t) for t in ctx[held[0]:]] if ctx is not None else []
            entries.append(SequenceEnd(sid, tail))
        return entries

    def _id(self, key: Hashable) -> str:
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = str(self._next_id)
            self._keys[sid] = key
            self._next_id += 1
        return sid

    def _entries(self, keys: list, contexts, budgets, errors: dict
                 ) -> tuple[list[SequenceOpen], PackedSteps]:
        """A step for each sequence the server holds and whose context extends what it
        holds (all packed together); an open for every other one (none for sticky failures
        and contexts over the server's limit, which go to `errors`)."""
        opens = []
        steps = PackedSteps([], [], [] if budgets is not None else None)
        step_ids, step_tokens, step_budgets = steps.sequences, steps.accepted, steps.budgets
        held_of, failed_of, id_of = self._held.get, self._failed.get, self._ids.get
        for key in keys:
            failed = failed_of(key)
            if failed is not None:
                errors[key] = failed
                continue
            ctx = contexts[key]
            n = len(ctx)
            # a key without a budget of its own takes the params' (not the one it opened with)
            budget = int(budgets.get(key, 0)) or self.params.budget if budgets is not None else 0
            held = held_of(key)
            if held is not None and held[0] <= n and (
                    held[0] == 0 or int(ctx[held[0] - 1]) == held[1]):
                step_ids.append(id_of(key) or self._id(key))
                step_tokens.append(ctx[held[0]:])
                if step_budgets is not None:
                    step_budgets.append(budget)
                continue
            self._held.pop(key, None)
            limit = self._limit()
            if limit is not None and n > limit:
                # what the server would answer the open, unsent
                refusal = over_context("prompt", n, limit)
                errors[key] = error_for(refusal.code, refusal.message, self.client.address)
                continue
            params = self.params.replace(budget=budget) if budget else self.params
            opens.append(SequenceOpen(self._id(key), ctx, params, self.tenant))
        return opens, steps

    def _collect(self, opens: list[SequenceOpen], steps: PackedSteps,
                 results: BatchResults | None, contexts, index: dict, errors: dict,
                 first: int, base: int) -> list:
        """Record each open's and step's outcome (their results are `results`' from
        `first` on, opens then steps; the `base + first + i`-th of the call's joined
        results); returns the keys whose steps met a server that did not hold their
        sequence."""
        lost = []
        if results is None:
            return lost
        keys = self._keys
        held = self._held
        n_opens = len(opens)
        sids = [e.sequence for e in opens] + steps.sequences if opens else steps.sequences
        res_errors, lens = results.errors, results.context_lens
        for i, sid in enumerate(sids, start=first):
            key = keys[sid]
            err = res_errors[i]
            if err is None:
                ctx = contexts[key]
                held[key] = (lens[i], int(ctx[-1]) if len(ctx) else -1)
                index[key] = base + i
            elif isinstance(err, UnknownSequence) and i - first >= n_opens:
                held.pop(key, None)
                lost.append(key)
            else:  # the server ended the sequence: open it afresh next time, unless the
                held.pop(key, None)  # same context would fail again
                if err.code in _STICKY:
                    self._failed[key] = err
                errors[key] = err
        return lost

    def _limit(self) -> int | None:
        """The server's max_context_len (asked once; None while it cannot be asked)."""
        if self._max_context is None:
            try:
                info = self.client.info(self.timeout)
            except ServiceError:
                return None
            self._max_context = int(info.limits.get("max_context_len") or 0)
        return self._max_context or None

    def _call(self, entries: list, steps: PackedSteps | None = None) -> BatchResults | None:
        if not entries and not steps:
            return None
        return self.client.batch(entries, self.params, self.fingerprint, self.tenant,
                                 self.chain, self.client_id, self.timeout,
                                 steps=steps or None)


def _joined(a: BatchResults, b: BatchResults) -> BatchResults:
    """Two replies as one (the second's entries after the first's)."""
    return BatchResults(a.sequences + b.sequences, a.errors + b.errors,
                        a.context_lens + b.context_lens, a.trees.joined(b.trees),
                        a.server_us + b.server_us)
