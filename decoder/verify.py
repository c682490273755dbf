"""Tree verification: the only code that touches transformers internals (mask, positions, cache).

One decoding step feeds the *root* (the last token, not yet in the cache) followed by the
draft tree's nodes. Row 0 of the returned logits predicts the first new token; row i + 1
predicts the token after node i. The forward also returns each row's final (post-norm)
hidden state, which learned drafters (Medusa heads) read instead of running a forward of
their own: the verifier runs the model's body and applies its LM head itself, so the hidden
states cost nothing extra. Each row may attend to the cached prefix, the root, and its
own ancestors only, with `position_ids = L + depth`.

Two ways to run the model, chosen per model:

- the lean forward (`redraft.decoder.lean`) for plain Llama/Qwen2 stacks on a CPU: the
  model's own flat cache, and its linear layers on the blocks its GGUF file ships (the block
  kernel, `redraft.decoder.block_linear`, where it has a fast path for the model's dtype on
  this CPU) or on packed oneDNN weights of the dense copy (float32 or bfloat16);
- its Hugging Face modules otherwise, with a 4-D additive float mask `[1, 1, N, L + N]` in
  the model's dtype (transformers 5.x: a bool mask is silently misread under eager
  attention, and the cache is passed as `cache=`), on packed linear layers where they
  apply, and in bfloat16 with attention computed in float32 (CPU attention in bfloat16 is
  5-10x slower for a few queries).

`exact` forwards make every row's logits bitwise what a one-token forward at its position
computes, whatever else the forward holds. They are the default on blocks (any dtype: the
block kernel and `lean.RowAttention` compute each row alone by construction, at no cost)
and for bfloat16 and float16 elsewhere (one-row packed linear calls run as two, and
attention is `lean.RowAttention` in the lean forward, `lean.ExactAttention` through the
modules). Plain decoding (a one-token forward per step, through the same verifier) and
speculative decoding then give the same tokens by construction, although low-precision
logits tie or nearly tie often. Dense float32 uses a batched masked attention (ties are
rare enough there; see the docs).

After acceptance, `commit` keeps the root's and the accepted nodes' key/value entries and
drops every rejected node, so the cache always equals what a plain sequential decode would
have built.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from redraft.decoder import block_linear
from redraft.decoder.kernels import PackedFused, can_pack, packed_calls, packed_linears
from redraft.decoder.lean import (
    CausalAttention,
    ExactAttention,
    ExactPlan,
    LeanStack,
    MaskedAttention,
    RowAttention,
    exact_attention,
    plain_stack,
)
from redraft.proto.errors import RedraftError
from redraft.proto.tree import Tree
from transformers import DynamicCache

# A long prompt goes into the cache in chunks of this many tokens (the lean forward's
# attention scores are [chunk, context]: bounded memory, and no slower per token).
PREFILL_CHUNK = 256


class UnsupportedModel(RedraftError):
    """A model whose cache layout the verifier cannot compact (e.g. sliding-window layers)."""


@dataclass
class ForwardOutput:
    """What one verification forward gives the loop: rows are root, then tree nodes."""

    logits: torch.Tensor  # [N + 1, V] float32
    hidden: torch.Tensor | None  # [N + 1, H] final hidden states (model dtype); None if the
    # model's logits are not its LM head applied to its body's output (see `_split_model`)


def tree_mask_rows(tree: Tree) -> list[list[int]]:
    """For each of the N + 1 rows (root, then nodes), the in-tree rows it may attend to."""
    rows: list[list[int]] = [[0]]
    for i, parent in enumerate(tree.parents):
        rows.append(rows[parent + 1] + [i + 1])
    return rows


class TreeVerifier:
    """Owns the KV cache of one generation and runs tree forwards over it.

    `packed_kernels` lets the model's linear layers run on pre-packed oneDNN weights where
    that applies (float32 or bfloat16 on a CPU, see `kernels`): through the lean forward
    where the model is a plain stack (`lean=None`: wherever it applies), else through the
    modules, for the forward sizes where packed kernels are the faster kind on this machine
    now (`choose_kernels`, see `kernels.KernelChoice`; without it, or in `exact` mode,
    packed for every forward). `exact=None` is exact for bfloat16 and float16 models. It
    counts the forwards that really ran on packed weights, and times each tree forward, on
    the wall clock (the decoding loop learns its own overhead from it) and on `cost_clock`
    (what corrects the cost curve).
    """

    def __init__(self, model, packed_kernels: bool = True, choose_kernels: bool = True,
                 exact: bool | None = None, lean: bool | None = None,
                 block_weights: bool = True) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if lean is None:
            lean = packed_kernels and can_pack(self.dtype, self.device) and plain_stack(model)
        blocks = (model_blocks(model, self.dtype) if lean and packed_kernels and block_weights
                  else None)
        # on blocks every dtype is exact: its kernels make it so at no cost
        low = self.dtype in (torch.bfloat16, torch.float16) or blocks is not None
        self.exact = low if exact is None else exact
        self.runner = (_LeanRunner(model, self.exact, blocks) if lean else
                       _ModuleRunner(model, packed_kernels, choose_kernels, self.exact))
        self.kernels = self.runner.kernels
        self.choice = self.runner.choice
        self._pending = 0  # tree rows in the cache that `commit` has not resolved yet
        self._started = False
        self.forwards = 0  # target forwards run, prefills included
        self.packed_forwards = 0  # of those, the ones whose linear layers ran packed
        self.last_forward_seconds = 0.0  # wall clock of the last tree forward
        self.last_forward_cost = 0.0  # the same forward on `cost_clock`

    @property
    def on_blocks(self) -> bool:
        """Whether the linear layers run on the model file's own blocks (the block kernel)."""
        return self.runner.name == "lean blocks"

    @property
    def kind(self) -> str:
        """Which forward runs, for cost-curve keys and reports (e.g. "lean exact")."""
        kind = self.runner.name
        if self.on_blocks:  # the block kernel's path: AMX and AVX512-BF16 cost differently
            kind += f" {block_linear.kernel_path(self.dtype)}"
        if self.kernels is not None:
            kind += " packed" if self.choice is None else " chosen per size"
        return kind + (" exact" if self.exact else "")

    @property
    def cached_len(self) -> int:
        """Tokens whose keys/values are in the cache (excluding an unresolved tree)."""
        return self.runner.length() - self._pending

    def reset(self) -> None:
        self.runner.reset()
        self._pending = 0
        self._started = True

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> None:
        """Start a generation: put `ids` (the context minus its last token) into a fresh cache."""
        self.reset()
        self.runner.refresh()  # weights may have changed since the last generation
        self.extend(ids)

    @torch.inference_mode()
    def extend(self, ids: list[int]) -> None:
        """Append `ids` to the cache: a causal forward that computes no logits."""
        if self._pending:
            raise RuntimeError("extend during a pending tree_forward")
        if not self._started:
            self.reset()
        if not ids:
            return
        with self._kernels(len(ids), exact=False):
            self.runner.extend(list(ids))

    @torch.inference_mode()
    def tree_forward(self, root: int, tree: Tree, last: int = 0) -> ForwardOutput:
        """One target forward over root + tree: float32 logits [N + 1, V] and hidden states
        (with `last` > 0, of the last `last` rows only: a draft model reads one row)."""
        if not self._started:
            self.reset()
        if self._pending:
            raise RuntimeError("tree_forward called twice without commit")
        n = len(tree) + 1
        ids = [root, *tree.tokens]
        depths = [0, *tree.depths()]
        start, cost_start = time.perf_counter(), self.cost_clock()
        with self._kernels(n, self.exact):
            out = self.runner.forward(ids, depths, tree_mask_rows(tree), last, self.exact)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_seconds = time.perf_counter() - start
        self.last_forward_cost = self.cost_clock() - cost_start
        self._pending = n
        return out

    def cost_clock(self) -> float:
        """The clock a forward's cost is read on: this thread's CPU time on a CPU with one
        torch thread (time other processes held the core is not the forward's cost, and on a
        shared machine it is most of the wall clock's noise; memory stalls still count), the
        wall clock elsewhere."""
        if self.device.type == "cpu" and torch.get_num_threads() == 1:
            return time.thread_time()
        return time.perf_counter()

    @contextlib.contextmanager
    def _kernels(self, rows: int, exact: bool) -> Iterator[None]:
        """One target forward of `rows` tokens, on the kernels chosen for that size; counts
        the kernels it really ran on and feeds its cost back to the choice."""
        choice = None if exact else self.choice
        packed = self.kernels is not None and (choice is None or choice.packed(rows))
        before, start = packed_calls() + block_linear.calls(), self.cost_clock()
        with self.runner.kernels_active(packed, exact):
            yield
        if choice is not None:
            choice.record(rows, packed, self.cost_clock() - start)
        self.forwards += 1
        self.packed_forwards += packed_calls() + block_linear.calls() > before

    def commit(self, accepted: list[int]) -> None:
        """Keep the root and the accepted nodes (tree indices along one path), drop the rest."""
        n = self._pending
        if n == 0:
            raise RuntimeError("commit without a pending tree_forward")
        self._pending = 0
        base = self.runner.length() - n  # cache length before the tree: index of the root row
        self.runner.keep(base, list(accepted), n)

    def truncate(self, length: int) -> None:
        """Keep only the first `length` cached tokens (a draft model rolling back its drafts)."""
        if self._pending:
            raise RuntimeError("truncate during a pending tree_forward")
        if self.cached_len > length:
            self.runner.crop(length)


# -- the lean forward -----------------------------------------------------------------------


class LeanKernels:
    """The lean forward's packed linear kernels, reported like `kernels.PackedLinears`."""

    choice = None

    def __init__(self, stack: LeanStack, seconds: float) -> None:
        self.stack = stack
        self.forwards = stack.linears
        self.pack_seconds = seconds
        self.repacked = 0

    def refresh(self) -> None:
        start = time.perf_counter()
        self.repacked += self.stack.refresh()
        self.pack_seconds += time.perf_counter() - start


def model_blocks(model, dtype: torch.dtype) -> dict | None:
    """The model's linear layers as the blocks its file ships (`block_linear.model_blocks`),
    where the block kernel has a fast path for `dtype` on this CPU; else None (dense)."""
    if not block_linear.fast(dtype):
        return None
    return block_linear.model_blocks(model)


class _LeanRunner:
    """The model through `lean.LeanStack` in its own dtype: on the GGUF's own blocks where
    `blocks` maps its layers (the block kernel), else on packed dense weights."""

    choice = None

    def __init__(self, model, exact: bool, blocks: dict | None = None) -> None:
        param = next(model.parameters())
        start = time.perf_counter()
        if blocks is not None:
            self.name = "lean blocks"
            linear = functools.partial(block_linear.fused, blocks, param.dtype)
        else:
            self.name = "lean"
            linear = functools.partial(PackedFused, min_rows=2 if exact else 1)
        self.stack = LeanStack(model, linear, param.dtype, exact)
        self.kernels = LeanKernels(self.stack, time.perf_counter() - start)

    def length(self) -> int:
        return self.stack.length

    def reset(self) -> None:
        self.stack.length = 0

    def refresh(self) -> None:
        self.kernels.refresh()

    def kernels_active(self, packed: bool, exact: bool):
        return contextlib.nullcontext()

    def extend(self, ids: list[int]) -> None:
        # On blocks a prompt chunk attends in the kernel too (5-12% of a prefill, measured),
        # so that nothing in the cache depends on the thread count: with every linear, norm
        # and attention thread-invariant, plain output is the same at any --threads.
        rows = self.name == "lean blocks" and RowAttention.fits(self.stack)
        for i in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[i : i + PREFILL_CHUNK]
            start = self.stack.length
            attention = (RowAttention([list(range(r + 1)) for r in range(len(chunk))]) if rows
                         else CausalAttention())
            self.stack.run(chunk, range(start, start + len(chunk)), attention)

    def forward(self, ids: list[int], depths: list[int], rows: list[list[int]], last: int,
                exact: bool) -> ForwardOutput:
        past = self.stack.length
        if not exact:
            attention = MaskedAttention(rows)
        elif RowAttention.fits(self.stack):
            attention = RowAttention(rows)
        else:  # heads the kernel does not take (tiny test models)
            attention = ExactAttention(rows)
        hidden = self.stack.run(ids, [past + d for d in depths], attention)[-last:]
        normed = self.stack.final(hidden)
        return ForwardOutput(self.stack.logits(normed), normed)

    def keep(self, base: int, accepted: list[int], n: int) -> None:
        self.stack.keep(base, [base, *(base + 1 + a for a in accepted)])

    def crop(self, length: int) -> None:
        self.stack.truncate(length)


# -- the Hugging Face modules -----------------------------------------------------------------


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


class _ModuleRunner:
    """The model through its Hugging Face modules and a `DynamicCache`."""

    name = "modules"

    def __init__(self, model, packed_kernels: bool, choose_kernels: bool, exact: bool) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kernels = packed_linears(model) if packed_kernels else None
        # exact forwards always run packed: a per-size choice would mix two roundings
        self.choice = (self.kernels.choice if self.kernels is not None and choose_kernels
                       and not exact else None)
        self._split = _split_model(model)
        self._cache_kw = _cache_kwarg(self._split[0] if self._split else model)
        self._keep_kw = "logits_to_keep" in inspect.signature(model.forward).parameters
        # attention in float32 where the model computes in less (see the module docstring)
        self._attention = _register_attention() if self.dtype != torch.float32 else None
        self.cache = None

    def length(self) -> int:
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def reset(self) -> None:
        self.cache = _make_cache(self.model)

    def refresh(self) -> None:
        if self.kernels is not None:
            self.kernels.refresh()

    @contextlib.contextmanager
    def kernels_active(self, packed: bool, exact: bool) -> Iterator[None]:
        cfg = self.model.config
        before = getattr(cfg, "_attn_implementation_internal", None)
        if self._attention is not None:
            cfg._attn_implementation_internal = self._attention[exact]
        try:
            with self.kernels.active(exact) if packed else contextlib.nullcontext():
                yield
        finally:
            if self._attention is not None:
                cfg._attn_implementation_internal = before

    def extend(self, ids: list[int]) -> None:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        kwargs = {self._cache_kw: self.cache, "use_cache": True}
        # The vocabulary projection of a long prompt is waste: only the cache is wanted.
        if self._split is not None:
            self._split[0](input_ids=x, **kwargs)
            return
        if self._keep_kw:
            kwargs["logits_to_keep"] = 1
        self.model(input_ids=x, **kwargs)

    def forward(self, ids: list[int], depths: list[int], rows: list[list[int]], last: int,
                exact: bool) -> ForwardOutput:
        past, n = self.length(), len(ids)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.tensor([[past + d for d in depths]], dtype=torch.long,
                                 device=self.device)
        kwargs = {self._cache_kw: self.cache, "use_cache": True, "position_ids": positions}
        if n > 1:
            allowed = torch.zeros((n, past + n), dtype=torch.bool, device=self.device)
            allowed[:, :past] = True
            for row, cols in enumerate(rows):
                allowed[row, [past + c for c in cols]] = True
            mask = torch.zeros((1, 1, n, past + n), dtype=self.dtype, device=self.device)
            mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            kwargs["attention_mask"] = mask
        # A single token needs no mask: it may see everything, as in plain decoding.
        token = _EXACT_ROWS.set((past, rows) if exact else None)
        try:
            if self._split is None:
                logits = self.model(input_ids=x, **kwargs).logits[0, -last:]
                return ForwardOutput(logits.float(), None)
            body, head = self._split
            hidden = body(input_ids=x, **kwargs).last_hidden_state[0, -last:]
            return ForwardOutput(head(hidden).float(), hidden)
        finally:
            _EXACT_ROWS.reset(token)

    def keep(self, base: int, accepted: list[int], n: int) -> None:
        k = len(accepted)
        if accepted == list(range(k)):
            # The accepted path is the first k nodes in order: dropping the tail is enough.
            if n - 1 - k > 0:
                self.crop(base + 1 + k)
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

    def crop(self, length: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False):
                raise UnsupportedModel("sliding-window cache layers are not supported")
        if self.length() > length:
            self.cache.crop(length - self.length())  # a negative count: tokens to remove


# The rows of the tree forward in progress (cached length, each row's visible rows), for the
# exact attention function; None outside exact forwards.
_EXACT_ROWS: contextvars.ContextVar = contextvars.ContextVar("redraft_exact_rows",
                                                             default=None)
_ATTENTION_NAMES = ("redraft_f32", "redraft_exact")


def _f32_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                   is_causal=None, **kwargs):
    """Hugging Face attention function: SDPA in float32 on lower-precision inputs."""
    dtype = query.dtype
    q, k, v = query.float(), key.float(), value.float()
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    causal = mask is None and q.shape[2] > 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                         is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).to(dtype), None


def _exact_module_attention(module, query, key, value, attention_mask, dropout=0.0,
                            scaling=None, is_causal=None, **kwargs):
    """Hugging Face attention function: `lean.exact_attention` inside exact tree forwards,
    float32 SDPA elsewhere (prompt chunks)."""
    rows = _EXACT_ROWS.get()
    if rows is None or query.shape[0] != 1:
        return _f32_attention(module, query, key, value, attention_mask, dropout, scaling)
    past, visible = rows
    _, heads, n, dim = query.shape
    kv = key.shape[1]
    plan = ExactPlan(past, visible, kv, heads // kv, dim)
    if scaling is not None:
        plan.scale = scaling
    # the layout `exact_attention` reads: values with a trailing column of ones, and room
    # past the last key for a tail read as one run of `plan.width` slots (masked there)
    room = torch.ones(kv, plan.width, dim, dtype=torch.float32, device=key.device)
    keys = torch.cat([key[0].float(), room], dim=1)
    values = torch.cat([torch.cat([value[0].float(), room], dim=1),
                        torch.ones(kv, keys.shape[1], 1, dtype=torch.float32,
                                   device=value.device)], dim=-1)
    out = exact_attention(plan, query[0].transpose(0, 1), keys, values)  # [n, heads, dim]
    return out.unsqueeze(0).to(query.dtype), None


def _register_attention() -> dict[bool, str]:
    """The attention functions' names for (not exact, exact), registered with transformers."""
    # lazy: transformers internals, only for models run through their modules in low precision
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # lazy: as above

    for name, fn in zip(_ATTENTION_NAMES, (_f32_attention, _exact_module_attention)):
        ALL_ATTENTION_FUNCTIONS.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return dict(zip((False, True), _ATTENTION_NAMES))
