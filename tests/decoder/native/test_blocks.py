"""The block kernel (decoder/native/_blocks.cpp) on every path this CPU has: against a float64
reference, and bit for bit the same for a row whatever the rows and threads sharing its call
(the property that keeps tree verification lossless). A failure names the CPU and the path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from redraft.decoder import block_linear
from redraft.decoder.block_linear import BlockLinear, BlockWeight, kernel_path
from redraft.decoder.budget import MAX_TREE_NODES
from redraft.decoder.native import _blocks

# The default model's linear shapes (out, in): fused query/key/value, attention output,
# fused gate/up, down, and the LM head (the Q8_0 embedding).
SHAPES = [(960, 576, "Q4_1"), (576, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1"),
          (49152, 576, "Q8_0")]
# every tree size up to 64 rows, then the size classes up to the largest fixed tree
ROWS = [*range(1, 65), 96, 128, 192, MAX_TREE_NODES, MAX_TREE_NODES + 1]
THREADS = sorted({1, 2, os.cpu_count() or 1})
KINDS = {torch.float32: _blocks.KIND_F32, torch.bfloat16: _blocks.KIND_BF16}


def random_blocks(n: int, k: int, fmt: str, seed: int = 0) -> BlockWeight:
    """n rows of random blocks with the scales a real model's have."""
    rng = np.random.default_rng(seed)
    blocks = k // 32
    d = rng.uniform(0.002, 0.02, (n, blocks, 1)).astype(np.float16).view(np.uint8)
    if fmt == "Q4_1":
        m = rng.uniform(-0.12, -0.01, (n, blocks, 1)).astype(np.float16).view(np.uint8)
        qs = rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8)
        raw = np.concatenate([d, m, qs], axis=2)
    elif fmt == "Q8_0":
        raw = np.concatenate([d, rng.integers(0, 256, (n, blocks, 32), dtype=np.uint8)], axis=2)
    elif fmt == "BF16":
        dense = torch.from_numpy(rng.normal(0, 0.05, (n, k)).astype(np.float32))
        raw = dense.to(torch.bfloat16).view(torch.uint8).numpy()
    else:  # F32
        raw = rng.normal(0, 0.05, (n, k)).astype(np.float32).view(np.uint8)
    return BlockWeight(torch.from_numpy(raw.reshape(n, -1).copy()), getattr(_blocks, fmt), n, k)


def machine(dtype: torch.dtype) -> str:
    """The CPU and the path, for failure messages."""
    return (f"CPU capability {torch.backends.cpu.get_cpu_capability()}, paths "
            f"{_blocks.paths()}, {dtype} on {kernel_path(dtype)}")


def on_path(dtype: torch.dtype, name: str):
    """`block_linear.on_path`, skipping the test where this CPU lacks that path."""
    if name not in _blocks.paths():
        pytest.skip(f"no {name} path on this CPU ({_blocks.paths()})")
    return block_linear.on_path(dtype, name)


@pytest.fixture(params=["default", "avx512bf16", "scalar"])
def path(request):
    """Each dtype on its default path, bfloat16 on AVX512-BF16 where that is not its default
    (an AMX CPU has both), then each on the scalar one; restored afterwards."""
    before = {kind: _blocks.path(kind) for kind in KINDS.values()}
    if request.param == "avx512bf16":
        if request.param not in _blocks.paths() or before[_blocks.KIND_BF16] == request.param:
            pytest.skip(f"avx512bf16 is not a second bf16 path here ({_blocks.paths()})")
        _blocks.use_path(_blocks.KIND_BF16, request.param)
    if request.param == "scalar":
        for kind in KINDS.values():
            _blocks.use_path(kind, "scalar")
    yield request.param
    for kind, name in before.items():
        _blocks.use_path(kind, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "BF16", "F32"])
def test_matches_a_float64_matmul_of_the_dequantized_weights(path, dtype, fmt):
    weight = random_blocks(200, 1536 if fmt == "Q4_1" else 576, fmt)
    x = torch.randn(7, weight.k).to(dtype)
    got = BlockLinear(weight, dtype)(x).double()
    dense = weight.dense().to(dtype).double()  # a bf16 model's weights are rounded so
    want = x.double() @ dense.T
    # float32: summation error only; bfloat16: the output's own rounding (2^-8) dominates
    tol = (1e-5 if dtype == torch.float32 else 8e-3) * want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= tol, f"{fmt} {dtype}: error {err:.3g} > {tol:.3g} ({machine(dtype)})"


def test_dequantized_weights_are_the_gguf_formula():
    """Q4_1: d * q + m (rounded after the product and after the sum); Q8_0: d * q."""
    w = random_blocks(3, 64, "Q4_1")
    raw = w.data.numpy().reshape(3, 2, 20)
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = raw[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
    assert np.array_equal(w.dense().numpy(), ((d * q) + m).reshape(3, 64))
    w8 = random_blocks(3, 64, "Q8_0")
    raw8 = w8.data.numpy().reshape(3, 2, 34)
    d8 = raw8[..., 0:2].copy().view(np.float16).astype(np.float32)
    q8 = raw8[..., 2:].copy().view(np.int8).astype(np.float32)
    assert np.array_equal(w8.dense().numpy(), (d8 * q8).reshape(3, 64))


@pytest.mark.parametrize("dtype,simd", [(torch.bfloat16, "amx"), (torch.bfloat16, "avx512bf16"),
                                        (torch.float32, "avx2")])
def test_a_rows_bits_never_depend_on_the_rows_or_threads_sharing_its_call(dtype, simd):
    """On each SIMD path this CPU has: every linear shape of the default model, every row
    count 1..64 and the size classes up to MAX_TREE_NODES, at 1, 2 and the machine's thread
    count: each row of a k-row call is bitwise that row of the largest call (so row 0 is the
    one-row call's). The scalar path: test_the_scalar_path_is_row_invariant_too."""
    before = torch.get_num_threads()
    torch.manual_seed(0)
    with on_path(dtype, simd):
        try:
            check_row_invariance(dtype)
        finally:
            torch.set_num_threads(before)


def check_row_invariance(dtype: torch.dtype) -> None:
    """Each row of every call is that row of the largest call (see the test above)."""
    for n, k, fmt in SHAPES:
        linear = BlockLinear(random_blocks(n, k, fmt), dtype)
        x = torch.randn(ROWS[-1], k).to(dtype)
        torch.set_num_threads(1)
        full = linear(x)
        for threads in THREADS:
            torch.set_num_threads(threads)
            for rows in ROWS if threads == 1 else [1, 2, 3, 16, 33, 64, ROWS[-1]]:
                got = linear(x[:rows])
                assert torch.equal(got, full[:rows]), (
                    f"[{n}, {k}] {fmt}: {rows} rows at {threads} threads differ from the "
                    f"same rows of a {ROWS[-1]}-row call at 1 thread ({machine(dtype)})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_scalar_path_is_row_invariant_too(dtype):
    before = _blocks.path(KINDS[dtype])
    _blocks.use_path(KINDS[dtype], "scalar")
    try:
        linear = BlockLinear(random_blocks(9, 576, "Q4_1"), dtype)
        x = torch.randn(17, 576).to(dtype)
        full = linear(x)
        for rows in range(1, 18):
            assert torch.equal(linear(x[:rows]), full[:rows]), machine(dtype)
    finally:
        _blocks.use_path(KINDS[dtype], before)


@pytest.mark.parametrize("simd", ["avx512bf16", "amx"])
def test_the_bf16_paths_agree(simd):
    """Each bf16 SIMD path against the scalar one, which writes out VDPBF16PS's documented
    semantics: equal bits for AVX512-BF16 on the CPUs this was built on (AMD Zen 4, Intel with
    AMX); AMX sums in its own order, within the accumulation's rounding, so a bf16 model on
    any path decodes alike."""
    linear = BlockLinear(random_blocks(64, 1536, "Q4_1"), torch.bfloat16)
    x = torch.randn(5, 1536).to(torch.bfloat16)
    with on_path(torch.bfloat16, simd):
        fast = linear(x)
    with on_path(torch.bfloat16, "scalar"):
        scalar = linear(x)
    diff = (fast.float() - scalar.float()).abs().max().item()
    assert diff <= 1e-2 * scalar.float().abs().max().item(), machine(torch.bfloat16)


def test_bad_shapes_and_formats_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        _blocks.row_bytes(_blocks.Q4_1, 40)
    with pytest.raises(ValueError, match="unsupported weight type"):
        _blocks.row_bytes(2, 64)  # Q4_0: not a format the kernel reads
    with pytest.raises(ValueError, match="does not run"):
        _blocks.use_path(_blocks.KIND_F32, "avx512bf16")
    with pytest.raises(ValueError, match="expected"):
        BlockLinear(random_blocks(4, 64, "Q8_0"), torch.float32)(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="uint8"):
        BlockWeight(torch.zeros(4, 68, dtype=torch.uint8), _blocks.Q8_0, 4, 96)


# -- attention ---------------------------------------------------------------------------------

KV, HEADS, DIM, CAPACITY = 3, 9, 64, 1400  # the default model's heads


PLAIN, BEST, AVX2 = 0, 1, 2  # the attention's builds


def attend(q, keys, values, past, rows, threads=1, build=BEST):
    """The kernel's attention of q [n, HEADS, DIM] over the prefix and each row's slots."""
    n = q.shape[0]
    slots = torch.tensor([past + c for cols in rows for c in cols], dtype=torch.int32)
    offsets = torch.tensor(np.cumsum([0] + [len(c) for c in rows]), dtype=torch.int64)
    out = torch.empty(n, HEADS, DIM)
    q = q.contiguous()
    _blocks.attend(q.data_ptr(), n, HEADS, KV, DIM, keys.data_ptr(), values.data_ptr(), CAPACITY,
                   values.shape[-1], past, slots.data_ptr(), offsets.data_ptr(), DIM ** -0.5,
                   out.data_ptr(), threads, build)
    return out


def tree_rows(n: int, branch: int = 5) -> list[list[int]]:
    """Root, then branches of up to `branch` nodes: each row's visible rows, itself last."""
    rows = [[0]]
    for i in range(n - 1):
        parent = -1 if i % branch == 0 else i - 1
        rows.append(rows[parent + 1] + [i + 1])
    return rows


@pytest.fixture(scope="module")
def cache():
    g = torch.Generator().manual_seed(1)
    return torch.randn(KV, CAPACITY, DIM, generator=g), torch.randn(KV, CAPACITY, DIM + 1,
                                                                   generator=g)


def test_attention_matches_a_float64_masked_softmax(cache):
    keys, values = cache
    past, rows = 300, tree_rows(20)
    n = len(rows)
    q = torch.randn(n, HEADS, DIM)
    got = attend(q, keys, values, past, rows)
    mask = torch.zeros(n, past + n, dtype=torch.bool)
    mask[:, :past] = True
    for r, cols in enumerate(rows):
        mask[r, [past + c for c in cols]] = True
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).double(), keys[:, : past + n].unsqueeze(0).double(),
        values[:, : past + n, :DIM].unsqueeze(0).double(), attn_mask=mask, enable_gqa=True)
    assert (got.double() - want[0].transpose(0, 1)).abs().max().item() < 1e-5


def test_an_attention_rows_bits_never_depend_on_the_rows_threads_or_build(cache):
    """Each row of a tree forward of 1..64 rows (and the size classes past it) equals that row
    computed alone, at 1, 2 and the machine's thread count, on the best build this CPU has
    (AVX-512 or AVX2), and the AVX2 and plain builds give the same bits."""
    keys, values = cache
    past = 700
    rows = tree_rows(ROWS[-1])
    q = torch.randn(len(rows), HEADS, DIM)
    alone = torch.stack([attend(q[r : r + 1], keys, values, past, [rows[r]])[0]
                         for r in range(len(rows))])
    for build, name in ((PLAIN, "plain"), (AVX2, "AVX2")):
        assert torch.equal(attend(q, keys, values, past, rows, build=build), alone), \
            f"the {name} build differs from the best one ({machine(torch.float32)})"
    for threads in THREADS:
        for n in ROWS if threads == 1 else [2, 16, 64, ROWS[-1]]:
            got = attend(q[:n], keys, values, past, rows[:n], threads=threads)
            assert torch.equal(got, alone[:n]), (
                f"{n} rows at {threads} threads differ from each row alone "
                f"(CPU capability {torch.backends.cpu.get_cpu_capability()})")


def test_wide_heads_and_a_ragged_prefix_give_every_build_the_same_bits():
    """Heads of 128 dimensions (the AVX-512 build's other width) over a prefix that is not a
    multiple of its 16 keys at a time: each row alone, together, and on every build."""
    g = torch.Generator().manual_seed(2)
    kv, heads, dim, capacity, past = 2, 4, 128, 200, 101
    keys, values = torch.randn(kv, capacity, dim, generator=g), torch.randn(kv, capacity, dim,
                                                                            generator=g)
    rows = tree_rows(21)
    q = torch.randn(len(rows), heads, dim, generator=g)

    def run(q, rows, build=BEST):
        slots = torch.tensor([past + c for cols in rows for c in cols], dtype=torch.int32)
        offsets = torch.tensor(np.cumsum([0] + [len(c) for c in rows]), dtype=torch.int64)
        out = torch.empty(q.shape[0], heads, dim)
        _blocks.attend(q.data_ptr(), q.shape[0], heads, kv, dim, keys.data_ptr(),
                       values.data_ptr(), capacity, dim, past, slots.data_ptr(),
                       offsets.data_ptr(), dim ** -0.5, out.data_ptr(), 1, build)
        return out

    together = run(q, rows)
    alone = torch.stack([run(q[r : r + 1].contiguous(), [rows[r]])[0] for r in range(len(rows))])
    assert torch.equal(together, alone)
    assert torch.equal(run(q, rows, PLAIN), together) and torch.equal(run(q, rows, AVX2), together)


def test_attention_refuses_inconsistent_shapes(cache):
    keys, values = cache
    q = torch.zeros(1, HEADS, DIM)
    slots = torch.zeros(1, dtype=torch.int32)
    offsets = torch.tensor([0, 1], dtype=torch.int64)
    with pytest.raises(ValueError, match="inconsistent"):
        _blocks.attend(q.data_ptr(), 1, HEADS, 4, DIM, keys.data_ptr(), values.data_ptr(),
                       CAPACITY, DIM + 1, 0, slots.data_ptr(), offsets.data_ptr(), 1.0,
                       q.data_ptr(), 1, True)  # 9 heads over 4 key heads
    with pytest.raises(ValueError, match="inconsistent"):
        _blocks.attend(q.data_ptr(), 1, HEADS, KV, DIM, keys.data_ptr(), values.data_ptr(),
                       CAPACITY, DIM + 1, 0, slots.data_ptr(), offsets.data_ptr(), 1.0,
                       q.data_ptr(), 1, 3)  # no such build


# -- the layer's other stages ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_into_the_cache_is_torchs_rounding_bit_for_bit(dtype):
    """Queries and keys rotated as Hugging Face rounds it (each product, then the sum, in the
    activations' dtype), keys and values landing in the float32 cache at their slots."""
    from redraft.decoder.lean import _rotate_half

    n, start = 5, 7
    h = torch.randn(n, HEADS + 2 * KV, DIM).to(dtype)
    angles = torch.rand(n, DIM // 2) * 10
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype).contiguous()
                for f in (torch.cos, torch.sin))
    keys, values = torch.zeros(KV, 32, DIM), torch.zeros(KV, 32, DIM + 1)
    q = torch.empty(n, HEADS, DIM)
    _blocks.rotate(h.data_ptr(), n, HEADS, KV, DIM, cos.data_ptr(), sin.data_ptr(),
                   KINDS[dtype], keys.data_ptr(), values.data_ptr(), 32, DIM + 1, start,
                   q.data_ptr())
    qk = h[:, : HEADS + KV]
    qk = qk * cos.unsqueeze(1) + _rotate_half(qk) * sin.unsqueeze(1)
    assert torch.equal(q, qk[:, :HEADS].float())
    assert torch.equal(keys[:, start : start + n], qk[:, HEADS:].transpose(0, 1).float())
    assert torch.equal(values[:, start : start + n, :DIM],
                       h[:, HEADS + KV :].transpose(0, 1).float())
    assert not keys[:, :start].any() and not values[:, start + n :].any()  # nothing else


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rows_alone_and_close_to_torchs(dtype):
    x = torch.randn(6, 576).to(dtype)
    w = (torch.rand(576) + 0.5).to(dtype)
    out = torch.empty_like(x)
    _blocks.rms_norm(x.data_ptr(), 6, 576, w.data_ptr(), 1e-5, out.data_ptr(), KINDS[dtype])
    want = w * torch.nn.functional.rms_norm(x.float(), w.shape, None, 1e-5).to(dtype)
    assert (out.float() - want.float()).abs().max().item() <= (1e-5 if dtype == torch.float32
                                                                 else 1e-2)
    one = torch.empty(1, 576, dtype=dtype)
    _blocks.rms_norm(x[3:4].contiguous().data_ptr(), 1, 576, w.data_ptr(), 1e-5,
                     one.data_ptr(), KINDS[dtype])
    assert torch.equal(one[0], out[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_are_their_formula_bit_for_bit(dtype):
    """Every build (AVX-512 where the CPU has it, else plain) computes exactly: 16 partial sums
    of squares added pairwise, scale = 1 / sqrt(sum / h + eps) in float32, then w * y with y
    rounded to the dtype first (as Hugging Face's LlamaRMSNorm rounds it)."""
    x = torch.randn(5, 576).to(dtype)
    w = (torch.rand(576) + 0.5).to(dtype)
    out = torch.empty_like(x)
    _blocks.rms_norm(x.data_ptr(), 5, 576, w.data_ptr(), 1e-5, out.data_ptr(), KINDS[dtype])
    xf = x.float()
    part = torch.zeros(5, 16)
    for j in range(0, 576, 16):
        part = part + xf[:, j : j + 16] * xf[:, j : j + 16]
    for width in (8, 4, 2, 1):
        part = part[:, :width] + part[:, width : 2 * width]
    eps = torch.tensor(1e-5, dtype=torch.float32)
    scale = 1.0 / torch.sqrt(part[:, 0] / torch.tensor(576.0) + eps)
    y = (xf * scale[:, None]).to(dtype).float()
    assert torch.equal(out, (w.float() * y).to(dtype)), machine(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_builds_agree_and_are_close_to_torchs(dtype):
    """SiLU(gate) * up: the AVX2 and plain builds give the same bits (specials included),
    within a rounding of torch's."""
    kind = _blocks.KIND_F32 if dtype == torch.float32 else _blocks.KIND_BF16
    rows, inter = 3, 1000  # not a multiple of 8: the tail runs the scalar formula
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(5)) * 8
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 200.0, -200.0, float("inf"),
                                   -float("inf")])
    gate_up[1, 7] = float("nan")
    gate_up = gate_up.to(dtype)
    outs = []
    for simd in (True, False):
        out = torch.empty(rows, inter, dtype=dtype)
        _blocks.silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr(), kind, simd)
        outs.append(out)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    nan = torch.isnan(outs[0])
    assert torch.equal(nan, torch.isnan(outs[1]))  # (a NaN's payload may differ)
    assert torch.equal(outs[0].view(bits)[~nan], outs[1].view(bits)[~nan])
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert torch.isnan(outs[0][1, 7]) and torch.isnan(want[1, 7])
    ok = torch.isfinite(want)
    tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(outs[0][ok].float(), want[ok].float(), **tol)
    assert torch.equal(outs[0][~ok & ~torch.isnan(want)], want[~ok & ~torch.isnan(want)])
