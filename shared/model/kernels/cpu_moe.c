/* The routed experts of one MoE layer for a few tokens, float32: counting sort of the (token, expert) pairs,
 * then per active expert gate/up, SiLU(gate) * up and down, and the routing-weighted sum into the output rows,
 * all in one call (shared/model/kernels/cpu_moe.py builds this file with gcc at first use and calls it through
 * ctypes; shared/model/moe.py's torch paths are the reference it is tested against).
 *
 * Why: decode routes ~8 rows to each expert, and BLAS GEMMs at M = 8 run far from the FMA peak (they pack the
 * weight on every call); here the weights are re-laid out once into panels that a register-blocked micro-kernel
 * streams in order, each panel read once per tile of up to MAX_ROWS rows.
 *
 * One source, two builds: -DPDSERVE_ISA=256 (AVX2 + FMA: vectors of L = 8 floats, tiles of up to 6 rows) and
 * -DPDSERVE_ISA=512 (AVX-512F: L = 16, tiles of up to 12 rows, software prefetch of the panel stream). Both add
 * the same products in the same order with the same operations, so they give the same bits.
 *
 * Shapes: T tokens, D hidden, I intermediate, E experts, A top-k. D % 2L == 0 and I % L == 0 (the caller checks).
 *   gu: (E, I/L, D, 2L)  panel j of expert e, row k: gate[e][Lj..Lj+L][k] then up[e][Lj..Lj+L][k]
 *   dn: (E, D/2L, I, 2L) panel j of expert e, row k: down[e][2Lj..2Lj+2L][k]
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
#if PDSERVE_ISA == 512
    return __builtin_cpu_supports("avx512f");
#else
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
}

int pdserve_lanes(void) { return PDSERVE_ISA / 32; } /* L: floats per vector, what the panel layout needs */

#if PDSERVE_ISA == 512
#pragma GCC target("avx512f")
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
#define PREFETCH_ROW(row)                                    \
    for (int line = 0; line < 2 * L * 4; line += 64) {       \
        PREFETCH_LINE(row, PDSERVE_PREFETCH, _MM_HINT_T0);    \
        PREFETCH_LINE(row, PDSERVE_PREFETCH_L2, _MM_HINT_T1); \
    }

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

/* Per calling thread (calls from several threads at once are safe), shared with its OpenMP team, grown as
 * needed: h (P, I) SiLU(gate) * up and y (P, D) weighted expert outputs, one row per pair in sorted order;
 * idx: order (P) the flat pair index t * A + a at each sorted position, pos (P) its inverse, start (E + 1)
 * where each expert's run begins, active (E) the experts with pairs. */
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

/* out (T, D) = sum over a of w[t][a] * expert_{ids[t][a]}(x[t]). ids: int64 (T, A) in [0, E); w: float32 (T, A).
 * `threads` OpenMP threads (the caller passes torch's intra-op count; the library links libgomp.so.1, which in
 * a torch process is torch's own, so the two share one thread pool). Gate/up tiles are (active expert, L-column
 * panel) and down tiles (active expert, 2L-column panel), handed out dynamically, so two threads share the work
 * even when one expert holds most rows. Every tile writes rows of its own; the per-token combine then adds a
 * token's A products in sorted (ascending expert) order from +0: the same bits whatever the thread count, and
 * the same order of additions as the serial kernel had. Returns 0, or -1 when scratch could not be allocated. */
int pdserve_moe_f32(const float *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t A, const int64_t *ids,
                    const float *w, const float *gu, const float *dn, float *out, int threads) {
    const int64_t P = T * A;
    if (grow(P * (I + D), 2 * P + 2 * E + 1) != 0) return -1;
    int64_t *order = idx, *pos = idx + P, *start = idx + 2 * P, *active = idx + 2 * P + E + 1;
    float *h = scratch, *y = scratch + P * I;
    memset(start, 0, (size_t)(E + 1) * sizeof *start);
    for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
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
#pragma omp parallel num_threads(threads > 1 ? threads : 1) if (threads > 1)
    {
        const float *rows[MAX_ROWS];
        float *ys[MAX_ROWS];
        float wts[MAX_ROWS];
#pragma omp for schedule(dynamic, 4)
        for (int64_t k = 0; k < n_active * gu_panels; k++) {
            const int64_t e = active[k / gu_panels], j = k % gu_panels, s = start[e], n = start[e + 1] - s;
            const float *panel = gu + (e * gu_panels + j) * D * 2 * L;
            /* balanced tiles: with 6-row tiles 8 rows are 4 + 4, not 6 + 2 */
            const int64_t tiles = (n + MAX_ROWS - 1) / MAX_ROWS, per = (n + tiles - 1) / tiles;
            for (int64_t r0 = 0; r0 < n; r0 += per) {
                int R = (int)(n - r0 < per ? n - r0 : per);
                for (int r = 0; r < R; r++) rows[r] = x + (order[s + r0 + r] / A) * D;
#define GU(RR) gate_up_tile(RR, rows, panel, D, h + (s + r0) * I + L * j, I)
                TILE_CASES(GU)
#undef GU
            }
        } /* implicit barrier: every h row is complete before a down tile reads it */
#pragma omp for schedule(dynamic, 2)
        for (int64_t k = 0; k < n_active * dn_panels; k++) {
            const int64_t e = active[k / dn_panels], j = k % dn_panels, s = start[e], n = start[e + 1] - s;
            const float *panel = dn + (e * dn_panels + j) * I * 2 * L;
            const int64_t tiles = (n + MAX_ROWS - 1) / MAX_ROWS, per = (n + tiles - 1) / tiles;
            for (int64_t r0 = 0; r0 < n; r0 += per) {
                int R = (int)(n - r0 < per ? n - r0 : per);
                for (int r = 0; r < R; r++) {
                    ys[r] = y + (s + r0 + r) * D + 2 * L * j;
                    wts[r] = w[order[s + r0 + r]];
                }
#define DN(RR) down_tile(RR, h + (s + r0) * I, I, panel, ys, wts)
                TILE_CASES(DN)
#undef DN
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
            float *o = out + t * D;
            for (int64_t c = 0; c < D; c += L) {
                vec acc = V_ZERO();
                for (int64_t a = 0; a < A; a++) acc = V_ADD(acc, V_LOADU(y + mine[a] * D + c));
                V_STOREU(o + c, acc);
            }
        }
    }
    return 0;
}
