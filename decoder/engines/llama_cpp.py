"""redraft's drafts for llama-cpp-python: `RedraftDraft`, a `LlamaDraftModel`.

    from redraft.decoder.engines.llama_cpp import Llama, RedraftDraft

    llm = Llama(draft_model=RedraftDraft(service="127.0.0.1:50051"))   # or datastore=DIR
    llm.create_completion("def fib(n):", max_tokens=128, temperature=0)

How llama-cpp-python drafts (llama_cpp/llama.py, `Llama.generate`): after every forward it
calls `draft_model(input_ids)` with the whole sequence so far (prompt, accepted tokens and the
token just sampled), evaluates that token plus the returned drafts in one forward, and keeps
drafts left to right while the sampled token equals the draft (a chain). So the adapter:

- follows the sequence across calls: a call whose input extends the previous one by an
  accepted prefix of the last drafts plus one token is the same generation (those tokens are
  sent to the draft session, which learns them); anything else starts a new generation;
- drafts PLD, retrieval and learned outputs as a tree (the draft service's session, or the
  same drafting in process over a datastore) and hands out its best path;
- hands out only as much of that path as pays on this machine (`redraft.decoder.engines.
  pacing`: the forward cost is measured from its own calls), and stops asking for drafts while
  none pay;
- never lets a drafting failure reach generation: a dead service turns into prompt lookup.

What losslessness needs from the `Llama` (the `Llama` helper below sets it): flash attention
on, since with it off llama.cpp's multi-token CPU forward shifts quantized logits; fewer than
64 tokens per forward (llama.cpp's flash attention switches to a tiled kernel at 64 query rows),
so at most 62 drafts per call; and a logits buffer with a row per context position: with a
draft model and `logits_all=False`, llama-cpp-python sizes it to `n_batch` rows yet writes
every position's logits there, which fails once the context passes `n_batch` tokens
(`DraftingLlama` has the full buffer without computing the prompt's unused logits).

`RedraftDraft.metrics` counts drafts handed out and accepted with vLLM's `spec_decode_*`
meanings (`adapter_counters`); llama-cpp-python has no metrics registry, so
`adapter_prometheus.AdapterCollector` goes into the caller's (or `serve_http` serves it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaDraftModel
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("redraft's llama.cpp adapter needs llama-cpp-python: "
                      "pip install 'redraft[llamacpp]'") from exc

from redraft.decoder.engines.adapter_counters import AdapterCounters
from redraft.decoder.engines.pacing import ChainPacer
from redraft.decoder.engines.streams import (
    DraftOptions,
    DraftSource,
    DraftStream,
    EngineConfigError,
)
from redraft.proto.errors import ModelNotFound
from redraft.proto.models import resolve_model
from redraft.proto.params import DraftParams
from redraft.proto.tree import DEFAULT_BUDGET, DEFAULT_MAX_DEPTH, Chain, best_chain

log = logging.getLogger("redraft.engines")

MAX_DRAFTS = 62  # one sampled token + 62 drafts: 63 query rows, below the tiled kernel's 64


class RedraftDraft(LlamaDraftModel):
    """A llama-cpp-python draft model drafting from redraft (see the module docstring).

    Exactly one of `service` ("HOST:PORT" of `redraft serve`) or `datastore` (a datastore
    directory opened in this process). `budget`, `max_depth`, `corpora`, `tenant`, `token`
    and `learn` are the drafters' usual options; `tokenizer` (a model name, `.gguf` path or
    tokenizer) is checked against the datastore's when given (the `Llama` helper passes the
    model). `adaptive=False` hands out the whole best path every call (for measuring drafts
    at a fixed length) instead of what pays. `max_drafts` caps drafts per call (<= 62).
    """

    def __init__(self, *, service: str | None = None, datastore: str | None = None,
                 budget: int = DEFAULT_BUDGET, max_depth: int = DEFAULT_MAX_DEPTH,
                 corpora: Sequence[str] = (),
                 tenant: str = "", token: str | None = None, learn: bool = True,
                 tokenizer=None, timeout: float = 1.0, adaptive: bool = True,
                 max_drafts: int = MAX_DRAFTS) -> None:
        if isinstance(corpora, str):
            corpora = [c for c in corpora.split(",") if c]
        if (not isinstance(max_drafts, int) or isinstance(max_drafts, bool)
                or not 1 <= max_drafts <= MAX_DRAFTS):
            raise EngineConfigError(f"max_drafts must be 1..{MAX_DRAFTS} (llama.cpp stays "
                                    f"exact below 64 tokens per forward), got {max_drafts!r}")
        options = DraftOptions(DraftParams(budget=budget, max_depth=max_depth,
                                           corpora=tuple(corpora)),
                               tenant=tenant, learn=bool(learn))
        self.source = DraftSource(service=service, datastore=datastore, options=options,
                                  token=token, tokenizer=tokenizer, timeout=timeout)
        self.tokenizer_checked = tokenizer is not None
        self.max_drafts = min(max_drafts, max_depth)
        self.pacer = ChainPacer(max_drafts=self.max_drafts, adaptive=bool(adaptive))
        self._stream: DraftStream | None = None
        self._known = np.zeros(0, dtype=np.int64)  # the sequence as of the last call
        self._handed = Chain()  # the drafts handed out at the last call
        self._handed_at = 0.0
        self.stats = {"calls": 0, "generations": 0, "drafted_calls": 0, "drafted": 0,
                      "accepted": 0, "skipped_calls": 0, "draft_seconds": 0.0}
        self.metrics = AdapterCounters("llama_cpp")  # vLLM's spec_decode counters' meanings

    # ---- the LlamaDraftModel interface ---------------------------------------------------
    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        now = time.perf_counter()
        ids = np.asarray(input_ids).astype(np.int64, copy=False).ravel()
        self.stats["calls"] += 1
        self.metrics.steps += 1
        self._follow(ids, now)
        self._known = ids.copy()
        drafts = self._draft() if self.pacer.wants_drafts() else self._skip()
        self._handed = drafts
        self.stats["draft_seconds"] += time.perf_counter() - now
        self._handed_at = time.perf_counter()
        return np.asarray(drafts.tokens, dtype=np.intc)

    # ---- following the sequence --------------------------------------------------------
    def _follow(self, ids: np.ndarray, now: float) -> None:
        """Feed the tokens added since the last call to the stream, or open a new stream when
        `ids` does not continue the last call: a continuation is the last call's sequence,
        then an accepted prefix of the drafts handed out, then exactly one sampled token."""
        known, handed = self._known, self._handed
        m, n = len(known), len(ids)
        extra = n - m - 1  # drafts accepted, if this continues the last call
        if (self._stream is not None and 0 <= extra <= len(handed)
                and np.array_equal(ids[:m], known)
                and np.array_equal(ids[m:m + extra], handed.tokens[:extra])):
            if len(handed):
                self.pacer.verified(handed.probs, handed.sources, extra)
                self.stats["accepted"] += extra
                self.metrics.accepted(handed.sources, extra)
            self.pacer.forward(1 + len(handed), now - self._handed_at)
            self._stream.extend(ids[m:].tolist())
            return
        self._end_generation()
        self.stats["generations"] += 1
        self._stream = self.source.open(ids.tolist())

    def _draft(self) -> Chain:
        start = time.perf_counter()
        chain = best_chain(self._stream.propose(), self.max_drafts)
        self.pacer.drafted(time.perf_counter() - start)
        keep = self.pacer.choose(chain.probs, chain.sources)
        chain = chain.head(keep)
        if keep:
            self.stats["drafted_calls"] += 1
            self.stats["drafted"] += keep
            self.metrics.drafted(chain.sources)
        return chain

    def _skip(self) -> Chain:
        self.stats["skipped_calls"] += 1
        self.metrics.skipped_steps += 1
        return Chain()

    # ---- lifecycle ---------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        """Raise TokenizerMismatch unless the model's (name or `.gguf` path) tokenizer is the
        datastore's."""
        self.source.check_tokenizer(model)
        self.tokenizer_checked = True

    @property
    def failures(self) -> int:
        """Times the draft service failed and prompt lookup took over."""
        return self.source.failures

    def _end_generation(self) -> None:
        stream, self._stream = self._stream, None
        self._handed = Chain()
        if stream is not None:
            stream.close()

    def close(self) -> None:
        """End the current generation (its output becomes final for learning) and release the
        service connection or datastore."""
        self._end_generation()
        self.source.close()

    def __enter__(self) -> RedraftDraft:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def model_path(model: str | None = None) -> str:
    """The `.gguf` file of a model name (default: the embedded default model) or path."""
    source = resolve_model(model)
    if not source.gguf_file:
        raise EngineConfigError(f"llama.cpp needs a .gguf model; {model!r} is not one")
    return os.path.join(source.path, source.gguf_file)


class DraftingLlama(llama_cpp.Llama):
    """A `llama_cpp.Llama` that computes every row's logits only in the forwards that verify
    drafts (one sampled token + at most 62 drafts); a longer forward, the prompt's, computes
    the last row's only, as plain decoding does.

    Why: llama-cpp-python needs logits for all rows to verify drafts, and its `logits_all=True`
    also computes them for every prompt token, which costs up to ~15% more CPU time on long
    prompts (the output layer per row) for logits nobody reads. Built with `logits_all=True`,
    so that its logits buffer has a row for every context position, and then run with
    `logits_all` off outside draft verification: completions asking for `logprobs` get
    llama-cpp-python's own error (pass `logits_all=True` to `Llama` for those).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["logits_all"] = True
        super().__init__(*args, **kwargs)
        self._logits_all = False

    def eval(self, tokens: Sequence[int]) -> None:
        if self.draft_model is None or len(tokens) > MAX_DRAFTS + 1:
            return super().eval(tokens)
        self._logits_all = True
        try:
            return super().eval(tokens)
        finally:
            self._logits_all = False


def Llama(model: str | None = None, *, draft_model: LlamaDraftModel | None = None,
          **kwargs: Any) -> llama_cpp.Llama:
    """A `llama_cpp.Llama` set up for lossless drafting: flash attention on, and a
    `DraftingLlama` (logits for every row where drafts are verified) unless `logits_all=True`
    is asked for (every row's logits everywhere, e.g. for prompt logprobs). `model` is a
    `.gguf` path or model name (default: the embedded default model). A `RedraftDraft`
    without a tokenizer is checked against this model's. Other keyword arguments go to
    `llama_cpp.Llama`; `flash_attn=False` is refused."""
    if kwargs.get("flash_attn") is False:
        raise EngineConfigError("flash_attn=False: llama.cpp's multi-token CPU forward then "
                                "changes the logits, so drafting would change the output")
    path = model_path(model)
    if isinstance(draft_model, RedraftDraft) and not draft_model.tokenizer_checked:
        try:
            draft_model.check_model(path)
        except ModelNotFound as exc:  # transformers cannot read this GGUF's vocabulary:
            log.warning("not checking the datastore's tokenizer against %s: %s", path, exc)
    kwargs["flash_attn"] = True
    if draft_model is None or kwargs.get("logits_all"):
        return llama_cpp.Llama(model_path=path, draft_model=draft_model, **kwargs)
    kwargs.pop("logits_all", None)
    return DraftingLlama(model_path=path, draft_model=draft_model, **kwargs)
