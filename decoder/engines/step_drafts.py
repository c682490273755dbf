"""Drafts for every sequence of an engine step: one batched call to the draft service.

Why one object for vLLM and SGLang: both ask for all running sequences' drafts at once, on
the step's critical path, and neither may ever fail or stall because of a drafter. So
`BatchedDrafts.step` takes {key: whole context} for the sequences that want drafts and the
keys that ended, and makes one `Drafter.Batch` call (through `SequenceBatch`, which sends
only the tokens the server has not seen). When that call fails, this step and every step
for the source's `retry_after` seconds are drafted by prompt lookup in this process, one
incremental drafter per sequence; then the service is tried again with fresh sequences
(the ones it held are swept when they idle). A sequence whose own entry fails is drafted by
prompt lookup at that step and tried on the service again at the next (a server that was full
then has room; a refusal the same context would meet again, such as a context over the
server's limit, is not resent by `SequenceBatch`). With a datastore in process instead of a
service, every sequence is drafted here the same way.

Tested by: tests/decoder/engines/test_vllm.py, tests/decoder/engines/test_sglang.py
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np
from redraft.decoder.engines.streams import DraftSource, DraftStream, LocalStream
from redraft.proto.tree import Chain, Tree, best_chain

MAX_ID = 1 << 31  # the wire carries ids in [0, 2^31)

log = logging.getLogger("redraft.engines")


class BatchedDrafts:
    """One engine's sequences drafted together (module docstring). `chain` > 0: each draft
    is the best chain of at most that many tokens; 0: the whole tree. Not thread-safe: one
    engine loop calls it."""

    def __init__(self, source: DraftSource, chain: int = 0) -> None:
        self.source = source
        self.chain = chain
        self.calls = 0  # batched calls made (one per step that reached the service)
        self.local_steps = 0  # steps drafted in process while the service was down
        self._batch = None  # the SequenceBatch on the service, made when first needed
        self._local: dict[Hashable, list] = {}  # key -> [stream, tokens fed]
        self._refused: set[Hashable] = set()  # keys whose service entry failed (warned once)
        self._bad: set[Hashable] = set()  # keys holding ids no token can have: no drafts

    def step(self, contexts: Mapping[Hashable, Sequence[int]],
             end: Iterable[Hashable] = ()) -> dict[Hashable, Tree]:
        """A draft for each key of `contexts` (its whole context: prompt and every token
        accepted since); the sequences of `end` are over. Never raises for a service
        failure."""
        return self._step(contexts, end, False)

    def step_chains(self, contexts: Mapping[Hashable, Sequence[int]],
                    end: Iterable[Hashable] = ()) -> dict[Hashable, Chain]:
        """`step` for a caller that wants each draft as a chain (with `chain` > 0: its best
        chain, in order; each node's probability and source kept for pacing), read straight
        from the reply's arrays: no Tree per sequence on an engine's step."""
        return self._step(contexts, end, True)

    def _step(self, contexts: Mapping[Hashable, Sequence[int]], end: Iterable[Hashable],
              tokens_only: bool) -> dict:
        end = self._forget(end)
        contexts = self._without_bad(contexts)
        if self.source.client is None:
            return self._local_step(contexts, tokens_only)
        if not self.source.service_usable():
            self.local_steps += 1
            return self._local_step(contexts, tokens_only)
        try:
            drafts = self._sequence_batch().draft(contexts, end=end)
        except Exception as exc:  # any failure: prompt lookup, the service later
            self._batch = None
            if self._find_bad(contexts):  # a row's ids, not the service: the others again
                return self._step(contexts, end, tokens_only)
            self.source.service_failed(exc)
            self.local_steps += 1
            return self._local_step(contexts, tokens_only)
        self.calls += 1
        out: dict = {}
        failed = {}
        index, results = drafts.index, drafts.results
        for key in contexts:
            err = drafts.errors.get(key)
            if err is not None:
                failed[key] = contexts[key]
                if key not in self._refused:
                    self._refused.add(key)
                    log.warning("draft service: sequence %r failed (%s); prompt lookup drafts "
                                "it while the service refuses it", key, err)
                continue
            if self._local:
                self._drop_local(key)  # back on the service
            out[key] = results.chain(index[key]) if tokens_only else drafts[key]
        if failed:
            out.update(self._local_step(failed, tokens_only))
        return out

    def learn(self, contexts: Mapping[Hashable, Sequence[int]],
              end: Iterable[Hashable] = ()) -> None:
        """A step that wants no drafts: the sequences' new tokens (and `end`) reach where
        they are drafted, not waited for: the service's call is sent without waiting
        (`SequenceBatch.send`; `contexts` must not change after), streams in this process
        are extended. Never raises for a service failure."""
        end = self._forget(end)
        contexts = self._without_bad(contexts)
        if self.source.client is None or not self.source.service_usable():
            for key, ctx in contexts.items():
                entry = self._local.get(key)
                if entry is not None:
                    _feed(entry, ctx)
            return
        try:
            self._sequence_batch().send(contexts, end)
        except Exception as exc:  # any failure: prompt lookup, the service later
            self._batch = None
            if self._find_bad(contexts):
                self.learn(contexts, end)
                return
            self.source.service_failed(exc)

    def close(self) -> None:
        """End every sequence (an engine shutting down) and release the source."""
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        for key in list(self._local):
            self._drop_local(key)
        self.source.close()

    # ---- internals -------------------------------------------------------------------
    def _sequence_batch(self):
        if self._batch is None:
            # lazy: grpc is loaded only when a service is used
            from redraft.datastore.service.batch_client import SequenceBatch

            s = self.source
            self._batch = SequenceBatch(s.client, s.params, s.fingerprint(), s.tenant,
                                        self.chain, s.client.timeout)
        return self._batch

    def _local_step(self, contexts: Mapping[Hashable, Sequence[int]],
                    tokens_only: bool = False) -> dict:
        out = {}
        for key, ctx in contexts.items():
            entry = self._local.get(key)
            if entry is None:
                entry = self._local[key] = [self._open_local(ctx), len(ctx)]
            else:
                _feed(entry, ctx)
            tree = entry[0].propose()
            if tokens_only:
                out[key] = best_chain(tree, self.chain or len(tree))
                continue
            if self.chain:
                tree = best_chain(tree, self.chain).tree(tree.match_len)
            out[key] = tree
        return out

    def _open_local(self, ctx: Sequence[int]) -> DraftStream:
        prompt = [int(t) for t in ctx]
        if self.source.client is None:
            return self.source.open(prompt)  # the datastore in process
        return LocalStream(prompt, self.source.fallback_settings)  # prompt lookup

    def _forget(self, end: Iterable[Hashable]) -> list[Hashable]:
        """The ended keys, their streams in this process closed."""
        end = list(end)
        for key in end:
            self._drop_local(key)
            self._refused.discard(key)
            self._bad.discard(key)
        return end

    def _without_bad(self, contexts: Mapping[Hashable, Sequence[int]]
                     ) -> Mapping[Hashable, Sequence[int]]:
        if not self._bad:
            return contexts
        return {k: v for k, v in contexts.items() if k not in self._bad}

    def _find_bad(self, contexts: Mapping[Hashable, Sequence[int]]) -> bool:
        """After a failed call: mark the keys whose contexts hold an id outside [0, 2^31)
        (what the wire refuses for the whole call, and prompt lookup too), so that such a
        row costs itself alone; whether there were any. Checked only after a failure: the
        step pays nothing for it."""
        found = False
        for key, ctx in contexts.items():
            ids = np.asarray(ctx)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= MAX_ID):
                self._bad.add(key)
                self._drop_local(key)
                found = True
                log.warning("redraft: sequence %r holds token id %d, which no token has; it "
                            "gets no drafts (the other sequences draft as usual)", key,
                            int(ids.min()) if int(ids.min()) < 0 else int(ids.max()))
        return found

    def _drop_local(self, key: Hashable) -> None:
        entry = self._local.pop(key, None)
        if entry is not None:
            entry[0].close()


def _feed(entry: list, ctx: Sequence[int]) -> None:
    """A stream in this process (`entry`: [stream, tokens fed]) takes `ctx`'s new tokens."""
    if len(ctx) > entry[1]:
        entry[0].extend([int(t) for t in ctx[entry[1]:]])
        entry[1] = len(ctx)

