// The verifier's linear kernel: y = x W^T over a model's weights as it ships them (the
// GGUF's Q4_1 and Q8_0 blocks, or dense bfloat16 / float32 rows), for 1 to 64+ rows at once.
//
// Why: verifying a draft tree is a forward of many rows that a CPU can only afford if the
// weights are read once for all of them. Each group of output columns is dequantized once
// (in registers for a call of a few rows, else into a small buffer that stays in L1) and
// multiplied into every row of the call, so the bytes read per forward are the file's own,
// whatever the row count.
//
// Why it is exact: a row's result never depends on the other rows or on the thread count.
// Every row runs the same instruction sequence over its own accumulators (rows are grouped
// in tiles only to share the loads of the weights), the reduction over K always runs in one
// fixed order, and threads split output columns, never a reduction. So row 0 of a 64-row
// call equals the one-row call bit for bit, on every path.
//
// Paths, chosen once per process from the CPU's features (never per call):
//   bf16 activations: "amx" (Intel's tiles: TDPBF16PS, one instruction per block for 16
//     rows, so a tree's rows cost about what one row costs), else "avx512bf16" (VDPBF16PS:
//     weights rounded to bfloat16 as the dense copy rounds them, float32 accumulation), else
//     "scalar" (VDPBF16PS's semantics written out in C++, for CPUs without bf16 units);
//   float32 activations: "avx2" (AVX2 + FMA) or "scalar".
// The amx path sums in the order the hardware fixes, not VDPBF16PS's, so its last bits
// differ from the avx512bf16 path's: row-invariant on each, the same on neither.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define REDRAFT_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// GGML's type ids, as the GGUF file (and gguf-py's GGMLQuantizationType) numbers them.
constexpr int F32 = 0, Q4_1 = 3, Q8_0 = 8, BF16 = 30;
constexpr int QK = 32;  // weights per block (and the K granularity every path needs)
constexpr int NC = 4;   // output columns dequantized together

// Activations' kinds: float32 in and out, or bfloat16 in and out.
constexpr int KIND_F32 = 0, KIND_BF16 = 1;

size_t row_bytes(int fmt, size_t k) {
    switch (fmt) {
        case F32: return k * 4;
        case BF16: return k * 2;
        case Q4_1: return k / QK * 20;
        case Q8_0: return k / QK * 34;
    }
    return 0;
}

// -- scalar helpers: exact conversions -------------------------------------------------------

float f32_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
uint32_t bits_f32(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) {
        if (man == 0) return f32_bits(sign);
        while (!(man & 0x400)) { man <<= 1; --exp; }  // a subnormal half: normalize it
        ++exp;
        man &= 0x3ff;
    } else if (exp == 31) {
        return f32_bits(sign | 0x7f800000 | (man << 13));
    }
    return f32_bits(sign | ((exp + 112) << 23) | (man << 13));
}

float bf16_to_float(uint16_t b) { return f32_bits((uint32_t)b << 16); }

// Round to nearest even, as torch casts float32 to bfloat16 (NaN stays NaN).
uint16_t float_to_bf16(float f) {
    uint32_t u = bits_f32(f);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

// VDPBF16PS flushes denormal inputs and results to zero (and rounds to nearest even).
float flush(float f) {
    return (bits_f32(f) & 0x7f800000) == 0 ? f32_bits(bits_f32(f) & 0x80000000) : f;
}

// One block (or QK dense values) of a weight row as float32: d * q + m, rounded after the
// product and after the sum, as gguf-py's dequantization (and so the dense copy) computes.
void dequant_block(int fmt, const uint8_t* src, float* out) {
    switch (fmt) {
        case F32:
            std::memcpy(out, src, QK * 4);
            return;
        case BF16:
            for (int j = 0; j < QK; ++j) {
                uint16_t b;
                std::memcpy(&b, src + 2 * j, 2);
                out[j] = bf16_to_float(b);
            }
            return;
        case Q4_1: {
            uint16_t hd, hm;
            std::memcpy(&hd, src, 2);
            std::memcpy(&hm, src + 2, 2);
            const float d = half_to_float(hd), m = half_to_float(hm);
            for (int j = 0; j < 16; ++j) {
                const float lo = d * (float)(src[4 + j] & 15), hi = d * (float)(src[4 + j] >> 4);
                out[j] = lo + m;
                out[j + 16] = hi + m;
            }
            return;
        }
        case Q8_0: {
            uint16_t hd;
            std::memcpy(&hd, src, 2);
            const float d = half_to_float(hd);
            for (int j = 0; j < QK; ++j) out[j] = d * (float)(int8_t)src[2 + j];
            return;
        }
    }
}

size_t block_bytes(int fmt) { return row_bytes(fmt, QK); }

// -- the work of one call ------------------------------------------------------------------

struct Call {
    const void* x;      // [m, k] activations, row-major
    const uint8_t* w;   // [n] rows of row_bytes(fmt, k) bytes
    void* y;            // [m, n] output, row-major, the activations' kind
    size_t m, k, n;
    int fmt, kind;
    const uint32_t* packed = nullptr;  // the activations in the AMX tiles' layout, on that path
};

void store(const Call& c, size_t row, size_t col, float v) {
    if (c.kind == KIND_F32)
        static_cast<float*>(c.y)[row * c.n + col] = v;
    else
        static_cast<uint16_t*>(c.y)[row * c.n + col] = float_to_bf16(v);
}

// Scalar path. float32: a sequential sum of products rounded one by one. bfloat16: the
// weights rounded to bfloat16, then VDPBF16PS written out per lane (16 lanes, each adding
// its pairs' odd then even product, denormals flushed) and the lanes summed as the SIMD
// path's reduce does; so both paths give the same bits wherever the instruction follows
// its documented semantics (tests/decoder/native/test_blocks.py checks this CPU's).
float reduce16(const float* lane);

void columns_scalar(const Call& c, size_t col0, size_t col1) {
    const size_t k = c.k, bb = block_bytes(c.fmt), rb = row_bytes(c.fmt, k);
    std::vector<float> w(k);
    for (size_t col = col0; col < col1; ++col) {
        const uint8_t* row = c.w + col * rb;
        for (size_t b = 0; b < k / QK; ++b) dequant_block(c.fmt, row + b * bb, &w[b * QK]);
        if (c.kind == KIND_F32) {
            const float* x = static_cast<const float*>(c.x);
            for (size_t r = 0; r < c.m; ++r) {
                float acc = 0.0f;
                for (size_t j = 0; j < k; ++j) {
                    const float p = x[r * k + j] * w[j];
                    acc = acc + p;
                }
                store(c, r, col, acc);
            }
            continue;
        }
        for (size_t j = 0; j < k; ++j) w[j] = flush(bf16_to_float(float_to_bf16(w[j])));
        const uint16_t* x = static_cast<const uint16_t*>(c.x);
        for (size_t r = 0; r < c.m; ++r) {
            float lane[16] = {0};
            for (size_t j = 0; j < k; j += 32)
                for (int i = 0; i < 16; ++i) {
                    const float odd = flush(bf16_to_float(x[r * k + j + 2 * i + 1])) * w[j + 2 * i + 1];
                    lane[i] = flush(lane[i] + odd);
                    const float even = flush(bf16_to_float(x[r * k + j + 2 * i])) * w[j + 2 * i];
                    lane[i] = flush(lane[i] + even);
                }
            store(c, r, col, reduce16(lane));
        }
    }
}

// The lanes' sum as the SIMD path's reduce512 takes it (halves added pairwise:
// 16 -> 8 -> 4 -> 2 -> 1), so that the scalar path matches the SIMD one.
float reduce16(const float* lane) {
    float a[16];
    std::memcpy(a, lane, sizeof a);
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; ++i) a[i] = a[i] + a[i + width];
    return a[0];
}

#ifdef REDRAFT_X86

// The next group of columns' blocks, asked for while this group's rows multiply: the
// hardware's prefetchers do not see that far ahead of a dequantizing loop.
inline void prefetch_group(const uint8_t* p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// -- AVX512-BF16 ---------------------------------------------------------------------------

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,f16c")))

// One block of 32 weights as bfloat16, the dense copy's values bit for bit.
BF16_TARGET inline __m512bh dequant_block_bf16(int fmt, const uint8_t* src) {
    if (fmt == Q4_1) {
        // The block's 16 possible values, bf16(d * q + m) for q = 0..15, then each weight
        // picked from them by its nibble: one table per block, not 32 conversions. The
        // table fills both halves of the register, so a byte's stray fifth bit (VPERMW reads
        // five) picks the same entry: the low nibbles need no mask, the high ones one shift.
        int dm32;
        std::memcpy(&dm32, src, 4);  // d and m, two halfs
        const __m128 dm = _mm_cvtph_ps(_mm_set1_epi32(dm32));
        const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 t = _mm512_add_ps(_mm512_mul_ps(iota, d), m);
        const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t, t);
        const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 4)));
        const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004,
                                               0x0004000400040004, 0x0004000400040004, 0, 0, 0, 0);
        const __m512i idx = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(q), shift);  // lo | hi
        return (__m512bh)_mm512_permutexvar_epi16(idx, table);
    }
    __m512 lo, hi;
    if (fmt == Q8_0) {
        uint16_t hd;
        std::memcpy(&hd, src, 2);
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(hd));
        const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2));
        const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 18));
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
    } else if (fmt == F32) {
        lo = _mm512_loadu_ps(reinterpret_cast<const float*>(src));
        hi = _mm512_loadu_ps(reinterpret_cast<const float*>(src) + 16);
    } else {  // BF16
        return (__m512bh)_mm512_loadu_si512(src);
    }
    return _mm512_cvtne2ps_pbh(hi, lo);
}

BF16_TARGET void dequant_bf16_avx512(int fmt, const uint8_t* src, size_t k, uint16_t* out) {
    const size_t bb = block_bytes(fmt);
    for (size_t b = 0; b < k / QK; ++b, src += bb, out += QK)
        _mm512_storeu_si512(out, (__m512i)dequant_block_bf16(fmt, src));
}

// AVX-512 without bf16: what the reductions below and the attention's AVX-512 build need (a
// subset of BF16_TARGET, so the bf16 paths inline them).
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

// Sixteen bfloat16 values as float32 (exact), and float32 rounded to bfloat16 as
// float_to_bf16 rounds (to nearest even, a NaN kept a quiet NaN).
AVX512_TARGET inline __m512 load_bf16x16(const uint16_t* p) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
AVX512_TARGET inline __m256i to_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i even = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, even), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}
AVX512_TARGET inline __m512 round_bf16x16(__m512 v) {  // rounded to bfloat16, as float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}

// The lanes' sum, the order of reduce16 (written out: compilers' reduce intrinsics differ).
AVX512_TARGET inline float reduce512(__m512 v) {
    const __m256 hi = _mm512_extractf32x8_ps(v, 1);
    const __m256 a = _mm256_add_ps(_mm512_extractf32x8_ps(v, 0), hi);
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// Sixteen registers' lane sums at once, each in reduce512's order (i + i+8, i + i+4,
// i + i+2, 0 + 1): every level adds the same pairs, two or four registers packed into one by
// shuffles, so a tile's outputs cost 30 shuffles and 15 adds, not 16 reductions of 8
// dependent steps each (which cost a quarter of a 576-wide row's dot products). Register
// 4a + b's sum lands in lane 4b + a.
AVX512_TARGET inline __m512 reduce512_sixteen(const __m512* v) {
    __m512 w[8], z[4], q[2];
    for (int i = 0; i < 8; ++i)  // lanes 0-7 + lanes 8-15, two registers per result
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // 0-3 + 4-7 of each: one register per 128-bit chunk
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // 0-1 + 2-3 within each chunk
        q[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], 0x88),  // 0 + 1
                         _mm512_shuffle_ps(q[0], q[1], 0xDD));
}

// Rows per register tile of a call of many rows (6 measured no faster on Zen 4: VDPBF16PS's
// throughput is the bound); the rows past the last full tile run one by one, the same
// operations per row.
constexpr int BF16_ROWS = 4;

// A tile's weights, a 32-wide slice of each of its columns at a time. A call of many rows
// dequantizes a group of columns once into a buffer that its row tiles share
// (LoadedColumns); a call of a few rows, one tile of all its rows, dequantizes each slice in
// registers as it is needed (BlockColumns), saving the buffer's store and reload, and
// prefetches the next group's blocks as it goes (the hardware's prefetchers lose the
// interleaved streams of a group's columns: without it this path was slower, not faster).
// Both give the tile the same values, so a row's bits never depend on which ran.
struct LoadedColumns {
    const uint16_t* const* w;
    BF16_TARGET __m512bh operator()(int c, size_t j) const {
        return (__m512bh)_mm512_loadu_si512(w[c] + j);
    }
    void prefetch(size_t) const {}
};

template <int FMT, int C>
struct BlockColumns {
    static constexpr size_t BYTES = FMT == Q4_1 ? 20 : 34;  // block_bytes(FMT)
    const uint8_t* const* w;  // the group's C columns, one after another in memory
    size_t rb;                // bytes per column
    BF16_TARGET __m512bh operator()(int c, size_t j) const {
        return dequant_block_bf16(FMT, w[c] + j / QK * BYTES);
    }
    // The next group's bytes, as far into them as slice j is into this group's.
    // (Past the last group it names bytes past the weights: a prefetch never faults.)
    void prefetch(size_t j) const {
        const uintptr_t next = reinterpret_cast<uintptr_t>(w[C - 1]) + rb + j / QK * C * BYTES;
        for (size_t off = 0; off < C * BYTES; off += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T0);
    }
};

// R rows by C columns: each (row, column) its own accumulator, summed at the end in
// reduce512's order; a row's result is the same whatever R, C and Columns are.
template <int R, int C, class Columns>
BF16_TARGET void tile_bf16(const uint16_t* x, size_t k, const Columns& w, float out[][NC]) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (size_t j = 0; j < k; j += 32) {
        w.prefetch(j);
        __m512bh wv[C];
        for (int c = 0; c < C; ++c) wv[c] = w(c, j);
        for (int r = 0; r < R; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + j);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    if constexpr (R * C == 16) {
        alignas(64) float sums[16];
        _mm512_store_ps(sums, reduce512_sixteen(&acc[0][0]));
        for (int v = 0; v < 16; ++v) out[v / C][v % C] = sums[4 * (v % 4) + v / 4];
    } else {
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) out[r][c] = reduce512(acc[r][c]);
    }
}

// A call of R rows over FMT blocks, one tile of all its rows per group of C columns.
template <int FMT, int R, int C>
BF16_TARGET void few_rows_bf16(const Call& c, size_t col0, size_t col1) {
    const size_t rb = row_bytes(FMT, c.k);
    const uint16_t* x = static_cast<const uint16_t*>(c.x);
    for (size_t col = col0; col < col1; col += C) {
        const int nc = (int)std::min<size_t>(C, col1 - col);
        const uint8_t* w[C];
        for (int i = 0; i < C; ++i) w[i] = c.w + (col + std::min(i, nc - 1)) * rb;
        float out[R][NC];
        tile_bf16<R, C>(x, c.k, BlockColumns<FMT, C>{w, rb}, out);
        for (int i = 0; i < R; ++i)
            for (int j = 0; j < nc; ++j) store(c, i, col + j, out[i][j]);
    }
}

// Up to FEW_ROWS rows: one tile of all of them (4 columns to 6 rows, 2 columns past that:
// 8 to 28 accumulators, within the 32 registers). Faster than the shared buffer up to 14
// rows, measured on Zen 4 (one column per tile at 13-16 rows was slower).
constexpr size_t FEW_ROWS = 14;

template <int FMT>
BF16_TARGET void few_rows_bf16(const Call& c, size_t col0, size_t col1) {
    switch (c.m) {
        case 1: return few_rows_bf16<FMT, 1, NC>(c, col0, col1);
        case 2: return few_rows_bf16<FMT, 2, NC>(c, col0, col1);
        case 3: return few_rows_bf16<FMT, 3, NC>(c, col0, col1);
        case 4: return few_rows_bf16<FMT, 4, NC>(c, col0, col1);
        case 5: return few_rows_bf16<FMT, 5, NC>(c, col0, col1);
        case 6: return few_rows_bf16<FMT, 6, NC>(c, col0, col1);
        case 7: return few_rows_bf16<FMT, 7, 2>(c, col0, col1);
        case 8: return few_rows_bf16<FMT, 8, 2>(c, col0, col1);
        case 9: return few_rows_bf16<FMT, 9, 2>(c, col0, col1);
        case 10: return few_rows_bf16<FMT, 10, 2>(c, col0, col1);
        case 11: return few_rows_bf16<FMT, 11, 2>(c, col0, col1);
        case 12: return few_rows_bf16<FMT, 12, 2>(c, col0, col1);
        case 13: return few_rows_bf16<FMT, 13, 2>(c, col0, col1);
        default: return few_rows_bf16<FMT, 14, 2>(c, col0, col1);
    }
}

BF16_TARGET void columns_bf16_avx512(const Call& c, size_t col0, size_t col1) {
    if (c.m <= FEW_ROWS && c.fmt == Q4_1) return few_rows_bf16<Q4_1>(c, col0, col1);
    if (c.m <= FEW_ROWS && c.fmt == Q8_0) return few_rows_bf16<Q8_0>(c, col0, col1);
    const size_t k = c.k, rb = row_bytes(c.fmt, k);
    thread_local std::vector<uint16_t> buffer;
    if (c.fmt != BF16) buffer.resize(NC * k);
    const uint16_t* x = static_cast<const uint16_t*>(c.x);
    for (size_t col = col0; col < col1; col += NC) {
        const int nc = (int)std::min<size_t>(NC, col1 - col);
        const uint16_t* w[NC];
        for (int i = 0; i < NC; ++i) {
            const size_t src = col + std::min(i, nc - 1);  // a column past the end: not stored
            if (c.fmt == BF16) {
                w[i] = reinterpret_cast<const uint16_t*>(c.w + src * rb);
            } else {
                dequant_bf16_avx512(c.fmt, c.w + src * rb, k, &buffer[i * k]);
                w[i] = &buffer[i * k];
            }
        }
        if (c.fmt != BF16 && col + 2 * NC <= col1) prefetch_group(c.w + (col + NC) * rb, NC * rb);
        float out[BF16_ROWS][NC];
        size_t r = 0;
        for (; r + BF16_ROWS <= c.m; r += BF16_ROWS) {
            tile_bf16<BF16_ROWS, NC>(x + r * k, k, LoadedColumns{w}, out);
            for (int i = 0; i < BF16_ROWS; ++i)
                for (int j = 0; j < nc; ++j) store(c, r + i, col + j, out[i][j]);
        }
        for (; r < c.m; ++r) {
            tile_bf16<1, NC>(x + r * k, k, LoadedColumns{w}, out);
            for (int j = 0; j < nc; ++j) store(c, r, col + j, out[0][j]);
        }
    }
}

// -- AMX: Intel's tiles, bfloat16 -----------------------------------------------------------
//
// The weights are the tiles' A operand: 16 output columns by a 32-wide slice of K, each tile
// row one block dequantized exactly as the AVX512-BF16 path does it (the same bfloat16
// values). The activations are the B operand, packed once per call in the tiles' pair layout:
// for each 16 rows and each slice, 16 pairs of K by 16 rows. So a block is dequantized once
// and multiplied into 16 rows by one instruction, up to 64 rows per pass over the weights:
// the linears of a 16-row tree cost about 1.2x one row's (4.4x on VDPBF16PS, measured on one
// Intel Xeon with AMX). TDPBF16PS computes each output from its
// own row and column alone, in an order the hardware fixes, so a row's bits never depend on
// the rows or threads sharing its call (tested); they differ from the AVX512-BF16 path's in
// the last bits, which is why a CPU runs one path for every row count.

#define AMX_TARGET __attribute__((target( \
    "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,f16c,amx-tile,amx-bf16")))

constexpr size_t AMX_COLS = 16;  // output columns per weights tile (its rows)
constexpr size_t AMX_ROWS = 16;  // activation rows per activations and sums tile (their columns)
constexpr size_t AMX_PASS = 64;  // rows per pass over the weights: four sums tiles
constexpr size_t AMX_TILE = 256; // 32-bit entries in one packed activations tile

// The activations in the tiles' pair layout: [16-row group][slice][pair of K][row] as 32-bit
// pairs; a group's tile for slice s starts at ((group * slices) + s) * AMX_TILE.
void pack_rows_amx(const uint16_t* x, size_t m, size_t k, uint32_t* out) {
    const size_t slices = k / QK;
    for (size_t r = 0; r < m; ++r) {
        const size_t g = r / AMX_ROWS, n = r % AMX_ROWS;
        for (size_t s = 0; s < slices; ++s)
            for (size_t p = 0; p < 16; ++p)
                std::memcpy(&out[((g * slices + s) * 16 + p) * 16 + n], x + r * k + s * QK + 2 * p, 4);
    }
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tile 0: the weights. Tiles 1 and 7: a full group's activations (alternating, so a load
// need not wait for the previous product). Tile 2: the last, partial group's activations.
// Tiles 3-6: each group's sums (the partial one's narrower).
AMX_TARGET void configure_tiles(size_t full, size_t part) {
    TileConfig t;
    for (int i = 0; i < 8; ++i) {
        t.rows[i] = 16;
        t.colsb[i] = 64;
    }
    if (part) t.colsb[2] = t.colsb[3 + full] = (uint16_t)(part * 4);
    _tile_loadconfig(&t);
}

// A sums tile ([16 columns][16 rows]) into rows row0.. of the bfloat16 output, columns
// col..col+nc: each row's 16 sums gathered and rounded as float_to_bf16 rounds them (one
// store() per value cost 40% of a 16-row forward).
BF16_TARGET void emit_sums(const Call& c, const float* sums, size_t row0, size_t rows, size_t col,
                           size_t nc) {
    const __m512i across = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)AMX_ROWS));
    const __mmask16 keep = (__mmask16)((1u << nc) - 1);
    for (size_t j = 0; j < rows; ++j)
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(c.y) + (row0 + j) * c.n + col, keep,
                                 to_bf16x16(_mm512_i32gather_ps(across, sums + j, 4)));
}

// One pass of up to 64 rows (from r0) over a group of columns whose weights tile for slice s
// `weights(s)` loads into tile 0; its sums into the output.
template <class Weights>
AMX_TARGET inline void amx_pass(const Call& c, size_t r0, size_t col, size_t nc, const Weights& weights) {
    const size_t slices = c.k / QK, step = slices * AMX_TILE;  // from one group's tiles to the next's
    const size_t rows = std::min(AMX_PASS, c.m - r0), full = rows / AMX_ROWS, part = rows % AMX_ROWS;
    const uint32_t* xg = c.packed + r0 / AMX_ROWS * step;
    alignas(64) float sums[AMX_COLS * AMX_ROWS];
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    for (size_t s = 0; s < slices; ++s) {
        weights(s);
        const uint32_t* xs = xg + s * AMX_TILE;
        if (full > 0) { _tile_loadd(1, xs, 64); _tile_dpbf16ps(3, 0, 1); }
        if (full > 1) { _tile_loadd(7, xs + step, 64); _tile_dpbf16ps(4, 0, 7); }
        if (full > 2) { _tile_loadd(1, xs + 2 * step, 64); _tile_dpbf16ps(5, 0, 1); }
        if (full > 3) { _tile_loadd(7, xs + 3 * step, 64); _tile_dpbf16ps(6, 0, 7); }
        if (part) {
            _tile_loadd(2, xs + full * step, 64);
            if (full == 0) _tile_dpbf16ps(3, 0, 2);
            else if (full == 1) _tile_dpbf16ps(4, 0, 2);
            else if (full == 2) _tile_dpbf16ps(5, 0, 2);
            else _tile_dpbf16ps(6, 0, 2);
        }
    }
    for (size_t g = 0; g < full + (part ? 1 : 0); ++g) {
        if (g == 0) _tile_stored(3, sums, 64);
        else if (g == 1) _tile_stored(4, sums, 64);
        else if (g == 2) _tile_stored(5, sums, 64);
        else _tile_stored(6, sums, 64);
        emit_sums(c, sums, r0 + g * AMX_ROWS, g < full ? AMX_ROWS : part, col, nc);
    }
}

// A group of 16 columns' weights (a column past the end repeats the last one, not stored),
// slice by slice, dequantized into a staging tile as each is needed, the next group's bytes
// prefetched meanwhile.
template <int FMT>
struct StagedColumns {
    const uint8_t* w;  // the group's first column
    size_t rb, nc, spread;
    uint16_t* stage;   // [16][32], 64-byte aligned
    AMX_TARGET void dequantize(size_t s, uint16_t* out, size_t stride) const {
        for (size_t i = 0; i < AMX_COLS; ++i)
            _mm512_storeu_si512(out + i * stride,
                                (__m512i)dequant_block_bf16(FMT, w + std::min(i, nc - 1) * rb + s * block_bytes(FMT)));
        if (FMT != BF16) {
            const uint8_t* next = w + AMX_COLS * rb;
            for (size_t off = (s * spread + 63) / 64 * 64; off < (s + 1) * spread; off += 64)
                _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T0);
        }
    }
    AMX_TARGET void operator()(size_t s) const {
        dequantize(s, stage, QK);
        _tile_loadd(0, stage, 64);
    }
};

// The same group dequantized once into a buffer ([16 columns][k]) that several passes load.
struct BufferedColumns {
    const uint16_t* buffer;
    size_t k;
    AMX_TARGET void operator()(size_t s) const { _tile_loadd(0, buffer + s * QK, k * 2); }
};

// Up to 64 rows: one pass per group of 16 columns, on StagedColumns. More rows (a prompt
// chunk): each group dequantized once into a BufferedColumns (in the core's cache) that all
// its passes load their tiles from. A sum's order is the same either way.
template <int FMT>
AMX_TARGET void columns_amx(const Call& c, size_t col0, size_t col1) {
    const size_t k = c.k, slices = k / QK, rb = row_bytes(FMT, k);
    const size_t spread = (AMX_COLS * rb + slices - 1) / slices;  // next group's bytes per slice
    alignas(64) uint16_t stage[AMX_COLS * QK];
    thread_local std::vector<uint16_t> buffer;
    const bool passes = c.m > AMX_PASS;
    if (passes) buffer.resize(AMX_COLS * k);
    size_t shape = 0;  // the rows of the pass the tiles are configured for
    for (size_t col = col0; col < col1; col += AMX_COLS) {
        const size_t nc = std::min(AMX_COLS, col1 - col);
        const StagedColumns<FMT> staged{c.w + col * rb, rb, nc, spread, stage};
        if (passes)
            for (size_t s = 0; s < slices; ++s) staged.dequantize(s, &buffer[s * QK], k);
        for (size_t r0 = 0; r0 < c.m; r0 += AMX_PASS) {
            const size_t rows = std::min(AMX_PASS, c.m - r0);
            if (rows != shape) configure_tiles(rows / AMX_ROWS, rows % AMX_ROWS);
            shape = rows;
            if (passes)
                amx_pass(c, r0, col, nc, BufferedColumns{buffer.data(), k});
            else
                amx_pass(c, r0, col, nc, staged);
        }
    }
    _tile_release();
}

AMX_TARGET void columns_amx(const Call& c, size_t col0, size_t col1) {
    switch (c.fmt) {
        case Q4_1: return columns_amx<Q4_1>(c, col0, col1);
        case Q8_0: return columns_amx<Q8_0>(c, col0, col1);
        case BF16: return columns_amx<BF16>(c, col0, col1);
        default: return columns_amx<F32>(c, col0, col1);
    }
}

// Whether this process may use the tiles: the CPU has them and Linux grants their state.
bool amx_usable() {
#if defined(__linux__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tiles = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    constexpr long REQ_XCOMP_PERM = 0x1023, XTILEDATA = 18;
    return tiles && bf16 && syscall(SYS_arch_prctl, REQ_XCOMP_PERM, XTILEDATA) == 0;
#else
    return false;
#endif
}

// -- AVX2 + FMA, float32 -------------------------------------------------------------------

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET void dequant_f32_avx2(int fmt, const uint8_t* src, size_t k, float* out) {
    const size_t bb = block_bytes(fmt);
    for (size_t b = 0; b < k / QK; ++b, src += bb, out += QK) {
        if (fmt == Q4_1) {
            uint16_t hd, hm;
            std::memcpy(&hd, src, 2);
            std::memcpy(&hm, src + 2, 2);
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd)), m = _mm256_set1_ps(_cvtsh_ss(hm));
            const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 4));
            const __m128i mask = _mm_set1_epi8(15);
            const __m128i parts[2] = {_mm_and_si128(q, mask),
                                      _mm_and_si128(_mm_srli_epi16(q, 4), mask)};
            for (int h = 0; h < 2; ++h) {
                const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[h]));
                const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(parts[h], 8)));
                _mm256_storeu_ps(out + 16 * h, _mm256_add_ps(_mm256_mul_ps(a, d), m));
                _mm256_storeu_ps(out + 16 * h + 8, _mm256_add_ps(_mm256_mul_ps(b, d), m));
            }
        } else if (fmt == Q8_0) {
            uint16_t hd;
            std::memcpy(&hd, src, 2);
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd));
            for (int i = 0; i < 4; ++i) {
                const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 2 + 8 * i));
                _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
            }
        } else {  // BF16
            for (int i = 0; i < 4; ++i) {
                const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * i));
                _mm256_storeu_ps(out + 8 * i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
            }
        }
    }
}

AVX2_TARGET float reduce8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int R>
AVX2_TARGET void tile_f32(const float* x, size_t k, const float* const* w, float out[][NC]) {
    __m256 acc[R][NC];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
    for (size_t j = 0; j < k; j += 8) {
        __m256 wv[NC];
        for (int c = 0; c < NC; ++c) wv[c] = _mm256_loadu_ps(w[c] + j);
        for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_loadu_ps(x + r * k + j);
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) out[r][c] = reduce8(acc[r][c]);
}

AVX2_TARGET void columns_f32_avx2(const Call& c, size_t col0, size_t col1) {
    const size_t k = c.k, rb = row_bytes(c.fmt, k);
    thread_local std::vector<float> buffer;
    if (c.fmt != F32) buffer.resize(NC * k);
    const float* x = static_cast<const float*>(c.x);
    for (size_t col = col0; col < col1; col += NC) {
        const int nc = (int)std::min<size_t>(NC, col1 - col);
        const float* w[NC];
        for (int i = 0; i < NC; ++i) {
            const size_t src = col + std::min(i, nc - 1);  // a column past the end: not stored
            if (c.fmt == F32) {
                w[i] = reinterpret_cast<const float*>(c.w + src * rb);
            } else {
                dequant_f32_avx2(c.fmt, c.w + src * rb, k, &buffer[i * k]);
                w[i] = &buffer[i * k];
            }
        }
        float out[2][NC];
        size_t r = 0;
        for (; r + 2 <= c.m; r += 2) {
            tile_f32<2>(x + r * k, k, w, out);
            for (int i = 0; i < 2; ++i)
                for (int j = 0; j < nc; ++j) store(c, r + i, col + j, out[i][j]);
        }
        for (; r < c.m; ++r) {
            tile_f32<1>(x + r * k, k, w, out);
            for (int j = 0; j < nc; ++j) store(c, r, col + j, out[0][j]);
        }
    }
}

#endif  // REDRAFT_X86

// -- paths -----------------------------------------------------------------------------------

enum Path { SCALAR = 0, AVX2 = 1, AVX512BF16 = 2, AMX = 3 };
const char* const PATH_NAMES[] = {"scalar", "avx2", "avx512bf16", "amx"};

bool supported(Path p) {
#ifdef REDRAFT_X86
    __builtin_cpu_init();
    if (p == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (p == AVX512BF16)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    if (p == AMX) {
        static const bool usable = supported(AVX512BF16) && amx_usable();
        return usable;
    }
#endif
    return p == SCALAR;
}

// The path each kind runs: the best this CPU has, unless a test or benchmark chose another.
Path g_path[2] = {SCALAR, SCALAR};

void choose_default_paths() {
    g_path[KIND_F32] = supported(AVX2) ? AVX2 : SCALAR;
    g_path[KIND_BF16] = supported(AMX) ? AMX : supported(AVX512BF16) ? AVX512BF16 : SCALAR;
}

void columns(const Call& c, size_t col0, size_t col1) {
#ifdef REDRAFT_X86
    const Path p = g_path[c.kind];
    if (c.kind == KIND_BF16 && p == AMX) return columns_amx(c, col0, col1);
    if (c.kind == KIND_BF16 && p == AVX512BF16) return columns_bf16_avx512(c, col0, col1);
    if (c.kind == KIND_F32 && p == AVX2) return columns_f32_avx2(c, col0, col1);
#endif
    columns_scalar(c, col0, col1);
}

// -- threads: kept for the process, each call's columns split among them --------------------

class Pool {
  public:
    // Runs fn(0..threads-1), fn(0) on the caller; returns when all are done.
    void run(int threads, const std::function<void(int)>& fn) {
        if (threads <= 1) return fn(0);
        std::lock_guard<std::mutex> one_call(call_mu_);  // calls from two Python threads queue
        {
            std::lock_guard<std::mutex> lk(mu_);
            while ((int)workers_.size() < threads - 1) {
                const int id = (int)workers_.size() + 1;
                workers_.emplace_back([this, id] { work(id); });
            }
            job_ = &fn;
            job_threads_ = threads;
            pending_ = threads - 1;
            ++generation_;
        }
        wake_.notify_all();
        fn(0);
        std::unique_lock<std::mutex> lk(mu_);
        done_.wait(lk, [this] { return pending_ == 0; });
        job_ = nullptr;
    }

    // After fork() only the calling thread exists: forget the workers without joining them.
    void forget_after_fork() {
        new (&mu_) std::mutex();
        new (&call_mu_) std::mutex();
        new (&wake_) std::condition_variable();
        new (&done_) std::condition_variable();
        for (auto& t : workers_) new (&t) std::thread();  // no longer joinable
        workers_.clear();
        pending_ = 0;
    }

  private:
    void work(int id) {
        uint64_t seen = 0;
        std::unique_lock<std::mutex> lk(mu_);
        for (;;) {
            wake_.wait(lk, [&] { return generation_ != seen; });
            seen = generation_;
            if (id >= job_threads_) continue;
            const std::function<void(int)>* fn = job_;
            lk.unlock();
            (*fn)(id);
            lk.lock();
            if (--pending_ == 0) done_.notify_one();
        }
    }

    std::mutex mu_, call_mu_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> workers_;
    const std::function<void(int)>* job_ = nullptr;
    int job_threads_ = 0, pending_ = 0;
    uint64_t generation_ = 0;
};

Pool* g_pool = nullptr;  // never destroyed: its threads wait until the process exits

void after_fork_in_child() { g_pool->forget_after_fork(); }

void run_call(const Call& call, int threads) {
    Call c = call;
    size_t unit = NC;  // columns a thread's share is a multiple of
#ifdef REDRAFT_X86
    if (c.kind == KIND_BF16 && g_path[KIND_BF16] == AMX) {  // the rows packed once, for all threads
        thread_local std::vector<uint32_t> packed;
        packed.resize((c.m + AMX_ROWS - 1) / AMX_ROWS * (c.k / QK) * AMX_TILE);
        pack_rows_amx(static_cast<const uint16_t*>(c.x), c.m, c.k, packed.data());
        c.packed = packed.data();
        unit = AMX_COLS;
    }
#endif
    const size_t tiles = (c.n + unit - 1) / unit;
    threads = (int)std::max<size_t>(1, std::min<size_t>(threads, tiles));
    g_pool->run(threads, [&](int t) {
        const size_t a = tiles * t / threads * unit, b = std::min(c.n, tiles * (t + 1) / threads * unit);
        if (a < b) columns(c, a, b);
    });
}

// -- attention, one row at a time -------------------------------------------------------------
//
// Each query row attends to exactly its own keys (the cached prefix, then the slots it lists:
// a tree row's ancestors and itself), in that order, with its own reductions: nothing a row
// computes depends on another row, so a tree row's output is what a one-token forward at its
// position computes. Threads split (row, head) pairs. Float32 throughout; the sums run over
// LANES interleaved partial sums added pairwise at the end (a fixed order the compiler
// vectorizes without reassociating), and exp is a polynomial evaluated the same way at every
// width, so the SSE2 and AVX2 builds below give the same bits.

constexpr int LANES = 16;  // two AVX2 registers: two independent chains per sum
constexpr size_t ROW_CHUNK = 8;  // rows whose queries share each loaded key and value

struct Attention {
    const float* q;        // [n, heads, dim]
    const float* keys;     // [kv, capacity, dim]
    const float* values;   // [kv, capacity, vwidth] (the first dim columns are used)
    const int32_t* slots;  // each row's slots after the prefix, rows one after another
    const int64_t* offsets;  // [n + 1] into slots
    float* out;            // [n, heads, dim]
    size_t n, heads, kv, dim, capacity, vwidth, past;
    float scale;
};

// The (row, head) pairs of rows [r0, r1) whose heads share key head kvh, as the attention
// blocks below walk them: each pair's query, output, own slots and key count, the longest
// row's key count, and the pairs' softmax sums once computed.
struct Pairs {
    size_t count, width = 0;
    const float* keys;
    const float* values;
    const float* qs[ROW_CHUNK * 64];
    float* outs[ROW_CHUNK * 64];
    const int32_t* tails[ROW_CHUNK * 64];
    size_t totals[ROW_CHUNK * 64];
    float sums[ROW_CHUNK * 64];
    Pairs(const Attention& a, size_t kvh, size_t r0, size_t r1)
        : count((r1 - r0) * (a.heads / a.kv)), keys(a.keys + kvh * a.capacity * a.dim),
          values(a.values + kvh * a.capacity * a.vwidth) {
        const size_t group = a.heads / a.kv;
        for (size_t p = 0; p < count; ++p) {
            const size_t r = r0 + p / group, at = (r * a.heads + kvh * group + p % group) * a.dim;
            qs[p] = a.q + at;
            outs[p] = a.out + at;
            tails[p] = a.slots + a.offsets[r];
            totals[p] = a.past + (size_t)(a.offsets[r + 1] - a.offsets[r]);
            width = std::max(width, totals[p]);
        }
    }
};

// The primitives, written twice with the same operations in the same order: plain C++ (any
// CPU) and AVX2 + FMA intrinsics. Sums over LANES partial sums added pairwise (i + i+8,
// i + i+4, i + i+2, 0 + 1); products accumulated with fused multiply-adds (std::fma is the
// same operation); exp(x) for x <= 0 as 2^k p(r), r = x - k ln 2, p Cephes' degree-6
// polynomial.
constexpr float EXP_MIN = -87.0f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

struct Plain {
    static float lanes_sum(const float* a) {
        float t[LANES];
        for (int i = 0; i < LANES; ++i) t[i] = a[i];
        for (int width = LANES / 2; width >= 1; width /= 2)
            for (int i = 0; i < width; ++i) t[i] = t[i] + t[i + width];
        return t[0];
    }
    static float dot(const float* q, const float* k, size_t dim) {
        float acc[LANES] = {0};
        for (size_t d = 0; d < dim; d += LANES)
            for (int l = 0; l < LANES; ++l) acc[l] = std::fma(q[d + l], k[d + l], acc[l]);
        return lanes_sum(acc);
    }
    static void axpy(float* out, float w, const float* v, size_t dim) {
        for (size_t d = 0; d < dim; ++d) out[d] = std::fma(w, v[d], out[d]);
    }
    static void exp_shifted(float* x, size_t count, float shift) {  // exp(x - shift)
        for (size_t i = 0; i < count; ++i) {
            const float y = x[i] - shift;
            const float v = y > EXP_MIN ? y : EXP_MIN;  // as MAXPS: a NaN takes EXP_MIN
            const float k = std::floor(v * LOG2E + 0.5f);
            float r = v - k * LN2_HI;
            r = r - k * LN2_LO;
            float p = EXP_P[0];
            for (int c = 1; c < 6; ++c) p = p * r + EXP_P[c];
            p = p * r * r + r + 1.0f;
            const int32_t e = ((int32_t)k + 127) << 23;
            float two_k;
            std::memcpy(&two_k, &e, 4);
            x[i] = y < EXP_MIN ? 0.0f : p * two_k;
        }
    }
    static float sum(const float* x, size_t count) {
        float part[LANES] = {0};
        size_t j = 0;
        for (; j + LANES <= count; j += LANES)
            for (int l = 0; l < LANES; ++l) part[l] = part[l] + x[j + l];
        for (int l = 0; j < count; ++j, ++l) part[l] = part[l] + x[j];
        return lanes_sum(part);
    }
};

#ifdef REDRAFT_X86
#define AVX2_ONLY __attribute__((target("avx2,fma")))
struct Avx2 {
    AVX2_ONLY static float hsum(__m256 lo, __m256 hi) {  // 16 lanes: i + i+8 first
        const __m256 v = _mm256_add_ps(lo, hi);
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
    }
    AVX2_ONLY static float dot(const float* q, const float* k, size_t dim) {
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (size_t d = 0; d < dim; d += LANES) {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), hi);
        }
        return hsum(lo, hi);
    }
    AVX2_ONLY static void axpy(float* out, float w, const float* v, size_t dim) {
        const __m256 wv = _mm256_set1_ps(w);
        for (size_t d = 0; d < dim; d += 8)
            _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + d),
                                                      _mm256_loadu_ps(out + d)));
    }
    AVX2_ONLY static void exp_shifted(float* x, size_t count, float shift) {
        size_t i = 0;
        const __m256 lo = _mm256_set1_ps(EXP_MIN), sh = _mm256_set1_ps(shift);
        for (; i + 8 <= count; i += 8) {
            const __m256 y = _mm256_sub_ps(_mm256_loadu_ps(x + i), sh);
            const __m256 v = _mm256_max_ps(y, lo);  // y > EXP_MIN ? y : EXP_MIN (NaN: EXP_MIN)
            const __m256 k = _mm256_floor_ps(
                _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(LOG2E)), _mm256_set1_ps(0.5f)));
            __m256 r = _mm256_sub_ps(v, _mm256_mul_ps(k, _mm256_set1_ps(LN2_HI)));
            r = _mm256_sub_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(LN2_LO)));
            __m256 p = _mm256_set1_ps(EXP_P[0]);
            for (int c = 1; c < 6; ++c)
                p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_P[c]));
            p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
                              _mm256_set1_ps(1.0f));
            const __m256i e = _mm256_slli_epi32(
                _mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
            const __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
            _mm256_storeu_ps(x + i, _mm256_andnot_ps(_mm256_cmp_ps(y, lo, _CMP_LT_OQ), out));
        }
        Plain::exp_shifted(x + i, count - i, shift);
    }
    AVX2_ONLY static float sum(const float* x, size_t count) {
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        size_t j = 0;
        for (; j + LANES <= count; j += LANES) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(x + j));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(x + j + 8));
        }
        float lanes[LANES];
        _mm256_storeu_ps(lanes, lo);
        _mm256_storeu_ps(lanes + 8, hi);
        for (int l = 0; j < count; ++j, ++l) lanes[l] = lanes[l] + x[j];
        return Plain::lanes_sum(lanes);
    }
};
#endif

// The AVX-512 build of the same primitives, one 16-lane register where AVX2 takes two: the
// same lanes, the same operations in each, so the same bits.
struct Avx512 {
    AVX512_TARGET static float dot(const float* q, const float* k, size_t dim) {
        __m512 acc = _mm512_setzero_ps();
        for (size_t d = 0; d < dim; d += LANES)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
        return reduce512(acc);
    }
    // Sixteen keys' dots with one query at once, their sums reduced together: lane t is
    // dot(q, keys[t]), each in reduce512's order.
    AVX512_TARGET static __m512 dots16(const float* q, const float* keys, size_t dim) {
        __m512 acc[16];
        for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        for (size_t d = 0; d < dim; d += LANES) {
            const __m512 qv = _mm512_loadu_ps(q + d);
            for (int t = 0; t < 16; ++t)
                acc[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + t * dim + d), acc[t]);
        }
        // reduce512_sixteen leaves register 4a + b's sum in lane 4b + a: put it in lane 4a + b
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        return _mm512_permutexvar_ps(order, reduce512_sixteen(acc));
    }
    AVX512_TARGET static void exp_shifted(float* x, size_t count, float shift) {
        size_t i = 0;
        const __m512 lo = _mm512_set1_ps(EXP_MIN), sh = _mm512_set1_ps(shift);
        for (; i + 16 <= count; i += 16) {
            const __m512 y = _mm512_sub_ps(_mm512_loadu_ps(x + i), sh);
            const __m512 v = _mm512_max_ps(y, lo);  // as MAXPS: a NaN takes EXP_MIN
            const __m512 k = _mm512_roundscale_ps(
                _mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(LOG2E)), _mm512_set1_ps(0.5f)),
                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            __m512 r = _mm512_sub_ps(v, _mm512_mul_ps(k, _mm512_set1_ps(LN2_HI)));
            r = _mm512_sub_ps(r, _mm512_mul_ps(k, _mm512_set1_ps(LN2_LO)));
            __m512 p = _mm512_set1_ps(EXP_P[0]);
            for (int c = 1; c < 6; ++c)
                p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_P[c]));
            p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
                              _mm512_set1_ps(1.0f));
            const __m512i e = _mm512_slli_epi32(
                _mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
            const __m512 out = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
            const __mmask16 under = _mm512_cmp_ps_mask(y, lo, _CMP_LT_OQ);
            _mm512_storeu_ps(x + i, _mm512_maskz_mov_ps((__mmask16)~under, out));
        }
        Plain::exp_shifted(x + i, count - i, shift);
    }
    AVX512_TARGET static float sum(const float* x, size_t count) {
        __m512 acc = _mm512_setzero_ps();
        size_t j = 0;
        for (; j + LANES <= count; j += LANES) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + j));
        float lanes[LANES];
        _mm512_storeu_ps(lanes, acc);
        for (int l = 0; j < count; ++j, ++l) lanes[l] = lanes[l] + x[j];
        return Plain::lanes_sum(lanes);
    }
};

// attend_block's AVX-512 build for heads of V * 16 dimensions. The prefix goes in blocks that
// stay in the core's first-level cache while every pair of the chunk uses them (each pair
// streaming the whole prefix from the second level was the bound): scores sixteen keys at a
// time, outputs held in registers for four pairs at a time over a block of keys, each output
// element fused-multiply-added over the keys in attend_block's order. So every row's bits
// are attend_block's.
template <int V>
AVX512_TARGET void attend_block_avx512(const Attention& a, size_t kvh, size_t r0, size_t r1,
                                       std::vector<float>& scores) {
    constexpr size_t PAIRS = 4;        // pairs whose outputs stay in registers together
    constexpr size_t BLOCK = 256 / V;  // prefix keys per block: 16 KB of values
    Pairs pr(a, kvh, r0, r1);
    const size_t dim = a.dim, pairs = pr.count, width = pr.width;
    const float *keys = pr.keys, *values = pr.values;
    const float* const* qs = pr.qs;
    float* const* outs = pr.outs;
    const int32_t* const* tails = pr.tails;
    const size_t* totals = pr.totals;
    float* sums = pr.sums;
    scores.resize(pairs * width);
    const __m512 scale = _mm512_set1_ps(a.scale);
    const size_t whole = a.past / 16 * 16;
    for (size_t j = 0; j < whole; j += 16)
        for (size_t p = 0; p < pairs; ++p)
            _mm512_storeu_ps(&scores[p * width + j],
                             _mm512_mul_ps(Avx512::dots16(qs[p], keys + j * dim, dim), scale));
    for (size_t p = 0; p < pairs; ++p) {
        float* s = &scores[p * width];
        for (size_t j = whole; j < a.past; ++j) s[j] = Avx512::dot(qs[p], keys + j * dim, dim) * a.scale;
        for (size_t j = a.past; j < totals[p]; ++j)
            s[j] = Avx512::dot(qs[p], keys + (size_t)tails[p][j - a.past] * dim, dim) * a.scale;
        float best = -INFINITY;
        for (size_t i = 0; i < totals[p]; ++i) best = s[i] > best ? s[i] : best;
        Avx512::exp_shifted(s, totals[p], best);
        sums[p] = Avx512::sum(s, totals[p]);
        std::memset(outs[p], 0, dim * sizeof(float));
    }
    for (size_t j0 = 0; j0 < a.past; j0 += BLOCK) {
        const size_t j1 = std::min(a.past, j0 + BLOCK);
        for (size_t p0 = 0; p0 < pairs; p0 += PAIRS) {
            const size_t np = std::min(PAIRS, pairs - p0);
            __m512 acc[PAIRS][V];
            for (size_t i = 0; i < np; ++i)
                for (int v = 0; v < V; ++v) acc[i][v] = _mm512_loadu_ps(outs[p0 + i] + v * LANES);
            for (size_t j = j0; j < j1; ++j) {
                __m512 row[V];
                for (int v = 0; v < V; ++v) row[v] = _mm512_loadu_ps(values + j * a.vwidth + v * LANES);
                for (size_t i = 0; i < PAIRS; ++i) {
                    if (i >= np) break;
                    const __m512 w = _mm512_set1_ps(scores[(p0 + i) * width + j]);
                    for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(w, row[v], acc[i][v]);
                }
            }
            for (size_t i = 0; i < np; ++i)
                for (int v = 0; v < V; ++v) _mm512_storeu_ps(outs[p0 + i] + v * LANES, acc[i][v]);
        }
    }
    for (size_t p = 0; p < pairs; ++p) {
        __m512 acc[V];
        for (int v = 0; v < V; ++v) acc[v] = _mm512_loadu_ps(outs[p] + v * LANES);
        for (size_t j = a.past; j < totals[p]; ++j) {
            const __m512 w = _mm512_set1_ps(scores[p * width + j]);
            const float* row = values + (size_t)tails[p][j - a.past] * a.vwidth;
            for (int v = 0; v < V; ++v) acc[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(row + v * LANES), acc[v]);
        }
        const __m512 total = _mm512_set1_ps(sums[p]);
        for (int v = 0; v < V; ++v) _mm512_storeu_ps(outs[p] + v * LANES, _mm512_div_ps(acc[v], total));
    }
}

// The rows [r0, r1) of the query heads that share key head kvh. Each (row, head) pair runs
// the same operations in the same order as it would alone (its prefix keys, then its own
// slots): keys and values are only loaded once for all of them.
template <class Ops>
inline __attribute__((always_inline)) void attend_block(const Attention& a, size_t kvh, size_t r0,
                                                        size_t r1, std::vector<float>& scores) {
    Pairs pr(a, kvh, r0, r1);
    const size_t dim = a.dim, pairs = pr.count, width = pr.width;
    const float *keys = pr.keys, *values = pr.values;
    const float* const* qs = pr.qs;
    float* const* outs = pr.outs;
    const int32_t* const* tails = pr.tails;
    const size_t* totals = pr.totals;
    float* sums = pr.sums;
    scores.resize(pairs * width);
    for (size_t j = 0; j < a.past; ++j)
        for (size_t p = 0; p < pairs; ++p)
            scores[p * width + j] = Ops::dot(qs[p], keys + j * dim, dim) * a.scale;
    for (size_t p = 0; p < pairs; ++p) {
        float* s = &scores[p * width];
        for (size_t j = a.past; j < totals[p]; ++j)
            s[j] = Ops::dot(qs[p], keys + (size_t)tails[p][j - a.past] * dim, dim) * a.scale;
        float best = -INFINITY;
        for (size_t j = 0; j < totals[p]; ++j) best = s[j] > best ? s[j] : best;
        Ops::exp_shifted(s, totals[p], best);
        sums[p] = Ops::sum(s, totals[p]);
        std::memset(outs[p], 0, dim * sizeof(float));
    }
    for (size_t j = 0; j < a.past; ++j)
        for (size_t p = 0; p < pairs; ++p)
            Ops::axpy(outs[p], scores[p * width + j], values + j * a.vwidth, dim);
    for (size_t p = 0; p < pairs; ++p) {
        for (size_t j = a.past; j < totals[p]; ++j)
            Ops::axpy(outs[p], scores[p * width + j],
                      values + (size_t)tails[p][j - a.past] * a.vwidth, dim);
        for (size_t d = 0; d < dim; ++d) outs[p][d] = outs[p][d] / sums[p];
    }
}

// Work units: (key head, chunk of ROW_CHUNK rows); threads take contiguous runs of them.
template <class Ops>
inline __attribute__((always_inline)) void attend_units(const Attention& a, size_t u0, size_t u1) {
    thread_local std::vector<float> scores;
    const size_t chunks = (a.n + ROW_CHUNK - 1) / ROW_CHUNK;
    for (size_t u = u0; u < u1; ++u) {
        const size_t kvh = u / chunks, r0 = u % chunks * ROW_CHUNK;
        attend_block<Ops>(a, kvh, r0, std::min(a.n, r0 + ROW_CHUNK), scores);
    }
}

void attend_plain(const Attention& a, size_t u0, size_t u1) { attend_units<Plain>(a, u0, u1); }
#ifdef REDRAFT_X86
AVX2_ONLY void attend_avx2(const Attention& a, size_t u0, size_t u1) { attend_units<Avx2>(a, u0, u1); }

template <int V>
AVX512_TARGET void attend_avx512(const Attention& a, size_t u0, size_t u1) {
    thread_local std::vector<float> scores;
    const size_t chunks = (a.n + ROW_CHUNK - 1) / ROW_CHUNK;
    for (size_t u = u0; u < u1; ++u) {
        const size_t kvh = u / chunks, r0 = u % chunks * ROW_CHUNK;
        attend_block_avx512<V>(a, kvh, r0, std::min(a.n, r0 + ROW_CHUNK), scores);
    }
}

bool has_avx512() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#endif

// Which build runs: PLAIN, BEST (AVX-512 for heads of 64 or 128 dimensions where the CPU has
// it, else AVX2 where it has that) or AVX2 (the tests compare all three).
enum AttendBuild { ATTEND_PLAIN = 0, ATTEND_BEST = 1, ATTEND_AVX2 = 2 };

void attend(const Attention& a, int threads, int build) {
    const size_t units = a.kv * ((a.n + ROW_CHUNK - 1) / ROW_CHUNK);
    threads = (int)std::max<size_t>(1, std::min<size_t>(threads, units));
#ifdef REDRAFT_X86
    static const bool avx512 = has_avx512();
    const bool wide = build == ATTEND_BEST && avx512 && (a.dim == 64 || a.dim == 128);
    const bool simd = build != ATTEND_PLAIN && supported(AVX2);  // AVX2 and FMA
#endif
    g_pool->run(threads, [&](int t) {
        const size_t p0 = units * t / threads, p1 = units * (t + 1) / threads;
#ifdef REDRAFT_X86
        if (wide && a.dim == 64) return attend_avx512<4>(a, p0, p1);
        if (wide) return attend_avx512<8>(a, p0, p1);
        if (simd) return attend_avx2(a, p0, p1);
#endif
        attend_plain(a, p0, p1);
    });
}

// -- RMSNorm, one row at a time ---------------------------------------------------------------
//
// Hugging Face's rounding points (the row in float32, its mean square, x / rms rounded to the
// activations' dtype, then scaled by the weight in that dtype), each row's sum of squares over
// LANES partial sums in a fixed order: one call per norm instead of about ten tensor ops.

#ifdef REDRAFT_X86
// The bfloat16 RMSNorm on AVX-512: the same operations per element and the same 16 partial
// sums, so the same bits as the loop below.
AVX512_TARGET void rms_norm_bf16_avx512(const uint16_t* x, const uint16_t* w, uint16_t* out,
                                        size_t rows, size_t h, float eps) {
    for (size_t r = 0; r < rows; ++r) {
        const uint16_t* xr = x + r * h;
        __m512 part = _mm512_setzero_ps();
        for (size_t j = 0; j < h; j += LANES) {
            const __m512 v = load_bf16x16(xr + j);
            part = _mm512_add_ps(part, _mm512_mul_ps(v, v));
        }
        float lanes[LANES];
        _mm512_storeu_ps(lanes, part);
        const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(Plain::lanes_sum(lanes) / (float)h + eps));
        for (size_t j = 0; j < h; j += LANES) {
            const __m512 y = round_bf16x16(_mm512_mul_ps(load_bf16x16(xr + j), scale));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * h + j),
                                to_bf16x16(_mm512_mul_ps(load_bf16x16(w + j), y)));
        }
    }
}
#endif

void rms_norm_rows(const void* x, const void* w, void* out, size_t rows, size_t h, float eps,
                   int kind) {
#ifdef REDRAFT_X86
    static const bool avx512 = has_avx512();
    if (avx512 && kind == KIND_BF16 && h % LANES == 0)
        return rms_norm_bf16_avx512(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                                    static_cast<uint16_t*>(out), rows, h, eps);
#endif
    std::vector<float> row(h);
    for (size_t r = 0; r < rows; ++r) {
        for (size_t j = 0; j < h; ++j)
            row[j] = kind == KIND_F32 ? static_cast<const float*>(x)[r * h + j]
                                      : bf16_to_float(static_cast<const uint16_t*>(x)[r * h + j]);
        float part[LANES] = {0};
        size_t j = 0;
        for (; j + LANES <= h; j += LANES)
            for (int l = 0; l < LANES; ++l) part[l] = part[l] + row[j + l] * row[j + l];
        for (int l = 0; j < h; ++j, ++l) part[l] = part[l] + row[j] * row[j];
        const float scale = 1.0f / std::sqrt(Plain::lanes_sum(part) / (float)h + eps);
        for (size_t i = 0; i < h; ++i) {
            const float y = row[i] * scale;
            if (kind == KIND_F32) {
                static_cast<float*>(out)[r * h + i] = static_cast<const float*>(w)[i] * y;
            } else {
                const float wi = bf16_to_float(static_cast<const uint16_t*>(w)[i]);
                static_cast<uint16_t*>(out)[r * h + i] =
                    float_to_bf16(wi * bf16_to_float(float_to_bf16(y)));
            }
        }
    }
}

// Element i of a row of the activations' kind, as float32.
template <int KIND>
inline float element(const void* p, size_t i) {
    return KIND == KIND_F32 ? static_cast<const float*>(p)[i]
                            : bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

// -- rotary embedding, into the cache ----------------------------------------------------------
//
// A layer's fused query/key/value rows [n, heads + 2 kv, dim] (the activations' dtype): queries
// and keys rotated as Hugging Face rounds it (q * cos and rotate_half(q) * sin each rounded to
// the dtype, then their sum), queries written out in float32 for attention, keys and values
// into the float32 cache at slots start..start+n. One call where torch runs about ten ops.

#ifdef REDRAFT_X86
// rotate_rows for bfloat16 on AVX-512, sixteen dimensions at a time (half a head a multiple
// of 16): the same operations per element, so the same bits.
AVX512_TARGET void rotate_bf16_avx512(const uint16_t* h, size_t n, size_t heads, size_t kv,
                                      size_t dim, const uint16_t* cos, const uint16_t* sin,
                                      float* keys, float* values, size_t capacity, size_t vwidth,
                                      size_t start, float* q_out) {
    const size_t width = heads + 2 * kv, half = dim / 2;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (size_t r = 0; r < n; ++r) {
        for (size_t j = 0; j < width; ++j) {
            const uint16_t* row = h + (r * width + j) * dim;
            if (j >= heads + kv) {  // a value row: as it is
                float* out = values + ((j - heads - kv) * capacity + start + r) * vwidth;
                for (size_t d = 0; d < dim; d += LANES) _mm512_storeu_ps(out + d, load_bf16x16(row + d));
                continue;
            }
            float* out = j < heads ? q_out + (r * heads + j) * dim
                                   : keys + ((j - heads) * capacity + start + r) * dim;
            for (size_t d = 0; d < dim; d += LANES) {
                const __m512 rot = d < half ? _mm512_xor_ps(load_bf16x16(row + d + half), sign)
                                            : load_bf16x16(row + d - half);
                const __m512 a = round_bf16x16(_mm512_mul_ps(load_bf16x16(row + d), load_bf16x16(cos + r * dim + d)));
                const __m512 b = round_bf16x16(_mm512_mul_ps(rot, load_bf16x16(sin + r * dim + d)));
                _mm512_storeu_ps(out + d, round_bf16x16(_mm512_add_ps(a, b)));
            }
        }
    }
}
#endif

template <int KIND>
void rotate_rows(const void* h, size_t n, size_t heads, size_t kv, size_t dim, const void* cos,
                 const void* sin, float* keys, float* values, size_t capacity, size_t vwidth,
                 size_t start, float* q_out) {
#ifdef REDRAFT_X86
    static const bool avx512 = has_avx512();
    if (KIND == KIND_BF16 && avx512 && dim % (2 * LANES) == 0)
        return rotate_bf16_avx512(static_cast<const uint16_t*>(h), n, heads, kv, dim,
                                  static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin),
                                  keys, values, capacity, vwidth, start, q_out);
#endif
    constexpr auto get = element<KIND>;
    auto round = [](float v) { return KIND == KIND_F32 ? v : bf16_to_float(float_to_bf16(v)); };
    const size_t width = heads + 2 * kv, half = dim / 2;
    for (size_t r = 0; r < n; ++r) {
        for (size_t j = 0; j < width; ++j) {
            const size_t base = (r * width + j) * dim;
            if (j >= heads + kv) {  // a value row: as it is
                float* out = values + ((j - heads - kv) * capacity + start + r) * vwidth;
                for (size_t d = 0; d < dim; ++d) out[d] = get(h, base + d);
                continue;
            }
            float* out = j < heads ? q_out + (r * heads + j) * dim
                                   : keys + ((j - heads) * capacity + start + r) * dim;
            for (size_t d = 0; d < dim; ++d) {
                const float v = get(h, base + d);
                const float rot = d < half ? -get(h, base + d + half) : get(h, base + d - half);
                out[d] = round(round(v * get(cos, r * dim + d)) + round(rot * get(sin, r * dim + d)));
            }
        }
    }
}

// -- SiLU(gate) * up, one row at a time ------------------------------------------------------
//
// The MLP's activation on the fused gate/up rows [n, 2 * inter] (gate first), rounded where
// torch rounds it for the activations' dtype (SiLU's result, then the product). exp runs on
// arguments <= 0 only (the attention's polynomial): silu(g) = g / (1 + e) with e = exp(-g)
// for g >= 0, else g e / (1 + e) with e = exp(g). Its last bit may differ from torch's, so
// the Python layer loop calls this too: both loops give the same bits.

// One element: e is exp(-|g|).
template <int KIND>
inline void silu_mul_one(float g, float up, float e, void* out, size_t i) {
    const float silu = g >= 0.0f ? g / (1.0f + e) : (g * e) / (1.0f + e);
    if (KIND == KIND_F32)
        static_cast<float*>(out)[i] = silu * up;
    else
        static_cast<uint16_t*>(out)[i] = float_to_bf16(bf16_to_float(float_to_bf16(silu)) * up);
}

template <int KIND>
void silu_mul_plain(const void* gu, size_t rows, size_t inter, void* out, float* e) {
    for (size_t r = 0; r < rows; ++r) {
        const size_t base = r * 2 * inter;
        for (size_t i = 0; i < inter; ++i) e[i] = -std::fabs(element<KIND>(gu, base + i));
        Plain::exp_shifted(e, inter, 0.0f);
        for (size_t i = 0; i < inter; ++i)
            silu_mul_one<KIND>(element<KIND>(gu, base + i), element<KIND>(gu, base + inter + i),
                               e[i], out, r * inter + i);
    }
}

#ifdef REDRAFT_X86
// Eight elements of a row as float32.
template <int KIND>
AVX2_ONLY inline __m256 load8(const void* p, size_t i) {
    if (KIND == KIND_F32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// float_to_bf16 on eight lanes: each lane's bfloat16 in its low 16 bits.
AVX2_ONLY inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

AVX2_ONLY inline __m256 round_bf16_8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

template <int KIND>
AVX2_ONLY void silu_mul_avx2(const void* gu, size_t rows, size_t inter, void* out, float* e) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    for (size_t r = 0; r < rows; ++r) {
        const size_t base = r * 2 * inter;
        size_t i = 0;
        for (; i + 8 <= inter; i += 8)
            _mm256_storeu_ps(e + i, _mm256_or_ps(load8<KIND>(gu, base + i), sign));  // -|g|
        for (; i < inter; ++i) e[i] = -std::fabs(element<KIND>(gu, base + i));
        Avx2::exp_shifted(e, inter, 0.0f);
        for (i = 0; i + 8 <= inter; i += 8) {
            const __m256 g = load8<KIND>(gu, base + i), up = load8<KIND>(gu, base + inter + i);
            const __m256 ev = _mm256_loadu_ps(e + i);
            const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(g, ev), g,
                                                _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
            const __m256 silu = _mm256_div_ps(num, _mm256_add_ps(one, ev));
            if (KIND == KIND_F32) {
                _mm256_storeu_ps(static_cast<float*>(out) + r * inter + i, _mm256_mul_ps(silu, up));
            } else {
                const __m256i b = bf16_bits8(_mm256_mul_ps(round_bf16_8(silu), up));
                const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + r * inter + i),
                                 _mm256_castsi256_si128(packed));
            }
        }
        for (; i < inter; ++i)
            silu_mul_one<KIND>(element<KIND>(gu, base + i), element<KIND>(gu, base + inter + i),
                               e[i], out, r * inter + i);
    }
}
#endif

void silu_mul_rows(const void* gu, size_t rows, size_t inter, void* out, int kind, bool simd) {
    std::vector<float> e(inter);
#ifdef REDRAFT_X86
    if (simd && supported(AVX2))
        return (kind == KIND_F32 ? silu_mul_avx2<KIND_F32> : silu_mul_avx2<KIND_BF16>)(
            gu, rows, inter, out, e.data());
#endif
    (kind == KIND_F32 ? silu_mul_plain<KIND_F32> : silu_mul_plain<KIND_BF16>)(gu, rows, inter, out,
                                                                             e.data());
}

// x += y, elementwise, rounded to the activations' dtype as torch's add rounds it.
#ifdef REDRAFT_X86
// x = bf16(x + y) and out = bf16(v), sixteen at a time (the same rounding as below).
AVX512_TARGET void add_bf16_avx512(uint16_t* a, const uint16_t* b, size_t count) {
    size_t i = 0;
    for (; i + LANES <= count; i += LANES)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + i),
                            to_bf16x16(_mm512_add_ps(load_bf16x16(a + i), load_bf16x16(b + i))));
    for (; i < count; ++i) a[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}
AVX512_TARGET void to_bf16_avx512(const float* v, uint16_t* out, size_t count) {
    size_t i = 0;
    for (; i + LANES <= count; i += LANES)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), to_bf16x16(_mm512_loadu_ps(v + i)));
    for (; i < count; ++i) out[i] = float_to_bf16(v[i]);
}
#endif

// Float32 values rounded to bfloat16.
void to_bf16_rows(const float* v, uint16_t* out, size_t count) {
#ifdef REDRAFT_X86
    static const bool avx512 = has_avx512();
    if (avx512) return to_bf16_avx512(v, out, count);
#endif
    for (size_t i = 0; i < count; ++i) out[i] = float_to_bf16(v[i]);
}

void add_rows(void* x, const void* y, size_t count, int kind) {
#ifdef REDRAFT_X86
    static const bool avx512 = has_avx512();
    if (avx512 && kind == KIND_BF16)
        return add_bf16_avx512(static_cast<uint16_t*>(x), static_cast<const uint16_t*>(y), count);
#endif
    if (kind == KIND_F32) {
        float* a = static_cast<float*>(x);
        const float* b = static_cast<const float*>(y);
        for (size_t i = 0; i < count; ++i) a[i] = a[i] + b[i];
        return;
    }
    uint16_t* a = static_cast<uint16_t*>(x);
    const uint16_t* b = static_cast<const uint16_t*>(y);
    for (size_t i = 0; i < count; ++i) a[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

// -- a forward's layers in one call -------------------------------------------------------------
//
// Why: the Python layer loop runs about 25 tensor ops per layer, about 2 ms of a 17 ms
// one-token forward of the default model. This runs the same stages, the same functions in
// the same order (RMSNorm, the fused query/key/value matmul, the rotary into the cache, each
// row's attention over its own keys, the output matmul and residual, RMSNorm, gate/up,
// SiLU * up, down and residual), so its result is the Python loop's bit for bit.

// One layer's row of the table the caller passes: pointers and GGML type ids, as int64.
enum LayerField { NORM1, QKV, QKV_FMT, OUT, OUT_FMT, NORM2, GATE_UP, GATE_UP_FMT, DOWN, DOWN_FMT,
                  KEYS, VALUES, LAYER_FIELDS };

struct Forward {
    size_t n, hidden, heads, kv, dim, inter, capacity, vwidth, past;
    float eps, scale;
    int kind, threads;
    bool simd;
    const void* cos;
    const void* sin;
    const int32_t* slots;
    const int64_t* offsets;
};

template <class T>
T* at(int64_t address) { return reinterpret_cast<T*>(address); }

void run_layers(const Forward& f, const int64_t* table, size_t layers, void* x) {
    const size_t es = f.kind == KIND_F32 ? 4 : 2, n = f.n, h = f.hidden;
    const size_t width = (f.heads + 2 * f.kv) * f.dim, attn_width = f.heads * f.dim;
    std::vector<uint8_t> normed(n * h * es), qkv(n * width * es), y(n * h * es),
        gate_up(n * 2 * f.inter * es), act(n * f.inter * es), attn_in(n * attn_width * es);
    std::vector<float> q(n * attn_width), attn(n * attn_width);
    for (size_t l = 0; l < layers; ++l) {
        const int64_t* w = table + l * LAYER_FIELDS;
        float* keys = at<float>(w[KEYS]);
        float* values = at<float>(w[VALUES]);
        rms_norm_rows(x, at<const void>(w[NORM1]), normed.data(), n, h, f.eps, f.kind);
        run_call({normed.data(), at<const uint8_t>(w[QKV]), qkv.data(), n, h, width,
                  (int)w[QKV_FMT], f.kind}, f.threads);
        (f.kind == KIND_F32 ? rotate_rows<KIND_F32> : rotate_rows<KIND_BF16>)(
            qkv.data(), n, f.heads, f.kv, f.dim, f.cos, f.sin, keys, values, f.capacity,
            f.vwidth, f.past, q.data());
        attend({q.data(), keys, values, f.slots, f.offsets, attn.data(), n, f.heads, f.kv, f.dim,
                f.capacity, f.vwidth, f.past, f.scale}, f.threads, f.simd ? ATTEND_BEST : ATTEND_PLAIN);
        const void* attn_rows = attn.data();
        if (f.kind == KIND_BF16) {
            uint16_t* out = reinterpret_cast<uint16_t*>(attn_in.data());
            to_bf16_rows(attn.data(), out, n * attn_width);
            attn_rows = out;
        }
        run_call({attn_rows, at<const uint8_t>(w[OUT]), y.data(), n, attn_width, h,
                  (int)w[OUT_FMT], f.kind}, f.threads);
        add_rows(x, y.data(), n * h, f.kind);
        rms_norm_rows(x, at<const void>(w[NORM2]), normed.data(), n, h, f.eps, f.kind);
        run_call({normed.data(), at<const uint8_t>(w[GATE_UP]), gate_up.data(), n, h, 2 * f.inter,
                  (int)w[GATE_UP_FMT], f.kind}, f.threads);
        silu_mul_rows(gate_up.data(), n, f.inter, act.data(), f.kind, f.simd);
        run_call({act.data(), at<const uint8_t>(w[DOWN]), y.data(), n, f.inter, h,
                  (int)w[DOWN_FMT], f.kind}, f.threads);
        add_rows(x, y.data(), n * h, f.kind);
    }
}

// -- the CPython glue ----------------------------------------------------------------------

bool check_shape(int fmt, int kind, size_t k) {
    if (fmt != F32 && fmt != BF16 && fmt != Q4_1 && fmt != Q8_0) {
        PyErr_Format(PyExc_ValueError, "unsupported weight type %d", fmt);
        return false;
    }
    if (kind != KIND_F32 && kind != KIND_BF16) {
        PyErr_Format(PyExc_ValueError, "unsupported activation kind %d", kind);
        return false;
    }
    if (k == 0 || k % QK != 0) {
        PyErr_Format(PyExc_ValueError, "the input width %zu is not a positive multiple of %d", k, QK);
        return false;
    }
    return true;
}

PyObject* py_matmul(PyObject*, PyObject* args) {
    unsigned long long x, w, y;
    Py_ssize_t m, k, n;
    int fmt, kind, threads;
    if (!PyArg_ParseTuple(args, "KnnKinKii", &x, &m, &k, &w, &fmt, &n, &y, &kind, &threads))
        return nullptr;
    if (!check_shape(fmt, kind, (size_t)k) || m < 0 || n < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "negative row or column count");
        return nullptr;
    }
    const Call c{reinterpret_cast<const void*>(x), reinterpret_cast<const uint8_t*>(w),
                 reinterpret_cast<void*>(y), (size_t)m, (size_t)k, (size_t)n, fmt, kind};
    if (m > 0 && n > 0) {
        Py_BEGIN_ALLOW_THREADS
        run_call(c, threads);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

PyObject* py_dequantize(PyObject*, PyObject* args) {
    unsigned long long w, out;
    Py_ssize_t n, k;
    int fmt;
    if (!PyArg_ParseTuple(args, "KinnK", &w, &fmt, &n, &k, &out)) return nullptr;
    if (!check_shape(fmt, KIND_F32, (size_t)k)) return nullptr;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(w);
    float* dst = reinterpret_cast<float*>(out);
    const size_t bb = block_bytes(fmt), blocks = (size_t)n * (size_t)k / QK;
    Py_BEGIN_ALLOW_THREADS
    for (size_t b = 0; b < blocks; ++b) dequant_block(fmt, src + b * bb, dst + b * QK);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_row_bytes(PyObject*, PyObject* args) {
    int fmt;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "in", &fmt, &k)) return nullptr;
    if (!check_shape(fmt, KIND_F32, (size_t)k)) return nullptr;
    return PyLong_FromSize_t(row_bytes(fmt, (size_t)k));
}

PyObject* py_paths(PyObject*, PyObject*) {
    PyObject* out = PyList_New(0);
    for (int p = SCALAR; p <= AMX; ++p)
        if (supported((Path)p)) {
            PyObject* s = PyUnicode_FromString(PATH_NAMES[p]);
            PyList_Append(out, s);
            Py_DECREF(s);
        }
    return out;
}

PyObject* py_path(PyObject*, PyObject* args) {
    int kind;
    if (!PyArg_ParseTuple(args, "i", &kind)) return nullptr;
    if (kind != KIND_F32 && kind != KIND_BF16) {
        PyErr_Format(PyExc_ValueError, "unsupported activation kind %d", kind);
        return nullptr;
    }
    return PyUnicode_FromString(PATH_NAMES[g_path[kind]]);
}

PyObject* py_use_path(PyObject*, PyObject* args) {
    int kind;
    const char* name;
    if (!PyArg_ParseTuple(args, "is", &kind, &name)) return nullptr;
    for (int p = SCALAR; p <= AMX; ++p) {
        if (std::string(name) != PATH_NAMES[p]) continue;
        const bool fits = p == SCALAR || (kind == KIND_F32 && p == AVX2) ||
                          (kind == KIND_BF16 && (p == AVX512BF16 || p == AMX));
        if (kind != KIND_F32 && kind != KIND_BF16) break;
        if (!fits || !supported((Path)p)) {
            PyErr_Format(PyExc_ValueError, "path %s does not run this kind on this CPU", name);
            return nullptr;
        }
        g_path[kind] = (Path)p;
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_ValueError, "unknown path %s or kind %d", name, kind);
    return nullptr;
}

PyObject* py_attend(PyObject*, PyObject* args) {
    unsigned long long q, k, v, slots, offsets, out;
    Py_ssize_t n, heads, kv, dim, capacity, vwidth, past;
    float scale;
    int threads, simd;
    if (!PyArg_ParseTuple(args, "KnnnnKKnnnKKfKii", &q, &n, &heads, &kv, &dim, &k, &v, &capacity,
                          &vwidth, &past, &slots, &offsets, &scale, &out, &threads, &simd))
        return nullptr;
    if (n < 0 || heads <= 0 || kv <= 0 || heads % kv != 0 || heads / kv > 64 || dim <= 0 ||
        dim % LANES != 0 ||
        vwidth < dim || past < 0 || past > capacity || simd < ATTEND_PLAIN || simd > ATTEND_AVX2) {
        PyErr_SetString(PyExc_ValueError, "attend: inconsistent shapes");
        return nullptr;
    }
    const Attention a{reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(k),
                      reinterpret_cast<const float*>(v), reinterpret_cast<const int32_t*>(slots),
                      reinterpret_cast<const int64_t*>(offsets), reinterpret_cast<float*>(out),
                      (size_t)n, (size_t)heads, (size_t)kv, (size_t)dim, (size_t)capacity,
                      (size_t)vwidth, (size_t)past, scale};
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        attend(a, threads, simd);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

PyObject* py_rms_norm(PyObject*, PyObject* args) {
    unsigned long long x, w, out;
    Py_ssize_t rows, h;
    float eps;
    int kind;
    if (!PyArg_ParseTuple(args, "KnnKfKi", &x, &rows, &h, &w, &eps, &out, &kind)) return nullptr;
    if (rows < 0 || h <= 0 || (kind != KIND_F32 && kind != KIND_BF16)) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: bad shape or kind");
        return nullptr;
    }
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows(reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(w),
                  reinterpret_cast<void*>(out), (size_t)rows, (size_t)h, eps, kind);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_rotate(PyObject*, PyObject* args) {
    unsigned long long h, cos, sin, keys, values, q;
    Py_ssize_t n, heads, kv, dim, capacity, vwidth, start;
    int kind;
    if (!PyArg_ParseTuple(args, "KnnnnKKiKKnnnK", &h, &n, &heads, &kv, &dim, &cos, &sin, &kind,
                          &keys, &values, &capacity, &vwidth, &start, &q))
        return nullptr;
    if (n < 0 || heads <= 0 || kv <= 0 || dim <= 0 || dim % 2 || vwidth < dim || start < 0 ||
        start + n > capacity || (kind != KIND_F32 && kind != KIND_BF16)) {
        PyErr_SetString(PyExc_ValueError, "rotate: inconsistent shapes");
        return nullptr;
    }
    Py_BEGIN_ALLOW_THREADS
    (kind == KIND_F32 ? rotate_rows<KIND_F32> : rotate_rows<KIND_BF16>)(
        reinterpret_cast<const void*>(h), (size_t)n, (size_t)heads, (size_t)kv, (size_t)dim,
        reinterpret_cast<const void*>(cos), reinterpret_cast<const void*>(sin),
        reinterpret_cast<float*>(keys), reinterpret_cast<float*>(values), (size_t)capacity,
        (size_t)vwidth, (size_t)start, reinterpret_cast<float*>(q));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_silu_mul(PyObject*, PyObject* args) {
    unsigned long long gu, out;
    Py_ssize_t rows, inter;
    int kind, simd;
    if (!PyArg_ParseTuple(args, "KnnKip", &gu, &rows, &inter, &out, &kind, &simd)) return nullptr;
    if (rows < 0 || inter <= 0 || (kind != KIND_F32 && kind != KIND_BF16)) {
        PyErr_SetString(PyExc_ValueError, "silu_mul: bad shape or kind");
        return nullptr;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul_rows(reinterpret_cast<const void*>(gu), (size_t)rows, (size_t)inter,
                  reinterpret_cast<void*>(out), kind, simd);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_layers(PyObject*, PyObject* args) {
    unsigned long long table, x, cos, sin, slots, offsets;
    Py_ssize_t layers, n, hidden, heads, kv, dim, inter, capacity, vwidth, past;
    float eps, scale;
    int kind, threads, simd;
    if (!PyArg_ParseTuple(args, "KnKnnnnnnfiKKnnnKKfip", &table, &layers, &x, &n, &hidden, &heads,
                          &kv, &dim, &inter, &eps, &kind, &cos, &sin, &capacity, &vwidth, &past,
                          &slots, &offsets, &scale, &threads, &simd))
        return nullptr;
    if (layers < 0 || n < 0 || heads <= 0 || kv <= 0 || heads % kv != 0 || heads / kv > 64 ||
        dim <= 0 || dim % LANES != 0 || vwidth < dim || past < 0 || past + n > capacity ||
        (kind != KIND_F32 && kind != KIND_BF16) || !check_shape(Q4_1, kind, (size_t)hidden) ||
        !check_shape(Q4_1, kind, (size_t)inter) || !check_shape(Q4_1, kind, (size_t)(heads * dim))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "layers: inconsistent shapes");
        return nullptr;
    }
    const int64_t* rows = reinterpret_cast<const int64_t*>(table);
    for (Py_ssize_t l = 0; l < layers; ++l)
        for (int field : {QKV_FMT, OUT_FMT, GATE_UP_FMT, DOWN_FMT})
            if (!check_shape((int)rows[l * LAYER_FIELDS + field], kind, (size_t)hidden))
                return nullptr;
    const Forward f{(size_t)n, (size_t)hidden, (size_t)heads, (size_t)kv, (size_t)dim,
                    (size_t)inter, (size_t)capacity, (size_t)vwidth, (size_t)past, eps, scale,
                    kind, threads, (bool)simd, reinterpret_cast<const void*>(cos),
                    reinterpret_cast<const void*>(sin), reinterpret_cast<const int32_t*>(slots),
                    reinterpret_cast<const int64_t*>(offsets)};
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        run_layers(f, rows, (size_t)layers, reinterpret_cast<void*>(x));
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

PyMethodDef METHODS[] = {
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(x_ptr, m, k, w_ptr, fmt, n, y_ptr, kind, threads): y[m, n] = x[m, k] W[n, k]^T"},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(w_ptr, fmt, n, k, out_ptr): the weights as float32 [n, k] (scalar, exact)"},
    {"row_bytes", py_row_bytes, METH_VARARGS, "row_bytes(fmt, k): bytes of one weight row"},
    {"rotate", py_rotate, METH_VARARGS,
     "rotate(h, n, heads, kv, dim, cos, sin, kind, keys, values, capacity, vwidth, start, q): "
     "queries and keys rotated, keys and values into the cache, queries out in float32"},
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(x_ptr, rows, h, w_ptr, eps, out_ptr, kind): each row's RMSNorm, scaled"},
    {"attend", py_attend, METH_VARARGS,
     "attend(q, n, heads, kv, dim, keys, values, capacity, vwidth, past, slots, offsets, scale, "
     "out, threads, build): each row's attention over the prefix and its own slots (build: 0 "
     "plain, 1 the best SIMD one, 2 AVX2)"},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(gate_up_ptr, rows, inter, out_ptr, kind, simd): SiLU(gate) * up per row"},
    {"layers", py_layers, METH_VARARGS,
     "layers(table, layers, x, n, hidden, heads, kv, dim, inter, eps, kind, cos, sin, capacity, "
     "vwidth, past, slots, offsets, scale, threads, simd): a forward's layers on blocks, x in "
     "place"},
    {"paths", py_paths, METH_NOARGS, "the paths this CPU can run"},
    {"path", py_path, METH_VARARGS, "path(kind): the path that kind runs on"},
    {"use_path", py_use_path, METH_VARARGS, "use_path(kind, name): run that kind on that path"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_blocks", "The verifier's block linear kernel.", -1,
                      METHODS, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__blocks() {
    choose_default_paths();
    if (g_pool == nullptr) {
        g_pool = new Pool();
        pthread_atfork(nullptr, nullptr, after_fork_in_child);
    }
    PyObject* mod = PyModule_Create(&MODULE);
    if (mod == nullptr) return nullptr;
    PyModule_AddIntConstant(mod, "F32", F32);
    PyModule_AddIntConstant(mod, "BF16", BF16);
    PyModule_AddIntConstant(mod, "Q4_1", Q4_1);
    PyModule_AddIntConstant(mod, "Q8_0", Q8_0);
    PyModule_AddIntConstant(mod, "KIND_F32", KIND_F32);
    PyModule_AddIntConstant(mod, "KIND_BF16", KIND_BF16);
    PyModule_AddIntConstant(mod, "BLOCK", QK);
    PyModule_AddIntConstant(mod, "LAYER_FIELDS", LAYER_FIELDS);
    return mod;
}
