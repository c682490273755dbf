"""redraft's drafts for vLLM: `RedraftProposer`, a custom speculative proposer.

    REDRAFT_SERVICE=127.0.0.1:50051 python - <<'EOF'
    from vllm import LLM
    llm = LLM(model=..., speculative_config={
        "method": "custom_class",
        "model": "redraft.decoder.engines.vllm.RedraftProposer",
        "num_speculative_tokens": 5})
    EOF

How vLLM calls a custom proposer (vllm/v1/spec_decode/custom_class_proposer.py and
vllm/v1/worker/gpu_model_runner.py, `GPUModelRunner.propose_draft_token_ids`): it builds the
class from the config's dotted path with the `VllmConfig` alone, hands `load_model` the target
model, then once per engine step, after the step's tokens were booked, calls
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)` for every
row of its persistent batch: row i's whole context is `token_ids_cpu[i, :num_tokens_no_spec[i]]`
and `sampled_token_ids[i]` the tokens it accepted this step (empty for a row still in a
chunked prefill). It wants one list of 0..k draft tokens per row back, verified as a chain.
No request ids, no start or end of a request: rows are matched to their sequences by content
(`rows.RowIdentity`). All rows are drafted by one batched call to the draft service
(`step_drafts.BatchedDrafts`); a dead service turns into prompt lookup per row and is tried
again later. Nothing of vLLM is imported: the module loads without it.

Each row is handed only the prefix of its chain that pays (`pacing.BatchPacer`, the rule the
llama.cpp adapter uses, for a whole batch): a row's accepted drafts are what it sampled at
the next call minus one, which calibrates the drafter's probabilities per source; the time
from handing out a step's drafts to the next call is that step's forward, timed against the
tokens it verified (rows plus drafts) on steps where no prefill ran. On a CPU, where every
verified token costs, rows with unlikely drafts get none; on a GPU every row gets its chain.
Drafted steps that made fewer tokens than plain steps of as many rows would have in their
time turn drafting off for a while (`pacing.RateGuard`), whatever the model expected.
While no step drafts, the service is asked for drafts less often; the other steps' tokens
are sent all the same, without waiting (`BatchedDrafts.learn`): it learns each sequence from
what it is sent.
`REDRAFT_ADAPTIVE=0` hands every row its whole chain.

`.metrics` (`adapter_counters.AdapterCounters`) counts what vLLM's `spec_decode_*` counters
count, from the proposer's side: drafts handed out and accepted, by source and position
(`adapter_prometheus` serves them: `REDRAFT_ADAPTER_METRICS_PORT`, or vLLM's own `/metrics`
in prometheus_client's multiprocess mode).

Options: the environment (REDRAFT_SERVICE, REDRAFT_TOKEN, REDRAFT_TENANT, REDRAFT_CORPORA, ...:
see `settings`), overridden by `additional_config={"redraft": {...}}` of the vLLM config.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from redraft.decoder.engines.adapter_counters import AdapterCounters
from redraft.decoder.engines.pacing import BatchPacer
from redraft.decoder.engines.rows import RowIdentity
from redraft.decoder.engines.settings import EngineSettings
from redraft.decoder.engines.step_drafts import BatchedDrafts
from redraft.decoder.engines.streams import EngineConfigError
from redraft.proto.tree import Chain

log = logging.getLogger("redraft.engines")


class RedraftProposer:
    """vLLM's `custom_class` proposer drafting from redraft (see the module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        spec = getattr(vllm_config, "speculative_config", None)
        k = getattr(spec, "num_speculative_tokens", None)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise EngineConfigError(f"speculative_config.num_speculative_tokens must be a "
                                    f"positive integer for redraft, got {k!r}")
        self.k = k
        model_config = getattr(vllm_config, "model_config", None)
        max_len = getattr(model_config, "max_model_len", None)
        self.max_model_len = int(max_len) if max_len else None
        extra = getattr(vllm_config, "additional_config", None)
        config = extra.get("redraft") if isinstance(extra, Mapping) else None
        settings = EngineSettings.read(config)
        self.drafts = BatchedDrafts(settings.source(max_depth=k), chain=k)
        self.metrics = AdapterCounters("vllm")  # vLLM's spec_decode counters, in process
        self.pacer = BatchPacer(adaptive=settings.adaptive)
        self.rows = RowIdentity()
        self.keys: list[int] = []  # the sequence of each row at the last step
        self._handed: dict[int, Chain] = {}  # key -> the drafts handed out at the last step
        self._returned_at: float | None = None  # when the last step's drafts were handed out
        self._decoding = False  # every row of the last step was decoding (none in prefill)
        self.stats = {"steps": 0, "rows": 0, "offered_rows": 0, "offered_tokens": 0,
                      "drafted_rows": 0, "drafted_tokens": 0,
                      "accepted_tokens": 0, "errors": 0, "seconds": 0.0, "unasked_steps": 0,
                      "drafted_by_source": self.metrics.draft_tokens,
                      "accepted_by_source": self.metrics.accepted_tokens}
        # lazy: prometheus_client only once an engine builds the proposer
        from redraft.decoder.engines.adapter_prometheus import expose

        expose(settings.metrics_port, settings.metrics_host)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM hands the target model here; redraft drafts without it."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]],
                num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings: Any = None, **kwargs: Any) -> list[list[int]]:
        """Draft tokens for each row of the batch (at most k, none for rows that sampled
        nothing or have no room left before max_model_len)."""
        start = time.perf_counter()
        n_rows = len(sampled_token_ids)
        self.stats["steps"] += 1
        self.metrics.steps += 1
        self.stats["rows"] += n_rows
        try:
            out = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, n_rows)
        except Exception as exc:  # drafts never break the engine: no drafts this step
            self.stats["errors"] += 1
            log.warning("redraft: drafting failed this step (%s: %s); no drafts",
                        type(exc).__name__, exc)
            out = [[] for _ in range(n_rows)]
            self._handed, self._decoding = {}, False
        self._returned_at = time.perf_counter()
        self.stats["seconds"] += self._returned_at - start
        return out

    def _propose(self, sampled: Sequence[Sequence[int]], lengths: np.ndarray,
                 token_ids: np.ndarray, n_rows: int) -> list[list[int]]:
        ns = np.asarray(lengths[:n_rows]).tolist()
        rows = [token_ids[i, :n] for i, n in enumerate(ns)]
        keys, ended = self.rows.assign(rows, [len(s) for s in sampled])
        self._learn(keys, sampled)
        self.keys = keys
        # drafts a row may take: k, fewer near max_model_len
        limit = self.max_model_len
        room = [self.k] * n_rows if limit is None else [max(0, min(self.k, limit - n))
                                                          for n in ns]
        wanted = {keys[i]: rows[i] for i in range(n_rows) if room[i] and len(sampled[i])}
        if not self.pacer.wants_drafts(n_rows):  # learned, not waited for: no drafts
            self.stats["unasked_steps"] += 1
            self.metrics.skipped_steps += 1
            self._handed = {}
            # copies: the engine changes its rows in place before the reply is read
            self.drafts.learn({key: np.array(row) for key, row in wanted.items()}, ended)
            return [[] for _ in range(n_rows)]
        chains = self.drafts.step_chains(wanted, ended)
        offered = [(key, chains[key].head(r)) for key, r in zip(keys, room)
                   if key in wanted and chains.get(key)]
        self.stats["offered_rows"] += len(offered)
        self.stats["offered_tokens"] += sum(len(c) for _, c in offered)
        keep = self.pacer.choose([(c.probs, c.sources) for _, c in offered], n_rows)
        self._handed = {key: c.head(n) for (key, c), n in zip(offered, keep) if n}
        out: list[list[int]] = []
        drafted_tokens = 0
        metrics = self.metrics
        for key in keys:
            chain = self._handed.get(key)
            if chain is None:
                out.append([])
                continue
            drafted_tokens += len(chain)
            metrics.drafted(chain.sources)
            out.append(list(chain.tokens))
        self.stats["drafted_rows"] += len(self._handed)
        self.stats["drafted_tokens"] += drafted_tokens
        return out

    def _learn(self, keys: list[int], sampled: Sequence[Sequence[int]]) -> None:
        """What the last step's forward tells the pacer: each row's accepted drafts (it
        sampled them plus one token), and the forward's time against its tokens when this
        step's rows are the last step's, all decoding (no prefill ran in it)."""
        handed, last = self._handed, set(self.keys)
        metrics = self.metrics
        for key, s in zip(keys, sampled):
            chain = handed.get(key)
            if chain is None or not len(s):
                continue
            accepted = min(len(s) - 1, len(chain))
            self.pacer.verified(chain.probs, chain.sources, accepted)
            self.stats["accepted_tokens"] += accepted
            metrics.accepted(chain.sources, accepted)
        decoding = all(len(s) for s in sampled)
        if (self._returned_at is not None and last and decoding and self._decoding
                and all(key in last for key in keys)):
            drafts = sum(len(c) for c in handed.values())
            whole = len(keys) == len(last)  # no row ended: every row's tokens are here
            self.pacer.forward(len(last) + drafts, time.perf_counter() - self._returned_at,
                               drafts > 0, rows=len(keys) if whole else 0,
                               made=sum(len(s) for s in sampled))
        self._decoding = decoding

    def close(self) -> None:
        """End every sequence on the service (their outputs become final)."""
        self.rows.clear()
        self.drafts.close()
