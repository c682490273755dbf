"""redraft's drafts for SGLang: the speculative algorithm `REDRAFT`, a plugin.

    pip install redraft            # its entry point registers REDRAFT in every SGLang process
    REDRAFT_SERVICE=127.0.0.1:50051 python -m sglang.launch_server --model-path ... \\
        --speculative-algorithm REDRAFT --speculative-num-draft-tokens 16

How SGLang admits it (python/sglang/srt/speculative/spec_registry.py and spec_info.py): a
plugin registers a name with `SpeculativeAlgorithm.register(NAME, spec_class=...)` and a
factory returning the spec worker class the scheduler runs. SGLang's model-free NGRAM worker
(python/sglang/srt/speculative/ngram_worker.py) already verifies a draft tree per request
and takes its drafts from one object, `self.ngram_cache`, called once per decode step for the
whole batch: `batch_get(batch_tokens) -> (ids, mask)`, plus `batch_put`, `synchronize` and
`reset`. So REDRAFT is SGLang's own NGRAM worker class (whichever this SGLang builds for
NGRAM) with that object replaced by `RedraftNgramCache`, which drafts every request of the
step with one batched call to the draft service; the worker is told the step's request ids
and asks for whole contexts (its match window made unbounded), so each request is one
sequence on the service. Nothing of SGLang is imported until `register` runs.

`RedraftNgramCache.metrics` counts drafts handed out and accepted with vLLM's
`spec_decode_*` meanings (`adapter_counters`), what was accepted read from how each request
grew by the next call; with SGLang's `--enable-metrics` (its prometheus_client
multiprocess mode) they are published beside SGLang's own (`adapter_prometheus`).

Options: the environment (REDRAFT_SERVICE, REDRAFT_TOKEN, ...: see `settings`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

import numpy as np
from redraft.decoder.engines.adapter_counters import AdapterCounters
from redraft.decoder.engines.rows import RowIdentity
from redraft.decoder.engines.settings import EngineSettings
from redraft.decoder.engines.step_drafts import BatchedDrafts
from redraft.proto.tree import Tree

log = logging.getLogger("redraft.engines")

NAME = "REDRAFT"
WHOLE_CONTEXT = 1 << 62  # the NGRAM worker's match window: every token of each request


class RedraftNgramCache:
    """What SGLang's NGRAM worker drafts from, drafting from redraft instead.

    `batch_get(batch_tokens)`: for each request, in batch order, its tokens (the whole
    context: prompt and output so far); returns what SGLang's NgramCache returns: the ids of
    `draft_token_num` tree nodes per request, flat (node 0 is the request's last token, the
    others redraft's tree in parent-before-child order, padded with token 0 under node 0),
    and the flat `draft_token_num`^2 0/1 mask of each (row i: node i and its ancestors),
    both int64. Request identity comes from `expect(request_ids)` before the call (the
    REDRAFT worker passes its batch's `rid`s), else from the contexts themselves; a request
    absent from more than `grace` calls is over.
    """

    def __init__(self, drafts: BatchedDrafts, draft_token_num: int, grace: int = 2) -> None:
        self.drafts = drafts
        self.n = int(draft_token_num)
        self.grace = grace
        self.rows = RowIdentity(grace)  # when the caller names no request ids
        self._expected: list[Hashable] | None = None
        self._missing: dict[Hashable, int] = {}
        self.stats = {"calls": 0, "requests": 0, "drafted_nodes": 0, "errors": 0}
        self.metrics = AdapterCounters("sglang")  # vLLM's spec_decode counters' meanings
        self._pending: dict[Hashable, tuple[int, Tree, int]] = {}  # handed at the last call

    @classmethod
    def from_settings(cls, draft_token_num: int,
                      settings: EngineSettings | None = None) -> RedraftNgramCache:
        """A cache drafting at most `draft_token_num - 1` nodes per request (node 0 is the
        request's last token), from `settings` (default: the environment)."""
        settings = settings or EngineSettings.read()
        # lazy: prometheus_client only in SGLang's scheduler processes, never where SGLang
        # has not yet chosen its multiprocess mode (it reads the mode when first imported)
        from redraft.decoder.engines.adapter_prometheus import expose

        expose(settings.metrics_port, settings.metrics_host)
        nodes = max(1, int(draft_token_num) - 1)
        return cls(BatchedDrafts(settings.source(budget=nodes, max_depth=nodes)),
                   draft_token_num)

    # ---- what the NGRAM worker calls ---------------------------------------------------
    def expect(self, request_ids: Sequence[Hashable]) -> None:
        """The request ids of the next `batch_get`'s rows, in order."""
        self._expected = list(request_ids)

    def batch_get(self, batch_tokens: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        bs = len(batch_tokens)
        self.stats["calls"] += 1
        self.stats["requests"] += bs
        self.metrics.steps += 1
        last = [int(t[-1]) if len(t) else 0 for t in batch_tokens]
        try:
            trees = self._trees(batch_tokens)
        except Exception as exc:  # drafts never break the engine: no drafts this step
            self.stats["errors"] += 1
            log.warning("redraft: drafting failed this step (%s: %s); no drafts",
                        type(exc).__name__, exc)
            trees = [Tree() for _ in range(bs)]
            self._pending = {}
        ids, mask = tree_arrays(last, trees, self.n)
        return ids, mask

    def batch_put(self, batch_tokens: Sequence[Sequence[int]]) -> None:
        """Nothing to do: the service learns each request's tokens from its sequence."""

    def synchronize(self) -> None:
        """Nothing to wait for (batch_put does nothing in the background)."""

    def reset(self) -> None:
        """SGLang flushed its caches: end every sequence (their outputs become final)."""
        ended = list(self._missing) + self.rows.clear()
        self._missing.clear()
        self._pending = {}
        try:
            self.drafts.step({}, end=ended)
        except Exception as exc:
            log.warning("redraft: ending sequences failed (%s)", exc)

    def close(self) -> None:
        self.reset()
        self.drafts.close()

    # ---- internals ---------------------------------------------------------------------
    def _trees(self, batch_tokens: Sequence[Sequence[int]]) -> list[Tree]:
        expected, self._expected = self._expected, None
        if expected is not None and len(expected) == len(batch_tokens):
            keys, ended = expected, self._absent(expected)
        else:
            rows = [np.asarray(t, dtype=np.int64) for t in batch_tokens]
            keys, ended = self.rows.assign(rows)
        self._count_accepted(keys, batch_tokens)
        if self.n < 2:
            self.drafts.step({}, end=ended)
            return [Tree() for _ in keys]
        wanted = {k: t for k, t in zip(keys, batch_tokens) if len(t)}
        drafts = self.drafts.step(wanted, ended)
        trees = [drafts.get(k, Tree()) for k in keys]
        self._count_handed(keys, batch_tokens, trees)
        return trees

    def _count_handed(self, keys: Sequence[Hashable], batch_tokens: Sequence[Sequence[int]],
                      trees: Sequence[Tree]) -> None:
        """Count the nodes SGLang gets (the first n - 1 of each tree) and keep each tree and
        its request's length, to count what was accepted of it at the next call."""
        pending: dict[Hashable, tuple[int, Tree, int]] = {}
        most = self.n - 1
        metrics = self.metrics
        for key, context, tree in zip(keys, batch_tokens, trees):
            m = min(len(tree), most)
            if m > 0:
                metrics.drafted(tree.sources[:m])
                pending[key] = (len(context), tree, m)
        self._pending = pending

    def _count_accepted(self, keys: Sequence[Hashable],
                        batch_tokens: Sequence[Sequence[int]]) -> None:
        """A request drafted at the last call now holds the tree's accepted path and one
        token of the target's own after its old context: count that path's nodes. (A request
        that finished at the last step never comes back: its last step is not counted.)"""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        for key, context in zip(keys, batch_tokens):
            handed = pending.get(key)
            if handed is None:
                continue
            length, tree, m = handed
            path = accepted_path(tree, m, context[length:])
            if path:
                self.metrics.accepted([tree.sources[i] for i in path], len(path))

    def _absent(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Request ids absent from more than `grace` calls in a row (and forgets them)."""
        present = set(keys)
        ended = []
        for key in list(self._missing):
            if key not in present:
                self._missing[key] += 1
                if self._missing[key] > self.grace:
                    del self._missing[key]
                    ended.append(key)
        for key in keys:
            self._missing[key] = 0
        return ended


def accepted_path(tree: Tree, m: int, new: Sequence[int]) -> list[int]:
    """The nodes (of the tree's first `m`) that `new` followed from the root: the accepted
    drafts, when `new` is what a step added (those drafts, then the target's own token, which
    is never a draft and is left out). One pass: a parent precedes its children."""
    path: list[int] = []
    limit = len(new) - 1
    at = -1
    tokens, parents = tree.tokens, tree.parents
    for i in range(m):
        if len(path) >= limit:
            break
        if parents[i] == at and tokens[i] == new[len(path)]:
            path.append(i)
            at = i
    return path


def tree_arrays(last_tokens: Sequence[int], trees: Sequence[Tree],
                n: int) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's draft layout for these trees: (ids, mask), flat, `n` nodes per request (the
    first `n - 1` nodes of each tree: parents come first, so any prefix is a tree)."""
    bs = len(trees)
    tokens = np.zeros((bs, n), dtype=np.int64)
    parents = np.zeros((bs, n), dtype=np.int64)  # padding hangs under node 0
    if n:
        tokens[:, 0] = last_tokens
        parents[:, 0] = -1
    for b, tree in enumerate(trees):
        m = min(len(tree), n - 1)
        if m > 0:
            tokens[b, 1:m + 1] = tree.tokens[:m]
            parents[b, 1:m + 1] = np.asarray(tree.parents[:m], dtype=np.int64) + 1
    # Row i of a mask: node i and every ancestor. Walk all nodes up one level at a time.
    mask = np.zeros((bs, n, n), dtype=np.int64)
    node = np.broadcast_to(np.arange(n), (bs, n)).copy()
    while True:
        b, i = np.nonzero(node >= 0)
        if not len(b):
            break
        mask[b, i, node[b, i]] = 1
        up = np.take_along_axis(parents, np.maximum(node, 0), axis=1)
        node = np.where(node >= 0, up, -1)
    return tokens.ravel(), mask.ravel()


# ---- the plugin ------------------------------------------------------------------------


def worker_class(server_args):
    """The spec worker SGLang runs for REDRAFT: its own NGRAM worker class drafting from
    `RedraftNgramCache`."""
    # lazy: SGLang is imported only inside SGLang's processes
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    base = SpeculativeAlgorithm.NGRAM.create_worker(server_args)

    class RedraftWorker(base):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.max_match_window_size = WHOLE_CONTEXT  # batch_get gets whole contexts
            self.ngram_cache = RedraftNgramCache.from_settings(self.draft_token_num)

        def forward_batch_generation(self, batch, *args, **kwargs):
            reqs = getattr(batch, "reqs", None)
            if reqs is not None:
                self.ngram_cache.expect([req.rid for req in reqs])
            return super().forward_batch_generation(batch, *args, **kwargs)

    RedraftWorker.__name__ = RedraftWorker.__qualname__ = f"Redraft{base.__name__}"
    return RedraftWorker


def register(name: str = NAME) -> bool:
    """Register REDRAFT with SGLang's speculative-algorithm registry (SGLang runs this in
    each of its processes through the `sglang.srt.plugins` entry point). False, with a
    warning, where this SGLang has no registry; registering twice is harmless."""
    try:
        # lazy: SGLang is imported only inside SGLang's processes
        from sglang.srt.speculative import spec_info, spec_registry
    except ImportError as exc:
        log.warning("redraft: this SGLang has no speculative-algorithm registry (%s); "
                    "--speculative-algorithm %s is unavailable", exc, name)
        return False
    SpeculativeAlgorithm = spec_info.SpeculativeAlgorithm
    CustomSpecAlgo = spec_registry.CustomSpecAlgo

    class RedraftSpec(CustomSpecAlgo):
        """Everything SGLang decides for NGRAM (its server-argument defaults, the verify
        layout, no draft KV cache) holds for REDRAFT: it is the NGRAM worker."""

        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

        def handle_server_args(self, server_args) -> None:
            handle = getattr(SpeculativeAlgorithm.NGRAM, "handle_server_args", None)
            if handle is not None:
                handle(server_args)

    try:
        SpeculativeAlgorithm.register(name, supports_overlap=True,
                                      spec_class=RedraftSpec)(worker_class)
    except ValueError as exc:
        if "already registered" not in str(exc):
            raise
    return True
