/* The routed experts of one MoE layer for a few tokens: counting sort of the (token, expert) pairs, then per
 * active expert gate/up, SiLU(gate) * up and down, and the routing-weighted sum into the output rows, all in one
 * call (shared/model/kernels/cpu_moe.py builds this file with gcc at first use and calls it through ctypes;
 * shared/model/moe.py's torch paths are the reference it is tested against).
 *
 * Why: decode routes ~8 rows to each expert, and BLAS GEMMs at M = 8 run far from the FMA peak (they pack the
 * weight on every call); here the weights are re-laid out once into panels that a register-blocked micro-kernel
 * streams in order, each panel read once per tile of up to MAX_ROWS rows.
 *
 * Three weight formats, one driver (moe_run): float32 (pdserve_moe_f32), bfloat16 (pdserve_moe_bf16: a bfloat16
 * model, activations and weights bfloat16, products accumulated in float32, rounded to bfloat16 where torch's
 * bfloat16 ops round) and weight-only int8 (pdserve_moe_i8: float32 activations, int8 weights with one float32
 * scale per output channel, each weight vector dequantized to float32 in registers, w = q * scale, then the
 * float32 kernel's FMAs: the same bits as pdserve_moe_f32 over the dequantized weights).
 *
 * One source, three builds: -DPDSERVE_ISA=256 (AVX2 + FMA: vectors of L = 8 floats, tiles of up to 6 rows),
 * -DPDSERVE_ISA=512 (AVX-512F: L = 16, tiles of up to 12 rows, software prefetch of the panel stream), and
 * -DPDSERVE_ISA=512 -DPDSERVE_BF16DP (the same plus AVX512_BF16: bfloat16 pairs through VDPBF16PS). All add the
 * same products in the same order with the same operations, so they give the same bits (bfloat16: the converting
 * builds widen each pair by a shift and do VDPBF16PS's two FMAs, odd element first, in its order; VDPBF16PS
 * flushes denormals, which the converting builds keep: values below 1e-38 could differ).
 *
 * Shapes: T tokens, D hidden, I intermediate, E experts, A top-k. D % 2L == 0 and I % L == 0 (the caller checks).
 *   float32 and int8 (int8: bytes, the same element order):
 *   gu: (E, I/L, D, 2L)  panel j of expert e, row k: gate[e][Lj..Lj+L][k] then up[e][Lj..Lj+L][k]
 *   dn: (E, D/2L, I, 2L) panel j of expert e, row k: down[e][2Lj..2Lj+2L][k]
 *   int8 scales: gus (E, I/L, 2L) the scales of panel j's columns (gate then up), dns (E, D/2L, 2L)
 *   bfloat16 (pairs of consecutive k: what VDPBF16PS multiplies per float32 lane):
 *   gu: (E, I/L, D/2, 2, L, 2)  panel j, row k2: gate[Lj + o][2k2 .. 2k2+1] for o < L, then up's
 *   dn: (E, D/2L, I/2, 2, L, 2) panel j, row k2: down[2Lj + o][2k2 .. 2k2+1] for o < 2L
 * Accumulation is float32 FMA in k order (not MKL's blocking: results differ from torch's in the last bits).
 * Threads (OpenMP, built with -fopenmp) split the (expert, panel) tiles; the result does not depend on their count.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef PDSERVE_ISA
#define PDSERVE_ISA 256
#endif

/* compiled without -m flags: this check runs on any x86-64 before the vector code is touched */
int pdserve_cpu_supported(void) {
    __builtin_cpu_init();
#if PDSERVE_ISA == 512 && defined(PDSERVE_BF16DP)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#elif PDSERVE_ISA == 512
    return __builtin_cpu_supports("avx512f");
#else
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
}

int pdserve_lanes(void) { return PDSERVE_ISA / 32; } /* L: floats per vector, what the panel layout needs */

#if PDSERVE_ISA == 512
#ifdef PDSERVE_BF16DP
#pragma GCC target("avx512f,avx512bf16")
#else
#pragma GCC target("avx512f")
#endif
#define L 16
#define MAX_ROWS 12 /* 12 x (2 x 16 floats) accumulators + 2 weight vectors + 1 broadcast of 32 zmm registers */
/* bytes ahead of the panel row being read: the stream of one tile is ~100 KiB, each row two cache lines;
 * measured on AMD EPYC (Zen 4) 1.2-1.35x over none at 8-128 rows, flat between 1 and 4 KiB */
#ifndef PDSERVE_PREFETCH
#define PDSERVE_PREFETCH 2048
#endif
typedef __m512 vec;
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(a) _mm512_set1_ps(a)
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_LOAD(p) _mm512_load_ps(p)
#define V_LOADU(p) _mm512_loadu_ps(p)
#define V_STOREU(p, v) _mm512_storeu_ps(p, v)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_DIV(a, b) _mm512_div_ps(a, b)
#define V_MIN(a, b) _mm512_min_ps(a, b)
#define V_MAX(a, b) _mm512_max_ps(a, b)
#define V_FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_FNMADD(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define V_ROUND(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_POW2(n) /* 2^n for integral float n */ \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
typedef __m512i veci; /* 2L bfloat16 (L pairs), or 32-bit integer lanes */
#define VI_LOAD(p) _mm512_load_si512((const void *)(p))
#define VI_SET1(a) _mm512_set1_epi32(a)
#define VI_ADD(a, b) _mm512_add_epi32(a, b)
#define VI_AND(a, b) _mm512_and_si512(a, b)
#define VI_SRLI(a, n) _mm512_srli_epi32(a, n)
#define VI_SLLI(a, n) _mm512_slli_epi32(a, n)
#define V_AS_I(v) _mm512_castps_si512(v)
#define VI_AS_F(v) _mm512_castsi512_ps(v)
#define V_I8(p) /* L int8 → float32 */ _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
/* L bfloat16 (the high halves of the lanes of an already-rounded vector) → memory */
#define V_STORE_BF16(p, v) _mm256_storeu_si256((__m256i *)(p), _mm512_cvtepi32_epi16(VI_SRLI(V_AS_I(v), 16)))
#else
#pragma GCC target("avx2,fma")
#define L 8
#define MAX_ROWS 6 /* 6 x (2 x 8 floats) accumulators + 2 weight vectors + 1 broadcast of 16 ymm registers */
#ifndef PDSERVE_PREFETCH
#define PDSERVE_PREFETCH 0
#endif
typedef __m256 vec;
#define V_ZERO() _mm256_setzero_ps()
#define V_SET1(a) _mm256_set1_ps(a)
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_LOAD(p) _mm256_load_ps(p)
#define V_LOADU(p) _mm256_loadu_ps(p)
#define V_STOREU(p, v) _mm256_storeu_ps(p, v)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_DIV(a, b) _mm256_div_ps(a, b)
#define V_MIN(a, b) _mm256_min_ps(a, b)
#define V_MAX(a, b) _mm256_max_ps(a, b)
#define V_FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_FNMADD(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define V_ROUND(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_POW2(n) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
typedef __m256i veci;
#define VI_LOAD(p) _mm256_load_si256((const __m256i *)(p))
#define VI_SET1(a) _mm256_set1_epi32(a)
#define VI_ADD(a, b) _mm256_add_epi32(a, b)
#define VI_AND(a, b) _mm256_and_si256(a, b)
#define VI_SRLI(a, n) _mm256_srli_epi32(a, n)
#define VI_SLLI(a, n) _mm256_slli_epi32(a, n)
#define V_AS_I(v) _mm256_castps_si256(v)
#define VI_AS_F(v) _mm256_castsi256_ps(v)
#define V_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
/* packus interleaves 128-bit halves: lanes 0-3 | 0-3 | 4-7 | 4-7 → permute the 64-bit quarters 0, 2 to the front */
#define V_STORE_BF16(p, v)                                                                                      \
    _mm_storeu_si128((__m128i *)(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(                          \
                                         _mm256_packus_epi32(VI_SRLI(V_AS_I(v), 16), VI_SRLI(V_AS_I(v), 16)), 0xD8)))
#endif

/* bytes ahead for a second prefetch into L2 only (0 = none): L1 holds few misses in flight (~16 lines), so the
 * far stream goes through L2's queue. AVX-512 build: 16 KiB, measured on Intel Xeon (Sapphire Rapids, 2 cores)
 * 1.15x over none at 32 rows, 1 and 2 threads (docs/benchmarks.md); not yet measured on AMD */
#ifndef PDSERVE_PREFETCH_L2
#define PDSERVE_PREFETCH_L2 (PDSERVE_ISA == 512 ? 16384 : 0)
#endif
/* one prefetch per cache line of a panel row (2L floats: 1 line at L = 8, 2 at L = 16) */
#define PREFETCH_LINE(row, ahead, hint) \
    if ((ahead) > 0) _mm_prefetch((const char *)(row) + (ahead) + line, hint)
#define PREFETCH_SPAN(row, bytes)                            \
    for (int line = 0; line < (bytes); line += 64) {         \
        PREFETCH_LINE(row, PDSERVE_PREFETCH, _MM_HINT_T0);    \
        PREFETCH_LINE(row, PDSERVE_PREFETCH_L2, _MM_HINT_T1); \
    }
#define PREFETCH_ROW(row) PREFETCH_SPAN(row, 2 * L * 4)

/* exp(x), Cephes' single-precision polynomial (about 1 ulp over the clamped range). */
static inline vec v_exp(vec x) {
    x = V_MIN(V_MAX(x, V_SET1(-87.3f)), V_SET1(88.3f));
    vec fx = V_ROUND(V_MUL(x, V_SET1(1.44269504088896341f)));
    x = V_FNMADD(fx, V_SET1(0.693359375f), x);
    x = V_FNMADD(fx, V_SET1(-2.12194440e-4f), x);
    vec y = V_SET1(1.9875691500e-4f);
    y = V_FMADD(y, x, V_SET1(1.3981999507e-3f));
    y = V_FMADD(y, x, V_SET1(8.3334519073e-3f));
    y = V_FMADD(y, x, V_SET1(4.1665795894e-2f));
    y = V_FMADD(y, x, V_SET1(1.6666665459e-1f));
    y = V_FMADD(y, x, V_SET1(5.0000001201e-1f));
    y = V_FMADD(y, V_MUL(x, x), V_ADD(x, V_SET1(1.0f)));
    return V_MUL(y, V_POW2(fx));
}

/* h[r][Lj..Lj+L] = silu(x_r . gate) * (x_r . up) for the tile's R rows (x_r = rows[r], D floats each). */
__attribute__((always_inline)) static inline void gate_up_tile(
    const int R, const float *const *rows, const float *panel, int64_t D, float *h, int64_t ldh) {
    vec g[MAX_ROWS], u[MAX_ROWS];
    for (int r = 0; r < R; r++) g[r] = u[r] = V_ZERO();
    for (int64_t k = 0; k < D; k++) {
        PREFETCH_ROW(panel + 2 * L * k);
        vec wg = V_LOAD(panel + 2 * L * k), wu = V_LOAD(panel + 2 * L * k + L);
        for (int r = 0; r < R; r++) {
            vec xb = V_BCAST(rows[r] + k);
            g[r] = V_FMADD(xb, wg, g[r]);
            u[r] = V_FMADD(xb, wu, u[r]);
        }
    }
    const vec one = V_SET1(1.0f);
    for (int r = 0; r < R; r++) { /* silu(g) = g / (1 + exp(-g)), as torch computes it */
        vec s = V_DIV(g[r], V_ADD(one, v_exp(V_SUB(V_ZERO(), g[r]))));
        V_STOREU(h + r * ldh, V_MUL(s, u[r]));
    }
}

/* y_r[2Lj..2Lj+2L] = w_r * (h_r . down panel j) for the tile's R rows (h_r: I floats; y_r: this pair's row
 * of the per-pair products, combined per token afterwards so that no two threads write one output row). */
__attribute__((always_inline)) static inline void down_tile(
    const int R, const float *h, int64_t I, const float *panel, float *const *y, const float *w) {
    vec a[MAX_ROWS], b[MAX_ROWS];
    for (int r = 0; r < R; r++) a[r] = b[r] = V_ZERO();
    for (int64_t k = 0; k < I; k++) {
        PREFETCH_ROW(panel + 2 * L * k);
        vec w0 = V_LOAD(panel + 2 * L * k), w1 = V_LOAD(panel + 2 * L * k + L);
        for (int r = 0; r < R; r++) {
            vec hb = V_BCAST(h + r * I + k);
            a[r] = V_FMADD(hb, w0, a[r]);
            b[r] = V_FMADD(hb, w1, b[r]);
        }
    }
    for (int r = 0; r < R; r++) { /* the product in float32: transformers' w * y, summed over A later */
        vec wr = V_SET1(w[r]);
        V_STOREU(y[r], V_MUL(a[r], wr));
        V_STOREU(y[r] + L, V_MUL(b[r], wr));
    }
}

/* One switch per tile: R is a constant in every branch, so the accumulators stay in registers. */
#if MAX_ROWS == 12
#define TILE_CASES(CALL)                                                                            \
    switch (R) {                                                                                    \
    case 1: CALL(1); break;  case 2: CALL(2); break;  case 3: CALL(3); break;  case 4: CALL(4); break;   \
    case 5: CALL(5); break;  case 6: CALL(6); break;  case 7: CALL(7); break;  case 8: CALL(8); break;   \
    case 9: CALL(9); break;  case 10: CALL(10); break; case 11: CALL(11); break; default: CALL(12); break; \
    }
#else
#define TILE_CASES(CALL)                                                                            \
    switch (R) {                                                                                    \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break;                         \
    case 4: CALL(4); break; case 5: CALL(5); break; default: CALL(6); break;                        \
    }
#endif


/* ---- bfloat16 ---- */

/* round to the nearest bfloat16, ties to even (torch's rounding), kept in float32 lanes with the low 16 bits
 * clear; NaN is not special-cased (a NaN activation is garbage either way) */
static inline vec v_bf16_round(vec v) {
    veci b = V_AS_I(v);
    b = VI_ADD(b, VI_ADD(VI_SET1(0x7FFF), VI_AND(VI_SRLI(b, 16), VI_SET1(1))));
    return VI_AS_F(VI_AND(b, VI_SET1((int)0xFFFF0000u)));
}

static inline int32_t bf16_pair(const uint16_t *p) { /* two bfloat16 as one 32-bit lane, without type punning */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#ifdef PDSERVE_BF16DP
/* acc += x[2i+1] * w[2i+1], then += x[2i] * w[2i], per float32 lane i (VDPBF16PS) */
#define BF16_DOT(acc, xpair, w) acc = _mm512_dpbf16_ps(acc, (__m512bh)(xpair), (__m512bh)(w))
#define BF16_SPLIT(w) /* nothing to widen: VDPBF16PS reads the pairs */
#else
/* the same two FMAs by widening: the even element of a pair is its low half (shift up), the odd its high half */
#define BF16_EVEN(v) VI_AS_F(VI_SLLI(v, 16))
#define BF16_ODD(v) VI_AS_F(VI_AND(v, VI_SET1((int)0xFFFF0000u)))
#define BF16_DOT(acc, xpair, w) \
    acc = V_FMADD(BF16_EVEN(xpair), w##_even, V_FMADD(BF16_ODD(xpair), w##_odd, acc))
#define BF16_SPLIT(w) const vec w##_even = BF16_EVEN(w), w##_odd = BF16_ODD(w);
#endif

/* h[r][Lj..Lj+L] = bf16(bf16(silu(bf16(x_r . gate))) * bf16(x_r . up)) for the tile's R rows (bfloat16 rows of
 * D), the roundings where torch's bfloat16 linear, silu and multiply round. */
__attribute__((always_inline)) static inline void gate_up_tile_bf16(
    const int R, const uint16_t *const *rows, const uint16_t *panel, int64_t D, uint16_t *h, int64_t ldh) {
    vec g[MAX_ROWS], u[MAX_ROWS];
    for (int r = 0; r < R; r++) g[r] = u[r] = V_ZERO();
    for (int64_t k2 = 0; k2 < D / 2; k2++) {
        const uint16_t *row = panel + 4 * L * k2;
        PREFETCH_SPAN(row, 4 * L * 2);
        const veci wg = VI_LOAD(row), wu = VI_LOAD(row + 2 * L);
        BF16_SPLIT(wg)
        BF16_SPLIT(wu)
        for (int r = 0; r < R; r++) {
            const veci xb = VI_SET1(bf16_pair(rows[r] + 2 * k2));
            BF16_DOT(g[r], xb, wg);
            BF16_DOT(u[r], xb, wu);
        }
    }
    const vec one = V_SET1(1.0f);
    for (int r = 0; r < R; r++) {
        const vec gr = v_bf16_round(g[r]), ur = v_bf16_round(u[r]);
        const vec s = v_bf16_round(V_DIV(gr, V_ADD(one, v_exp(V_SUB(V_ZERO(), gr)))));
        V_STORE_BF16(h + r * ldh, v_bf16_round(V_MUL(s, ur)));
    }
}

/* y_r[2Lj..2Lj+2L] = w_r * bf16(h_r . down panel j) (rounded to bfloat16 again when `round_products`: torch's
 * product of bfloat16 expert outputs and bfloat16 routing weights), float32 lanes. */
__attribute__((always_inline)) static inline void down_tile_bf16(
    const int R, const uint16_t *h, int64_t I, const uint16_t *panel, float *const *y, const float *w,
    int round_products) {
    vec a[MAX_ROWS], b[MAX_ROWS];
    for (int r = 0; r < R; r++) a[r] = b[r] = V_ZERO();
    for (int64_t k2 = 0; k2 < I / 2; k2++) {
        const uint16_t *row = panel + 4 * L * k2;
        PREFETCH_SPAN(row, 4 * L * 2);
        const veci w0 = VI_LOAD(row), w1 = VI_LOAD(row + 2 * L);
        BF16_SPLIT(w0)
        BF16_SPLIT(w1)
        for (int r = 0; r < R; r++) {
            const veci hb = VI_SET1(bf16_pair(h + r * I + 2 * k2));
            BF16_DOT(a[r], hb, w0);
            BF16_DOT(b[r], hb, w1);
        }
    }
    for (int r = 0; r < R; r++) {
        const vec wr = V_SET1(w[r]);
        vec ya = V_MUL(v_bf16_round(a[r]), wr), yb = V_MUL(v_bf16_round(b[r]), wr);
        if (round_products) ya = v_bf16_round(ya), yb = v_bf16_round(yb);
        V_STOREU(y[r], ya);
        V_STOREU(y[r] + L, yb);
    }
}

/* ---- int8, weight-only ---- */

/* int8 rows are 2L bytes: one prefetch per cache line, every 64 / 2L rows */
#define I8_ROWS_PER_LINE (64 / (2 * L))

/* gate_up_tile with the panel's weights int8, each vector dequantized (q * its columns' scales) before the FMAs:
 * the same operations on the same float32 values as gate_up_tile over the dequantized panel. */
__attribute__((always_inline)) static inline void gate_up_tile_i8(
    const int R, const float *const *rows, const int8_t *panel, const float *scale, int64_t D, float *h,
    int64_t ldh) {
    vec g[MAX_ROWS], u[MAX_ROWS];
    const vec sg = V_LOADU(scale), su = V_LOADU(scale + L);
    for (int r = 0; r < R; r++) g[r] = u[r] = V_ZERO();
    for (int64_t k = 0; k < D; k++) {
        if (k % I8_ROWS_PER_LINE == 0) PREFETCH_SPAN(panel + 2 * L * k, 64);
        const vec wg = V_MUL(V_I8(panel + 2 * L * k), sg), wu = V_MUL(V_I8(panel + 2 * L * k + L), su);
        for (int r = 0; r < R; r++) {
            vec xb = V_BCAST(rows[r] + k);
            g[r] = V_FMADD(xb, wg, g[r]);
            u[r] = V_FMADD(xb, wu, u[r]);
        }
    }
    const vec one = V_SET1(1.0f);
    for (int r = 0; r < R; r++) {
        vec s = V_DIV(g[r], V_ADD(one, v_exp(V_SUB(V_ZERO(), g[r]))));
        V_STOREU(h + r * ldh, V_MUL(s, u[r]));
    }
}

/* down_tile with int8 weights, dequantized as in gate_up_tile_i8 */
__attribute__((always_inline)) static inline void down_tile_i8(
    const int R, const float *h, int64_t I, const int8_t *panel, const float *scale, float *const *y,
    const float *w) {
    vec a[MAX_ROWS], b[MAX_ROWS];
    const vec s0 = V_LOADU(scale), s1 = V_LOADU(scale + L);
    for (int r = 0; r < R; r++) a[r] = b[r] = V_ZERO();
    for (int64_t k = 0; k < I; k++) {
        if (k % I8_ROWS_PER_LINE == 0) PREFETCH_SPAN(panel + 2 * L * k, 64);
        const vec w0 = V_MUL(V_I8(panel + 2 * L * k), s0), w1 = V_MUL(V_I8(panel + 2 * L * k + L), s1);
        for (int r = 0; r < R; r++) {
            vec hb = V_BCAST(h + r * I + k);
            a[r] = V_FMADD(hb, w0, a[r]);
            b[r] = V_FMADD(hb, w1, b[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        vec wr = V_SET1(w[r]);
        V_STOREU(y[r], V_MUL(a[r], wr));
        V_STOREU(y[r] + L, V_MUL(b[r], wr));
    }
}

/* ---- the driver ---- */

/* Per calling thread (calls from several threads at once are safe), shared with its OpenMP team, grown as
 * needed: h (P, I) SiLU(gate) * up (bfloat16: P x I halves of it) and y (P, D) weighted expert outputs, one row
 * per pair in sorted order; idx: order (P) the flat pair index t * A + a at each sorted position, pos (P) its
 * inverse, start (E + 1) where each expert's run begins, active (E) the experts with pairs. */
static __thread float *scratch = NULL;
static __thread int64_t scratch_floats = 0;
static __thread int64_t *idx = NULL;
static __thread int64_t idx_len = 0;

static int grow(int64_t floats, int64_t ints) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)((floats + 15) / 16 * 64));
        scratch_floats = scratch ? floats : 0;
        if (!scratch) return -1;
    }
    if (ints > idx_len) {
        free(idx);
        idx = malloc((size_t)ints * sizeof *idx);
        idx_len = idx ? ints : 0;
        if (!idx) return -1;
    }
    return 0;
}

enum kind { F32, BF16, I8 };

/* out (T, D) = sum over a of w[t][a] * expert_{ids[t][a]}(x[t]). ids: int64 (T, A) in [0, E); w: float32 (T, A).
 * x and out: float32, bfloat16 for BF16. gu, dn: the panels of `kind`; gus, dns: int8's scales (else unused).
 * `threads` OpenMP threads (the caller passes torch's intra-op count; the library links libgomp.so.1, which in
 * a torch process is torch's own, so the two share one thread pool). Gate/up tiles are (active expert, L-column
 * panel) and down tiles (active expert, 2L-column panel), handed out dynamically, so two threads share the work
 * even when one expert holds most rows. Every tile writes rows of its own; the per-token combine then adds a
 * token's A products in sorted (ascending expert) order from +0 (in float32; BF16 rounds the sum once): the same
 * bits whatever the thread count, and the same order of additions as the serial kernel had. load: NULL, or an
 * (E,) int64 counter each expert's routed rows are added to. Returns 0, or -1 when scratch could not be
 * allocated (nothing counted then). */
static int moe_run(enum kind kind, const void *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t A,
                   const int64_t *ids, const float *w, const void *gu, const float *gus, const void *dn,
                   const float *dns, void *out, int threads, int round_products, int64_t *load) {
    const int64_t P = T * A;
    if (grow(P * (I + D), 2 * P + 2 * E + 1) != 0) return -1;
    int64_t *order = idx, *pos = idx + P, *start = idx + 2 * P, *active = idx + 2 * P + E + 1;
    float *h = scratch, *y = scratch + P * I;
    uint16_t *h16 = (uint16_t *)scratch; /* BF16's h: P x I bfloat16 */
    memset(start, 0, (size_t)(E + 1) * sizeof *start);
    for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
    if (load) /* the caller's per-expert counter (MoE.expert_load): the counts come with the sort */
        for (int64_t e = 0; e < E; e++) load[e] += start[e + 1];
    int64_t n_active = 0;
    for (int64_t e = 0; e < E; e++) {
        if (start[e + 1] > 0) active[n_active++] = e;
        start[e + 1] += start[e];
    }
    {
        int64_t fill[E]; /* where each expert's next pair goes */
        memcpy(fill, start, (size_t)E * sizeof *fill);
        for (int64_t p = 0; p < P; p++) order[fill[ids[p]]++] = p; /* stable: a token's pairs keep their order */
    }
    for (int64_t s = 0; s < P; s++) pos[order[s]] = s;
    const int64_t gu_panels = I / L, dn_panels = D / (2 * L);
    /* every format's panel holds D x 2L (gate/up) or I x 2L (down) elements */
    const float *x32 = x, *gu32 = gu, *dn32 = dn;
    const uint16_t *x16 = x, *gu16 = gu, *dn16 = dn;
    const int8_t *gu8 = gu, *dn8 = dn;
#pragma omp parallel num_threads(threads > 1 ? threads : 1) if (threads > 1)
    {
        const float *rows[MAX_ROWS];
        const uint16_t *rows16[MAX_ROWS];
        float *ys[MAX_ROWS];
        float wts[MAX_ROWS];
#pragma omp for schedule(dynamic, 4)
        for (int64_t k = 0; k < n_active * gu_panels; k++) {
            const int64_t e = active[k / gu_panels], j = k % gu_panels, s = start[e], n = start[e + 1] - s;
            const int64_t panel = (e * gu_panels + j) * D * 2 * L; /* in elements */
            const float *scale = gus ? gus + (e * gu_panels + j) * 2 * L : NULL;
            /* balanced tiles: with 6-row tiles 8 rows are 4 + 4, not 6 + 2 */
            const int64_t tiles = (n + MAX_ROWS - 1) / MAX_ROWS, per = (n + tiles - 1) / tiles;
            for (int64_t r0 = 0; r0 < n; r0 += per) {
                int R = (int)(n - r0 < per ? n - r0 : per);
                for (int r = 0; r < R; r++) {
                    rows[r] = x32 + (order[s + r0 + r] / A) * D;
                    rows16[r] = x16 + (order[s + r0 + r] / A) * D;
                }
                if (kind == F32) {
#define GU(RR) gate_up_tile(RR, rows, gu32 + panel, D, h + (s + r0) * I + L * j, I)
                    TILE_CASES(GU)
#undef GU
                } else if (kind == BF16) {
#define GU(RR) gate_up_tile_bf16(RR, rows16, gu16 + panel, D, h16 + (s + r0) * I + L * j, I)
                    TILE_CASES(GU)
#undef GU
                } else {
#define GU(RR) gate_up_tile_i8(RR, rows, gu8 + panel, scale, D, h + (s + r0) * I + L * j, I)
                    TILE_CASES(GU)
#undef GU
                }
            }
        } /* implicit barrier: every h row is complete before a down tile reads it */
#pragma omp for schedule(dynamic, 2)
        for (int64_t k = 0; k < n_active * dn_panels; k++) {
            const int64_t e = active[k / dn_panels], j = k % dn_panels, s = start[e], n = start[e + 1] - s;
            const int64_t panel = (e * dn_panels + j) * I * 2 * L;
            const float *scale = dns ? dns + (e * dn_panels + j) * 2 * L : NULL;
            const int64_t tiles = (n + MAX_ROWS - 1) / MAX_ROWS, per = (n + tiles - 1) / tiles;
            for (int64_t r0 = 0; r0 < n; r0 += per) {
                int R = (int)(n - r0 < per ? n - r0 : per);
                for (int r = 0; r < R; r++) {
                    ys[r] = y + (s + r0 + r) * D + 2 * L * j;
                    wts[r] = w[order[s + r0 + r]];
                }
                if (kind == F32) {
#define DN(RR) down_tile(RR, h + (s + r0) * I, I, dn32 + panel, ys, wts)
                    TILE_CASES(DN)
#undef DN
                } else if (kind == BF16) {
#define DN(RR) down_tile_bf16(RR, h16 + (s + r0) * I, I, dn16 + panel, ys, wts, round_products)
                    TILE_CASES(DN)
#undef DN
                } else {
#define DN(RR) down_tile_i8(RR, h + (s + r0) * I, I, dn8 + panel, scale, ys, wts)
                    TILE_CASES(DN)
#undef DN
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) { /* the combine: one thread per token row */
            int64_t mine[A]; /* this token's sorted positions, ascending (insertion sort: A is small) */
            for (int64_t a = 0; a < A; a++) {
                int64_t v = pos[t * A + a], b = a;
                for (; b > 0 && mine[b - 1] > v; b--) mine[b] = mine[b - 1];
                mine[b] = v;
            }
            for (int64_t c = 0; c < D; c += L) {
                vec acc = V_ZERO();
                for (int64_t a = 0; a < A; a++) acc = V_ADD(acc, V_LOADU(y + mine[a] * D + c));
                if (kind == BF16)
                    V_STORE_BF16((uint16_t *)out + t * D + c, v_bf16_round(acc));
                else
                    V_STOREU((float *)out + t * D + c, acc);
            }
        }
    }
    return 0;
}

int pdserve_moe_f32(const float *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t A, const int64_t *ids,
                    const float *w, const float *gu, const float *dn, float *out, int threads, int64_t *load) {
    return moe_run(F32, x, T, D, I, E, A, ids, w, gu, NULL, dn, NULL, out, threads, 0, load);
}

/* x, out: bfloat16 (T, D) as uint16; gu, dn: bfloat16 panels; round_products: the routing weights are bfloat16
 * (torch then rounds each weighted expert output to bfloat16 before the sum) */
int pdserve_moe_bf16(const uint16_t *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t A, const int64_t *ids,
                     const float *w, const uint16_t *gu, const uint16_t *dn, uint16_t *out, int threads,
                     int round_products, int64_t *load) {
    return moe_run(BF16, x, T, D, I, E, A, ids, w, gu, NULL, dn, NULL, out, threads, round_products, load);
}

/* x, out: float32; gu, dn: int8 panels; gus, dns: their float32 per-column scales */
int pdserve_moe_i8(const float *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t A, const int64_t *ids,
                   const float *w, const int8_t *gu, const float *gus, const int8_t *dn, const float *dns, float *out,
                   int threads, int64_t *load) {
    return moe_run(I8, x, T, D, I, E, A, ids, w, gu, gus, dn, dns, out, threads, 0, load);
}

/* A dense linear in float32: out (M, N) = x (M, K) @ W.T with W in one expert's down-panel layout (N/2L, K, 2L);
 * N % 2L == 0 (shared/model/panel_linear.py pads). In place of oneDNN's packed GEMM, which pays a per-call
 * overhead and streams a decode step's few rows below the read bandwidth: each panel is read once per tile of up
 * to MAX_ROWS rows, in order, with a routing weight of 1 (an exact multiply). Products summed in k order (not
 * oneDNN's blocking: the last bits differ). Returns 0. */
int pdserve_linear_f32(const float *x, int64_t M, int64_t K, int64_t N, const float *w, float *out, int threads) {
    const int64_t panels = N / (2 * L), tiles = (M + MAX_ROWS - 1) / MAX_ROWS, per = (M + tiles - 1) / tiles;
#pragma omp parallel num_threads(threads > 1 ? threads : 1) if (threads > 1)
    {
        float *ys[MAX_ROWS];
        float ones[MAX_ROWS];
        for (int r = 0; r < MAX_ROWS; r++) ones[r] = 1.0f;
#pragma omp for schedule(dynamic, 2)
        for (int64_t k = 0; k < panels * tiles; k++) {
            const int64_t j = k % panels, r0 = (k / panels) * per;
            if (r0 >= M) continue;
            const int R = (int)(M - r0 < per ? M - r0 : per);
            for (int r = 0; r < R; r++) ys[r] = out + (r0 + r) * N + 2 * L * j;
#define DN(RR) down_tile(RR, x + r0 * K, K, w + j * K * 2 * L, ys, ones)
            TILE_CASES(DN)
#undef DN
        }
    }
    return 0;
}

/* A dense linear with int8 weights: out (M, N) = x (M, K) @ (q * scale).T, float32, the weights in one expert's
 * down-panel layout (N/2L, K, 2L) with scales (N/2L, 2L); N % 2L == 0. Tiles of (panel, up to MAX_ROWS rows)
 * run down_tile_i8 with routing weight 1 (an exact multiply). Returns 0. */
int pdserve_linear_i8(const float *x, int64_t M, int64_t K, int64_t N, const int8_t *q, const float *scale,
                      float *out, int threads) {
    const int64_t panels = N / (2 * L), tiles = (M + MAX_ROWS - 1) / MAX_ROWS, per = (M + tiles - 1) / tiles;
#pragma omp parallel num_threads(threads > 1 ? threads : 1) if (threads > 1)
    {
        float *ys[MAX_ROWS];
        float ones[MAX_ROWS];
        for (int r = 0; r < MAX_ROWS; r++) ones[r] = 1.0f;
#pragma omp for schedule(dynamic, 2)
        for (int64_t k = 0; k < panels * tiles; k++) {
            const int64_t j = k % panels, r0 = (k / panels) * per;
            if (r0 >= M) continue;
            const int R = (int)(M - r0 < per ? M - r0 : per);
            for (int r = 0; r < R; r++) ys[r] = out + (r0 + r) * N + 2 * L * j;
#define DN(RR) down_tile_i8(RR, x + r0 * K, K, q + j * K * 2 * L, scale + j * 2 * L, ys, ones)
            TILE_CASES(DN)
#undef DN
        }
    }
    return 0;
}
