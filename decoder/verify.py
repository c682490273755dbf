"""Tree verification: the only code that touches transformers internals (mask, positions, cache).

One decoding step feeds the *root* (the last token, not yet in the cache) followed by the
draft tree's nodes. Row 0 of the returned logits predicts the first new token; row i + 1
predicts the token after node i. The forward also returns each row's final (post-norm)
hidden state, which learned drafters (Medusa heads) read instead of running a forward of
their own: the verifier runs the model's body and applies its LM head itself, so the hidden
states cost nothing extra. Each row may attend to the cached prefix, the root, and its
own ancestors only, which is expressed as a 4-D additive float mask `[1, 1, N, L + N]` in the
model's dtype, with `position_ids = L + depth` (transformers 5.x: a bool mask is silently
misread under eager attention, and the cache is passed as `cache=`).

After acceptance, `commit` keeps the root's and the accepted nodes' key/value entries and
drops every rejected node, so the cache always equals what a plain sequential decode would
have built.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from redraft.decoder.kernels import packed_calls, packed_linears
from redraft.proto.errors import RedraftError
from redraft.proto.tree import Tree
from transformers import DynamicCache


class UnsupportedModel(RedraftError):
    """A model whose cache layout the verifier cannot compact (e.g. sliding-window layers)."""


@dataclass
class ForwardOutput:
    """What one verification forward gives the loop: rows are root, then tree nodes."""

    logits: torch.Tensor  # [N + 1, V] float32
    hidden: torch.Tensor | None  # [N + 1, H] final hidden states (model dtype); None if the
    # model's logits are not its LM head applied to its body's output (see `_split_model`)


def _split_model(model):
    """(body, lm_head) such that model(x).logits == lm_head(body(x).last_hidden_state), or None.

    True of the usual causal LMs (Llama, Qwen2, GPT-2, ...). Models that post-process their
    logits (soft-capping, scaling) fail the check at construction and run whole instead.
    """
    body = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if body is None or body is model or head is None:
        return None
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return None
    return body, head


def _make_cache(model):
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older signature without config
        return DynamicCache()


def _cache_kwarg(model) -> str:
    """transformers 5.x calls it `cache`; earlier releases `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def tree_mask_rows(tree: Tree) -> list[list[int]]:
    """For each of the N + 1 rows (root, then nodes), the in-tree rows it may attend to."""
    rows: list[list[int]] = [[0]]
    for i, parent in enumerate(tree.parents):
        rows.append(rows[parent + 1] + [i + 1])
    return rows


class TreeVerifier:
    """Owns the KV cache of one generation and runs tree forwards over it.

    `packed_kernels` lets the model's linear layers run on pre-packed oneDNN weights where
    that applies (float32 on a CPU, see `kernels`), for the forward sizes where they are the
    faster kind on this machine now (`choose_kernels`, see `kernels.KernelChoice`; without
    it, packed for every forward); elsewhere it changes nothing. It counts the forwards that
    really ran on packed weights, and times each tree forward, on the wall clock (the decoding
    loop learns its own overhead from it) and on `cost_clock` (what corrects the cost curve).
    """

    def __init__(self, model, packed_kernels: bool = True, choose_kernels: bool = True) -> None:
        self.model = model
        self.kernels = packed_linears(model) if packed_kernels else None
        self.choice = self.kernels.choice if self.kernels is not None and choose_kernels else None
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._split = _split_model(model)
        self._cache_kw = _cache_kwarg(self._split[0] if self._split else model)
        self._keep_kw = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.cache = None
        self._pending = 0  # tree rows in the cache that `commit` has not resolved yet
        self.forwards = 0  # target forwards run, prefills included
        self.packed_forwards = 0  # of those, the ones whose linear layers ran packed
        self.last_forward_seconds = 0.0  # wall clock of the last tree forward
        self.last_forward_cost = 0.0  # the same forward on `cost_clock`

    @property
    def cached_len(self) -> int:
        """Tokens whose keys/values are in the cache (excluding an unresolved tree)."""
        if self.cache is None:
            return 0
        return int(self.cache.get_seq_length()) - self._pending

    def reset(self) -> None:
        self.cache = _make_cache(self.model)
        self._pending = 0

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> None:
        """Start a generation: put `ids` (the context minus its last token) into a fresh cache."""
        self.reset()
        if self.kernels is not None:
            self.kernels.refresh()  # weights may have changed since the last generation
        self.extend(ids)

    @torch.inference_mode()
    def extend(self, ids: list[int]) -> None:
        """Append `ids` to the cache: a causal forward that computes no logits."""
        if self._pending:
            raise RuntimeError("extend during a pending tree_forward")
        if self.cache is None:
            self.reset()
        if not ids:
            return
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        kwargs = {self._cache_kw: self.cache, "use_cache": True}
        # The vocabulary projection of a long prompt is waste: only the cache is wanted.
        if self._split is not None:
            with self._kernels(len(ids)):
                self._split[0](input_ids=x, **kwargs)
            return
        if self._keep_kw:
            kwargs["logits_to_keep"] = 1
        self._forward(x, kwargs)

    @torch.inference_mode()
    def tree_forward(self, root: int, tree: Tree, last: int = 0) -> ForwardOutput:
        """One target forward over root + tree: float32 logits [N + 1, V] and hidden states
        (with `last` > 0, of the last `last` rows only: a draft model reads one row)."""
        if self.cache is None:
            self.reset()
        if self._pending:
            raise RuntimeError("tree_forward called twice without commit")
        past = self.cached_len
        n = len(tree) + 1
        ids = torch.tensor([[root, *tree.tokens]], dtype=torch.long, device=self.device)
        depth = [0, *tree.depths()]
        positions = torch.tensor([[past + d for d in depth]], dtype=torch.long, device=self.device)
        kwargs = {self._cache_kw: self.cache, "use_cache": True, "position_ids": positions}
        if n > 1:
            allowed = torch.zeros((n, past + n), dtype=torch.bool, device=self.device)
            allowed[:, :past] = True
            for row, cols in enumerate(tree_mask_rows(tree)):
                allowed[row, [past + c for c in cols]] = True
            mask = torch.zeros((1, 1, n, past + n), dtype=self.dtype, device=self.device)
            mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            kwargs["attention_mask"] = mask
        # A single token needs no mask: it may see everything, as in plain decoding.
        start, cost_start = time.perf_counter(), self.cost_clock()
        out = self._forward(ids, kwargs, last)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_seconds = time.perf_counter() - start
        self.last_forward_cost = self.cost_clock() - cost_start
        self._pending = n
        return out

    def _forward(self, ids: torch.Tensor, kwargs: dict, last: int = 0) -> ForwardOutput:
        with self._kernels(ids.shape[1]):
            if self._split is None:
                logits = self.model(input_ids=ids, **kwargs).logits[0, -last:]
                return ForwardOutput(logits.float(), None)
            body, head = self._split
            hidden = body(input_ids=ids, **kwargs).last_hidden_state[0, -last:]
            return ForwardOutput(head(hidden).float(), hidden)

    def cost_clock(self) -> float:
        """The clock a forward's cost is read on: this thread's CPU time on a CPU with one
        torch thread (time other processes held the core is not the forward's cost, and on a
        shared machine it is most of the wall clock's noise; memory stalls still count), the
        wall clock elsewhere."""
        if self.device.type == "cpu" and torch.get_num_threads() == 1:
            return time.thread_time()
        return time.perf_counter()

    @contextlib.contextmanager
    def _kernels(self, rows: int) -> Iterator[None]:
        """One target forward of `rows` tokens, on the kernels chosen for that size; counts
        the kernels it really ran on and feeds its cost back to the choice."""
        packed = self.kernels is not None and (self.choice is None or self.choice.packed(rows))
        before, start = packed_calls(), self.cost_clock()
        with self.kernels.active() if packed else contextlib.nullcontext():
            yield
        if self.choice is not None:
            self.choice.record(rows, packed, self.cost_clock() - start)
        self.forwards += 1
        self.packed_forwards += packed_calls() > before

    def commit(self, accepted: list[int]) -> None:
        """Keep the root and the accepted nodes (tree indices along one path), drop the rest."""
        n = self._pending
        if n == 0:
            raise RuntimeError("commit without a pending tree_forward")
        total = int(self.cache.get_seq_length())
        base = total - n  # cache length before the tree: index of the root row
        k = len(accepted)
        self._pending = 0
        if accepted == list(range(k)):
            # The accepted path is the first k nodes in order: dropping the tail is enough.
            if n - 1 - k > 0:
                self._crop(n - 1 - k)
            return
        idx = torch.tensor([base + 1 + a for a in accepted], dtype=torch.long)
        for layer in self.cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or getattr(layer, "is_sliding", False):
                raise UnsupportedModel(
                    f"cache layer {type(layer).__name__} cannot be compacted for tree decoding"
                )
            i = idx.to(keys.device)
            layer.keys = torch.cat([keys[..., : base + 1, :], keys.index_select(-2, i)], dim=-2)
            layer.values = torch.cat(
                [values[..., : base + 1, :], values.index_select(-2, i)], dim=-2
            )

    def truncate(self, length: int) -> None:
        """Keep only the first `length` cached tokens (a draft model rolling back its drafts)."""
        if self._pending:
            raise RuntimeError("truncate during a pending tree_forward")
        if self.cached_len > length:
            self._crop(self.cached_len - length)

    def _crop(self, count: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False):
                raise UnsupportedModel("sliding-window cache layers are not supported")
        self.cache.crop(-count)
