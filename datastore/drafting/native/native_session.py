"""SessionDrafter's API and trees with each step one call into the compiled core, and the
batched step: many sessions' steps in one call.

The Python SessionDrafter (redraft.datastore.drafting.session_drafter, which stays) is the
reference: same settings, same trees node for node (tokens, parents, probs to the bit,
sources), same match lengths and the same exceptions. Where the core meets an input the
reference would refuse (retrieval settings, token ids outside the datastore's vocabulary,
unknown corpora, a closed Reader), it drafts nothing and the reference's own code is run to
raise the reference's exception.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import redraft.datastore.drafting.native._core as _core
from redraft.datastore.drafting.learned_index import JournaledOutput
from redraft.datastore.drafting.native.mapped_store import store_of
from redraft.datastore.drafting.native.native_learned import NativeLearnedIndex, tenant_bytes
from redraft.datastore.drafting.retrieval import retrieval_tree
from redraft.datastore.drafting.session_drafter import DraftSettings, retrieval_corpora
from redraft.datastore.lmdbfile import faults
from redraft.proto.errors import DatastoreCorrupt, DatastoreError
from redraft.proto.tree import LEARNED, PLD, REST, Tree

_ERR_REST, _ERR_TOKENS = _core.ERR_REST, _core.ERR_TOKENS  # the core's error codes


class NativeSessionDrafter:
    """Drafts for one generation from its prompt and the tokens accepted since.

    As session_drafter.SessionDrafter, except that `learned` must be a NativeLearnedIndex
    (the core cannot read a Python one) and that token ids must be integers in [0, 2**32).
    """

    def __init__(self, prompt: Sequence[int], settings: DraftSettings, reader=None,
                 learned: NativeLearnedIndex | None = None, tenant: str = "") -> None:
        s = settings
        self.settings = s
        if learned is not None and not isinstance(learned, NativeLearnedIndex):
            raise TypeError("the compiled core drafts from a NativeLearnedIndex, "
                            f"not a {type(learned).__name__}")
        self.learned = learned
        self.tenant = tenant
        p = s.params
        sources = p.source_set()
        self._max_match = p.max_match_len or s.rest_max_match
        self._min_match = min(p.min_match_len or s.rest_min_match, self._max_match)
        self.reader = reader if REST in sources else None
        self._corpora = (retrieval_corpora(reader, p.corpora) if self.reader is not None
                         else None)
        store, shards, rest_ok = self._retrieval()
        pld_max = pld_min = 0
        if PLD in sources:
            pld_max = p.max_match_len or 8
            pld_min = min(p.min_match_len or 1, pld_max)
            if pld_min < 1:  # what PromptLookup says
                raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {pld_min}, {pld_max}")
        scale, power = s.rest_calibration
        self._core = _core.Session(
            prompt, p.budget, p.max_depth, store, shards, rest_ok, self._max_match,
            self._min_match, s.rest_max_occurrences, float(scale), float(power), pld_max,
            pld_min, learned._core if learned is not None else None, LEARNED in sources,
            tenant_bytes(tenant))
        self._journaled = (learned.journaled(tenant, prompt) if learned is not None
                           else None)

    def _retrieval(self) -> tuple:
        """(store, shard ids, whether Reader.propose accepts the settings) for the core."""
        if self.reader is None or self._corpora is None:
            return None, [], True
        s = self.settings
        depth = s.params.max_depth
        rest_ok = (depth >= 1 and s.rest_max_occurrences >= 1 and self._min_match >= 1
                   and self._max_match >= self._min_match and depth <= 1024)
        try:
            shards = self.reader.shard_ids(self._corpora)
        except DatastoreError:  # raised when retrieval runs, as the reference does
            return store_of(self.reader), [], False
        return store_of(self.reader), shards, rest_ok

    def use_reader(self, reader) -> None:
        """Draft retrieval from `reader` from now on (see SessionDrafter.use_reader)."""
        if self.reader is None or reader is self.reader:
            return
        self.reader = reader
        self._corpora = retrieval_corpora(reader, self.settings.params.corpora)
        self._core.use_store(*self._retrieval())

    @property
    def rest_match_len(self) -> int:
        """The last step's retrieval match length (0: none, or the step failed)."""
        return self._core.rest_match_len

    @property
    def pld_match_len(self) -> int:
        return self._core.pld_match_len

    @property
    def learned_match_len(self) -> int:
        return self._core.learned_match_len

    @property
    def context(self) -> list[int]:
        """The prompt and every token accepted since (a copy)."""
        return self._core.context()

    def __len__(self) -> int:
        """Tokens of the context."""
        return self._core.context_len()

    def extend(self, accepted: Sequence[int]) -> None:
        """Tokens the decoder accepted since the last call (they are learned at once)."""
        self._core.extend(accepted)
        if self._journaled is not None:
            self._journaled.record(accepted)

    def propose(self, budget: int | None = None) -> Tree:
        """The merged tree of every source for the context so far, best nodes first."""
        out = self._core.propose(budget)
        self._check_maps()
        if out.__class__ is int:
            raise self._error(out, budget)
        return Tree(*out, self._core.rest_match_len)

    def step(self, accepted: Sequence[int], budget: int | None = None) -> Tree:
        """extend(accepted), then propose(budget), in one call into the core."""
        out = self._core.step(accepted, budget)
        if self._journaled is not None:
            self._journaled.record(accepted)
        self._check_maps()
        if out.__class__ is int:
            raise self._error(out, budget)
        return Tree(*out, self._core.rest_match_len)

    def propose_arrays(self, budget: int | None = None) -> tuple[np.ndarray, ...]:
        """The tree as arrays: tokens (uint32), parents (int32), probs (float64) and source
        bits (uint8, tree.SOURCE_BITS), for callers that never need a Tree."""
        out = self._core.propose(budget, False)
        self._check_maps()
        if out.__class__ is int:
            raise self._error(out, budget)
        tokens, parents, probs, bits = out
        return (np.frombuffer(tokens, np.uint32), np.frombuffer(parents, np.int32),
                np.frombuffer(probs, np.float64), np.frombuffer(bits, np.uint8))

    def _check_maps(self) -> None:
        """DatastoreCorrupt if the step read a segment truncated under its map (it read
        zeros: Reader.check_maps); a counter compare otherwise."""
        if self.reader is not None and faults() != self.reader._faults_seen:
            self.reader.check_maps()

    def close(self) -> None:
        """The generation is over: its output is final in the learned index."""
        self._core.close()
        if self._journaled is not None:
            self._journaled.end()

    def _error(self, code: int, budget: int | None) -> Exception:
        """The exception the reference raises for this step (it runs the reference's
        retrieval call, which is where every refused input is refused)."""
        budget = self.settings.params.budget if budget is None else budget
        if code == _ERR_REST:
            s = self.settings
            try:
                retrieval_tree(
                    self.reader, self.context[-self._max_match:], budget=budget,
                    max_depth=s.params.max_depth, max_match_len=self._max_match,
                    min_match_len=self._min_match, max_occurrences=s.rest_max_occurrences,
                    corpora=self._corpora)
            except Exception as exc:  # noqa: BLE001 - whatever the reference raises
                return exc
            # the reference takes the same inputs, so what the core refused is the one
            # thing it checks that the reference may not have read: a continuation holding
            # an id past the vocabulary (damaged token arrays, not verified yet)
            return DatastoreCorrupt(
                f"{getattr(self.reader, 'path', 'the datastore')}: damaged token arrays (a "
                f"continuation holds an id past the vocabulary [0, {self.reader.vocab_size})"
                f"); verify it with `redraft stats`")
        return RuntimeError(f"the compiled core refused a step (code {code}) that the "
                            "reference drafts")


def native_step(drafters: Sequence[NativeSessionDrafter],
                accepted: Sequence[Sequence[int] | None],
                budgets: Sequence[int | None] | None, threads: int, chain: int) -> tuple:
    """The core's batched step (drafting.batch_step.step_batch's compiled path): every drafter
    extended, then every one drafted, without the GIL while drafting. Returns (offsets,
    tokens, parents, probs, bits, match_lens, expected, used bits, errors by index)."""
    status, counts, *trees = _core.step_batch(
        [d._core for d in drafters], accepted, budgets, threads, chain)
    errors = {i: _batch_error(drafters[i], code, accepted[i],
                              None if budgets is None else budgets[i])
              for i, code in _failed(status)}
    _truncated_maps(drafters, errors)
    refused = {i for i, f in errors.items() if isinstance(f, _TokensRefused)}
    # what was learned reaches the journal
    JournaledOutput.record_all((d._journaled, acc) for i, (d, acc) in enumerate(
        zip(drafters, accepted)) if d._journaled is not None and acc is not None
        and i not in refused)
    return (_offsets(counts), *_tree_arrays(*trees, np.float64),
            {i: e.error for i, e in errors.items()})


def native_step_flat(drafters: Sequence[NativeSessionDrafter], tokens: np.ndarray,
                     counts: np.ndarray, budgets: np.ndarray | None, threads: int,
                     chain: int) -> tuple:
    """native_step over flat arrays (the service's packed steps): drafter i is extended by
    the next counts[i] of `tokens` (uint32, ids the caller checked against the vocabulary)
    and drafts with budgets[i] nodes (uint32, 0: its own). Returns what native_step does,
    probs as float32, then every drafter's context length (uint64) after the step."""
    status, sizes, *trees, lens = _core.step_flat(
        [d._core for d in drafters], tokens, counts, budgets, threads, chain)
    errors = {i: drafters[i]._error(code, int(budgets[i]) if budgets is not None
                                    and budgets[i] else None)
              for i, code in _failed(status)}
    _truncated_maps(drafters, errors, wrap=False)
    if len(tokens):  # what was learned reaches the journal
        journaled = [d._journaled for d in drafters]
        if any(journaled):
            JournaledOutput.record_flat(journaled, tokens.tolist(), counts.tolist())
    return (_offsets(sizes), *_tree_arrays(*trees, np.float32), errors,
            np.frombuffer(lens, np.uint64))


def _truncated_maps(drafters: Sequence[NativeSessionDrafter], errors: dict, *,
                    wrap: bool = True) -> None:
    """A batched step that read a segment truncated under its map (zeros: check_maps) failed
    for every sequence of that snapshot: their errors say so. Nothing to do (one counter
    compare) unless a map of the process was truncated since the last batch found none."""
    global _clean_at
    seen = faults()
    if seen == _clean_at:
        return
    why: dict[int, Exception | None] = {}
    for i, d in enumerate(drafters):
        reader = d.reader
        if reader is None:
            continue
        if id(reader) not in why:
            try:
                reader.check_maps()
                why[id(reader)] = None
            except DatastoreError as exc:
                why[id(reader)] = exc
        exc = why[id(reader)]
        if exc is not None and not isinstance(errors.get(i), _TokensRefused):
            errors[i] = _Failure(exc) if wrap else exc
    if not any(why.values()):
        _clean_at = seen


_clean_at = 0  # faults() when a batch last found every snapshot it read whole


def _failed(status: bytes) -> list[tuple[int, int]]:
    """(index, error code) of the sessions the core failed."""
    codes = np.frombuffer(status, np.int32)
    return [(i, int(codes[i])) for i in np.flatnonzero(codes).tolist()]


def _offsets(counts: bytes) -> np.ndarray:
    """Where each session's nodes start in the concatenated trees (and where they end)."""
    counts = np.frombuffer(counts, np.int32)
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def _tree_arrays(tokens: bytes, parents: bytes, probs: bytes, bits: bytes, mls: bytes,
                 expected: bytes, used: bytes, prob_type: type) -> tuple:
    """The core's concatenated trees and per-session figures as numpy views."""
    return (np.frombuffer(tokens, np.uint32), np.frombuffer(parents, np.int32),
            np.frombuffer(probs, prob_type), np.frombuffer(bits, np.uint8),
            np.frombuffer(mls, np.int64).reshape(-1, 3), np.frombuffer(expected, np.float64),
            np.frombuffer(used, np.uint8))


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class _TokensRefused(_Failure):
    """The accepted tokens were refused before the session changed."""


def _batch_error(drafter: NativeSessionDrafter, code: int, accepted, budget: int | None
                 ) -> _Failure:
    if code == _ERR_TOKENS:
        try:
            drafter._core.extend(accepted)  # refuses them before changing anything
        except (TypeError, ValueError, OverflowError) as exc:
            return _TokensRefused(exc)
    return _Failure(drafter._error(code, budget))
