"""The lean forward of a Llama-style model: its own weights, one plain function per stage, a
flat KV cache of its own (after gpt-fast).

Why not the Hugging Face modules: on the default model a one-token forward spends as much
time in per-module and per-op overhead (seven projections per layer, the cache object, the
mask machinery) as in its matmuls. Here the query/key/value and gate/up projections are one
matmul each, the cache is two preallocated float32 tensors per layer, and a layer is a few
dozen tensor ops: in bfloat16 with packed oneDNN kernels a one-token forward costs about half
of the float32 packed forward through the modules. On the model's own blocks with
`RowAttention` the whole layer loop is one call into the kernel (`_blocks.layers`), which runs
the same stages as `LeanStack.run`'s loop, bit for bit.

One stack, two users, parameterized by the linear kernel and the activations' dtype: the
verifier (`redraft.decoder.verify`: packed float32 or bfloat16 matmuls, the model's dtype)
and the int8 draft decoder (`redraft.decoder.models.int8_decoder`: int8 matmuls, float32
activations). Activations keep Hugging Face's rounding points (norms computed in float32 and
rounded back, rotary and the SiLU gate in the activations' dtype), so a bfloat16 forward
gives the modules' logits. Keys and values are stored and attended to in float32: they are
rounded to the model's dtype first, so nothing is lost, and CPU attention in bfloat16 is 5-10x
slower than in float32 for a few queries.

Attention is a strategy the caller passes per forward: `CausalAttention` (a prompt chunk,
drafting), `MaskedAttention` (tree verification, one batched attention), `RowAttention`
(tree verification in the compiled kernel, every row exactly what a one-token forward
computes, by construction) or `ExactAttention` (the same property arranged around torch's
matmuls; the modules' path uses it). Only the plain pre-norm Llama/Qwen2 layer (RMSNorm,
rotary attention with grouped keys, SiLU-gated MLP, full attention everywhere) is built this
way: `plain_stack` says whether a model is one, and other models run through their modules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from redraft.decoder import block_linear
from redraft.decoder.native import _blocks

_FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_NORM_KINDS = {torch.float32: _blocks.KIND_F32, torch.bfloat16: _blocks.KIND_BF16}
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj"}

Linear = Callable[[torch.Tensor], torch.Tensor]
# Makes one linear kernel computing the given layers' outputs side by side.
LinearFactory = Callable[[Sequence[torch.nn.Linear]], Linear]


def plain_stack(model) -> bool:
    """Whether every layer of the model is the plain Llama/Qwen2 layer this module runs."""
    cfg = model.config
    if type(model).__name__ not in _FAMILIES or getattr(cfg, "hidden_act", None) != "silu":
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False
    if next(model.parameters()).device.type != "cpu":
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if {n for n, _ in attn.named_children()} != _ATTENTION:  # e.g. Qwen3's q/k norms
            return False
        if {n for n, _ in mlp.named_children()} - {"act_fn"} != _MLP:
            return False
        if any(type(getattr(attn, n)) is not torch.nn.Linear for n in _ATTENTION):
            return False
        if any(type(getattr(mlp, n)) is not torch.nn.Linear for n in _MLP):
            return False
    return True


@dataclass
class LeanLayer:
    norm1: torch.Tensor
    qkv: Linear
    out: Linear
    norm2: torch.Tensor
    gate_up: Linear
    down: Linear


class LeanStack:
    """A plain Llama/Qwen2 model's forward over its own weights, with a flat KV cache.

    `run` feeds tokens after the `length` cached ones and returns their final hidden states
    before the last norm; `final` applies the norm, `logits` the LM head; `keep` and
    `truncate` edit the cache. `dtype` is the activations' (the norms' weights are cast to
    it); `exact` stores each value row with a trailing 1 (for `ExactAttention`).
    """

    def __init__(self, model, linear: LinearFactory, dtype: torch.dtype,
                 exact: bool = False) -> None:
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.dtype = dtype
        self.exact = exact
        body = model.model
        self.embed = body.embed_tokens.weight
        self.rotary = body.rotary_emb
        self.final_norm = body.norm.weight.detach().to(dtype)
        self.lm_head = linear([model.get_output_embeddings()])
        self.layers = [
            LeanLayer(layer.input_layernorm.weight.detach().to(dtype),
                      linear([layer.self_attn.q_proj, layer.self_attn.k_proj,
                              layer.self_attn.v_proj]),
                      linear([layer.self_attn.o_proj]),
                      layer.post_attention_layernorm.weight.detach().to(dtype),
                      linear([layer.mlp.gate_proj, layer.mlp.up_proj]),
                      linear([layer.mlp.down_proj]))
            for layer in body.layers
        ]
        self.linears = [self.lm_head] + [f for la in self.layers
                                         for f in (la.qkv, la.out, la.gate_up, la.down)]
        self.keys: list[torch.Tensor] = []  # per layer [kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []  # the same, + 1 column of ones when exact
        self.length = 0  # tokens in the cache
        # Whether a forward whose every layer runs on blocks with `RowAttention` runs its
        # layers in one compiled call (the same bits as this module's loop; tests compare).
        self.compiled_layers = True
        self._table: tuple[tuple, torch.Tensor | None] | None = None

    def refresh(self) -> int:
        """Re-pack the linear kernels whose layers' weights changed; how many did."""
        self._table = None
        return sum(bool(getattr(f, "refresh", lambda: False)()) for f in self.linears)

    # -- the cache ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def reserve(self, length: int) -> None:
        """Room in the cache for `length` tokens (grown by doubling, contents kept)."""
        have = self.capacity
        if length <= have:
            return
        size = max(length, 2 * have, 256)
        width = self.head_dim + self.exact
        for store, cols in ((self.keys, self.head_dim), (self.values, width)):
            for i in range(len(self.layers)):
                # ones: the exact attention's trailing column; elsewhere any finite value
                grown = torch.ones((self.kv_heads, size, cols), dtype=torch.float32)
                if i < len(store):
                    grown[:, :have] = store[i]
                    store[i] = grown
                else:
                    store.append(grown)

    @torch.inference_mode()
    def keep(self, base: int, slots: Sequence[int]) -> None:
        """Move the entries at `slots` (in order) to `base`, `base + 1`, ...; drop the rest."""
        k = len(slots)
        if list(slots) != list(range(base, base + k)):
            idx = torch.tensor(list(slots), dtype=torch.long)
            for store in (self.keys, self.values):
                for t in store:
                    t[:, base : base + k] = t.index_select(1, idx)
        self.length = base + k

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    # -- the stages of one forward ---------------------------------------------------------

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as Hugging Face rounds it: in float32, back to the activations' dtype,
        then scaled. In the compiled kernel for float32 and bfloat16 (one call where torch
        runs about ten ops; each row alone, in a fixed order)."""
        kind = _NORM_KINDS.get(x.dtype)
        if kind is None or x.device.type != "cpu":
            return weight * F.rms_norm(x.float(), weight.shape, None, self.eps).to(x.dtype)
        x = x.contiguous()
        out = torch.empty_like(x)
        _blocks.rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                         weight.data_ptr(), self.eps, out.data_ptr(), kind)
        return out

    def run(self, tokens: Sequence[int], positions: Sequence[int], attention) -> torch.Tensor:
        """Feed `tokens` (at `positions`) after the cached ones; their hidden states [n, H]
        before the final norm. `attention(stack, layer, queries)` attends the new rows."""
        n, start = len(tokens), self.length
        end = start + n
        self.reserve(end)
        x = self.embed[torch.tensor(list(tokens), dtype=torch.long)].to(self.dtype)  # [n, H]
        pos = torch.tensor([list(positions)], dtype=torch.long)
        cos, sin = (t[0].contiguous() for t in self.rotary(x, pos))  # [n, D]
        heads, kv, dim = self.heads, self.kv_heads, self.head_dim
        kind = _NORM_KINDS.get(self.dtype)
        attention.prepare(self, start, n)
        table = self._layer_table(attention)
        if table is not None:
            x = x.contiguous()
            _blocks.layers(table.data_ptr(), len(self.layers), x.data_ptr(), n, x.shape[1],
                           heads, kv, dim, self.layers[0].down.run.weight.k, self.eps, kind,
                           cos.data_ptr(), sin.data_ptr(), self.capacity,
                           self.values[0].shape[-1], start, attention.slots.data_ptr(),
                           attention.offsets.data_ptr(), attention.scale,
                           torch.get_num_threads(), True)
            block_linear.ran(4 * len(self.layers))
            self.length = end
            return x
        for i, layer in enumerate(self.layers):
            h = layer.qkv(self.norm(x, layer.norm1)).view(n, heads + 2 * kv, dim)
            if kind is not None and dim % 2 == 0:  # in the kernel: one call, same rounding
                h = h.contiguous()
                q = torch.empty((n, heads, dim), dtype=torch.float32)
                keys, values = self.keys[i], self.values[i]
                _blocks.rotate(h.data_ptr(), n, heads, kv, dim, cos.data_ptr(), sin.data_ptr(),
                               kind, keys.data_ptr(), values.data_ptr(), keys.shape[1],
                               values.shape[-1], start, q.data_ptr())
            else:
                qk = h[:, : heads + kv]  # queries and keys rotate together
                qk = qk * cos.unsqueeze(1) + _rotate_half(qk) * sin.unsqueeze(1)
                self.keys[i][:, start:end] = qk[:, heads:].transpose(0, 1)
                self.values[i][:, start:end, :dim] = h[:, heads + kv :].transpose(0, 1)
                q = qk[:, :heads]
            attn = attention(self, i, q)  # [n, heads * dim], float32
            x = x + layer.out(attn.to(self.dtype))
            x = x + layer.down(self.silu_mul(layer.gate_up(self.norm(x, layer.norm2))))
        self.length = end
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of the fused gate/up rows, rounded as torch rounds them; in the
        kernel for float32 and bfloat16 (the compiled layer loop's own, so both loops give
        the same bits)."""
        kind = _NORM_KINDS.get(gate_up.dtype)
        if kind is None or gate_up.device.type != "cpu":
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
        _blocks.silu_mul(gate_up.data_ptr(), gate_up.numel() // gate_up.shape[-1], inter,
                         out.data_ptr(), kind, True)
        return out

    def _layer_table(self, attention) -> torch.Tensor | None:
        """The compiled layer loop's table (per layer: norms, blocks and their formats, the
        cache), or None where a layer needs this module's loop: dense kernels, another
        attention, another dtype."""
        if not (self.compiled_layers and isinstance(attention, RowAttention)
                and self.dtype in _NORM_KINDS and self.head_dim % 2 == 0 and self.layers):
            return None
        key = (self.capacity, self.keys[0].data_ptr())
        if self._table is None or self._table[0] != key:
            self._table = (key, self._build_table())
        return self._table[1]

    def _build_table(self) -> torch.Tensor | None:
        rows = []
        for i, layer in enumerate(self.layers):
            row = []
            for norm, linears in ((layer.norm1, (layer.qkv, layer.out)),
                                  (layer.norm2, (layer.gate_up, layer.down))):
                if norm.dtype != self.dtype or norm.device.type != "cpu":
                    return None
                row.append(norm.data_ptr())
                for f in linears:
                    run = getattr(f, "run", None)
                    if not isinstance(run, block_linear.BlockLinear) or run.dtype != self.dtype:
                        return None
                    row += [run.weight.data.data_ptr(), run.weight.fmt]
            rows.append(row + [self.keys[i].data_ptr(), self.values[i].data_ptr()])
        return torch.tensor(rows, dtype=torch.int64)

    def final(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden, self.final_norm)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed).float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# -- attention -------------------------------------------------------------------------------


class CausalAttention:
    """New rows see every cached token and each other causally (a prompt chunk, a draft)."""

    def prepare(self, stack: LeanStack, start: int, n: int) -> None:
        self.end = start + n
        # causal among the new rows; a single row sees everything and needs no mask
        self.mask = torch.ones(n, self.end, dtype=torch.bool).tril(start) if n > 1 else None

    def __call__(self, stack: LeanStack, layer: int, q: torch.Tensor) -> torch.Tensor:
        return _sdpa(stack, layer, q, self.end, self.mask)


class RowAttention:
    """Each row attends to exactly its own keys, the cached prefix then the new rows `rows[i]`
    lists (a draft tree's ancestors and itself), in that order, in the compiled kernel
    (`redraft.decoder.native`): every row runs the same operations whatever the other rows of
    the forward and the threads sharing it, so a tree row's output is bitwise what a
    one-token forward at its position computes, on any CPU, by construction. Float32, the
    keys and values read in place (each once for all the rows that share them)."""

    LANES = 16  # the kernel's head width must be a multiple of this

    def __init__(self, rows: Sequence[Sequence[int]]) -> None:
        self.rows = rows

    @classmethod
    def fits(cls, stack: LeanStack) -> bool:
        """Whether the kernel runs this model's heads (else `ExactAttention` does)."""
        return stack.head_dim % cls.LANES == 0 and stack.heads // stack.kv_heads <= 64

    def prepare(self, stack: LeanStack, start: int, n: int) -> None:
        self.past = start
        self.slots = torch.tensor([start + c for cols in self.rows for c in cols],
                                  dtype=torch.int32)
        self.offsets = torch.tensor([0, *itertools.accumulate(len(c) for c in self.rows)],
                                    dtype=torch.int64)
        self.scale = stack.head_dim ** -0.5

    def __call__(self, stack: LeanStack, layer: int, q: torch.Tensor) -> torch.Tensor:
        n, heads, dim = q.shape
        q = q.float().contiguous()
        keys, values = stack.keys[layer], stack.values[layer]
        out = torch.empty((n, heads, dim), dtype=torch.float32)
        _blocks.attend(q.data_ptr(), n, heads, stack.kv_heads, dim, keys.data_ptr(),
                       values.data_ptr(), keys.shape[1], values.shape[-1], self.past,
                       self.slots.data_ptr(), self.offsets.data_ptr(), self.scale,
                       out.data_ptr(), torch.get_num_threads(), True)
        return out.view(n, heads * dim)


class MaskedAttention:
    """Rows see the cached tokens and the new rows `rows[i]` lists (a draft tree's
    ancestors): one batched attention with a mask."""

    def __init__(self, rows: Sequence[Sequence[int]]) -> None:
        self.rows = rows

    def prepare(self, stack: LeanStack, start: int, n: int) -> None:
        self.end = start + n
        self.mask = None
        if n > 1:
            allowed = torch.zeros(n, self.end, dtype=torch.bool)
            allowed[:, :start] = True
            for r, cols in enumerate(self.rows):
                allowed[r, [start + c for c in cols]] = True
            self.mask = allowed

    def __call__(self, stack: LeanStack, layer: int, q: torch.Tensor) -> torch.Tensor:
        return _sdpa(stack, layer, q, self.end, self.mask)


def _sdpa(stack: LeanStack, layer: int, q: torch.Tensor, end: int,
          mask: torch.Tensor | None) -> torch.Tensor:
    n, dim = q.shape[0], stack.head_dim
    keys, values = stack.keys[layer][:, :end], stack.values[layer][:, :end, :dim]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, stack.heads * dim)


# Exact attention's layout: a row at position p attends to its keys 0..p as a body [0, A)
# and a tail [A, p], A = (p - LAG) // BLOCK * BLOCK: a function of p alone, so a tree row
# and the one-token forward at the same position split alike; the lag keeps the body inside
# the cached tokens for tree rows up to LAG deep.
BLOCK = 16
LAG = 16
_MIN_ROWS = 4  # query rows per matmul: fewer may take another kernel (other rounding)


class ExactAttention:
    """Batch-invariant tree attention: each row's output is bitwise what a one-token forward
    over the same keys computes, whatever the other rows of the forward and the tree's shape.

    A batched masked attention does not give that: a row's reductions run over another
    number of keys, in another order, than its one-token forward's (and CPU kernels round a
    few-row matmul differently from a many-row one). Here every row attends to exactly its
    own keys in their sequential order (the cached prefix, then its ancestors and itself) as
    a body and a tail split at a point that depends on its position only (see BLOCK, LAG):

    - the body is a run of cached keys, shared by the rows with the same split point: one
      matmul for all of them (M = rows x queries per key head, padded to 4 or more; CPU
      matmul rounds a row alike for every M >= 4);
    - the tail (at most LAG + BLOCK keys) is gathered per row in sequential order; its
      length is padded with masked keys to a multiple of 8 and at least 16 (shapes whose
      matmul and exp kernels round each element alike);
    - scores are exact-max-shifted and exponentiated, the values carry a column of ones so
      that one matmul per part yields both the weighted values and the softmax sum, and the
      two parts are added: the same float operations, in the same order, in every forward.

    Its cost: one extra matmul pair and a gather per layer, a few percent of a forward.
    """

    def __init__(self, rows: Sequence[Sequence[int]]) -> None:
        self.rows = rows

    def prepare(self, stack: LeanStack, start: int, n: int) -> None:
        self.plan = ExactPlan(start, self.rows, stack.kv_heads, stack.heads // stack.kv_heads,
                              stack.head_dim)

    def __call__(self, stack: LeanStack, layer: int, q: torch.Tensor) -> torch.Tensor:
        out = exact_attention(self.plan, q, stack.keys[layer], stack.values[layer])
        return out.reshape(q.shape[0], stack.heads * stack.head_dim)


class ExactPlan:
    """What `exact_attention` needs per forward (shared by every layer): each row's split
    point, tail slots and mask, and the query buffer."""

    def __init__(self, past: int, rows: Sequence[Sequence[int]], kv_heads: int, group: int,
                 head_dim: int) -> None:
        n = len(rows)
        self.n, self.kv, self.group = n, kv_heads, group
        self.padded = max(group, _MIN_ROWS)
        self.scale = head_dim ** -0.5
        seen = [[*range(past), *(past + c for c in cols)] for cols in rows]  # slots in order
        splits = [max(0, (len(s) - 1 - LAG) // BLOCK * BLOCK) for s in seen]
        tails = [s[a:] for s, a in zip(seen, splits)]
        width = max(16, -(-max(len(t) for t in tails) // 8) * 8)
        self.width = width
        # bodies: runs of cached keys (a view) where the split is at or before `past`,
        # else (rows deeper than LAG) the row's own gathered keys
        self.bodies: list[tuple[int, list[int], torch.Tensor | None]] = []
        shared: dict[int, list[int]] = {}
        for r, a in enumerate(splits):
            if 0 < a <= past:
                shared.setdefault(a, []).append(r)
            elif a > past:
                self.bodies.append((a, [r], torch.tensor(seen[r][:a], dtype=torch.long)))
        self.bodies[:0] = [(a, rs, None) for a, rs in shared.items()]
        first = tails[0][0]
        self.tail_view = first if all(t == list(range(first, first + len(t))) and
                                      t[0] == first for t in tails) else None
        if self.tail_view is None:
            self.slots = torch.tensor([t + [t[0]] * (width - len(t)) for t in tails],
                                      dtype=torch.long).view(-1)
        mask = torch.full((n, width), float("-inf"))
        for r, t in enumerate(tails):
            mask[r, : len(t)] = 0.0
        self.mask = mask.repeat(kv_heads, 1).view(kv_heads * n, 1, width)
        self.queries = torch.zeros(kv_heads, n, self.padded, head_dim)  # padding rows stay 0


def exact_attention(plan: ExactPlan, q: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor) -> torch.Tensor:
    """Attention of q [n, heads, D] over keys [kv, cap, D] and values [kv, cap, D + 1] (a
    trailing column of ones), float32, as `ExactAttention` describes: [n, heads, D]."""
    n, kv, group, padded, width = plan.n, plan.kv, plan.group, plan.padded, plan.width
    dim = keys.shape[-1]
    buf = plan.queries  # [kv, n, padded, D]
    torch.mul(q.view(n, kv, group, dim).transpose(0, 1), plan.scale, out=buf[:, :, :group])
    rows = n * padded
    if plan.tail_view is not None:  # every tail is the same run of slots: no gather
        a = plan.tail_view
        tail_keys, tail_values = keys[:, a : a + width], values[:, a : a + width]
        scores = torch.bmm(buf.view(kv, rows, dim), tail_keys.transpose(1, 2))
    else:
        tail_keys = keys.index_select(1, plan.slots).view(kv * n, width, dim)
        tail_values = values.index_select(1, plan.slots).view(kv * n, width, dim + 1)
        scores = torch.bmm(buf.view(kv * n, padded, dim), tail_keys.transpose(1, 2))
    scores = scores.view(kv * n, padded, width).add_(plan.mask)
    top = scores.amax(-1, keepdim=True).view(kv, n, padded, 1)
    body_scores = []
    for a, rs, gathered in plan.bodies:
        if gathered is None:
            qb = buf if len(rs) == n else buf[:, rs]
            s = torch.bmm(qb.reshape(kv, len(rs) * padded, dim), keys[:, :a].transpose(1, 2))
        else:
            s = torch.bmm(buf[:, rs].reshape(kv, padded, dim),
                          keys.index_select(1, gathered).transpose(1, 2))
        body_scores.append(s)
        best = s.amax(-1, keepdim=True).view(kv, len(rs), padded, 1)
        if len(rs) == n:
            torch.maximum(top, best, out=top)
        else:
            top[:, rs] = torch.maximum(top[:, rs], best)
    weights = torch.exp_(scores.view(kv, n, padded, width).sub_(top))
    if plan.tail_view is not None:
        out = torch.bmm(weights.view(kv, rows, width), tail_values)
    else:
        out = torch.bmm(weights.view(kv * n, padded, width), tail_values)
    out = out.view(kv, n, padded, dim + 1)
    for (a, rs, gathered), s in zip(plan.bodies, body_scores):
        shift = top if len(rs) == n else top[:, rs]
        w = torch.exp_(s.view(kv, len(rs), padded, a).sub_(shift))
        v = values[:, :a] if gathered is None else values.index_select(1, gathered)
        part = torch.bmm(w.view(kv, len(rs) * padded, a), v).view(kv, len(rs), padded,
                                                                    dim + 1)
        if len(rs) == n:
            out = part.add_(out)
        else:
            out[:, rs] = part + out[:, rs]
    out = out[:, :, :group]
    return (out[..., :dim] / out[..., dim:]).transpose(0, 1)
