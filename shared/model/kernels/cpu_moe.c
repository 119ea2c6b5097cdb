/* The routed experts of one MoE layer for a few tokens, float32, AVX2 + FMA: counting sort of the (token,
 * expert) pairs, then per active expert gate/up, SiLU(gate) * up and down, and the routing-weighted sum into
 * the output rows, all in one call (shared/model/kernels/cpu_moe.py builds this file with gcc at first use and
 * calls it through ctypes; shared/model/moe.py's torch paths are the reference it is tested against).
 *
 * Why: decode routes ~8 rows to each expert, and BLAS GEMMs at M = 8 run far from the FMA peak (they pack the
 * weight on every call); here the weights are re-laid out once into panels that a register-blocked micro-kernel
 * streams in order, each panel read once per tile of up to 6 rows.
 *
 * Shapes: T tokens, D hidden, I intermediate, E experts, A top-k. D % 16 == 0 and I % 8 == 0 (the caller checks).
 *   gu: (E, I/8, D, 16)  panel j of expert e, row k: gate[e][8j..8j+8][k] then up[e][8j..8j+8][k]
 *   dn: (E, D/16, I, 16) panel j of expert e, row k: down[e][16j..16j+16][k]
 * Accumulation is float32 FMA in k order (not MKL's blocking: results differ from torch's in the last bits).
 * Threads (OpenMP, built with -fopenmp) split the (expert, panel) tiles; the result does not depend on their count.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 6 /* rows per register tile: 6 x (2 x 8 floats) accumulators + 2 weight vectors + 1 broadcast */

int pdserve_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* exp(x), Cephes' single-precision polynomial (about 1 ulp over the clamped range). */
__attribute__((target("avx2,fma"))) static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

/* h[r][8j..8j+8] = silu(x_r . gate) * (x_r . up) for the tile's R rows (x_r = rows[r], D floats each). */
__attribute__((target("avx2,fma"), always_inline)) static inline void gate_up_tile(
    const int R, const float *const *rows, const float *panel, int64_t D, float *h, int64_t ldh) {
    __m256 g[MAX_ROWS], u[MAX_ROWS];
    for (int r = 0; r < R; r++) g[r] = u[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < D; k++) {
        __m256 wg = _mm256_load_ps(panel + 16 * k), wu = _mm256_load_ps(panel + 16 * k + 8);
        for (int r = 0; r < R; r++) {
            __m256 xb = _mm256_broadcast_ss(rows[r] + k);
            g[r] = _mm256_fmadd_ps(xb, wg, g[r]);
            u[r] = _mm256_fmadd_ps(xb, wu, u[r]);
        }
    }
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int r = 0; r < R; r++) {  /* silu(g) = g / (1 + exp(-g)), as torch computes it */
        __m256 s = _mm256_div_ps(g[r], _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g[r]))));
        _mm256_storeu_ps(h + r * ldh, _mm256_mul_ps(s, u[r]));
    }
}

/* y_r[16j..16j+16] = w_r * (h_r . down panel j) for the tile's R rows (h_r: I floats; y_r: this pair's row
 * of the per-pair products, combined per token afterwards so that no two threads write one output row). */
__attribute__((target("avx2,fma"), always_inline)) static inline void down_tile(
    const int R, const float *h, int64_t I, const float *panel, float *const *y, const float *w) {
    __m256 a[MAX_ROWS], b[MAX_ROWS];
    for (int r = 0; r < R; r++) a[r] = b[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < I; k++) {
        __m256 w0 = _mm256_load_ps(panel + 16 * k), w1 = _mm256_load_ps(panel + 16 * k + 8);
        for (int r = 0; r < R; r++) {
            __m256 hb = _mm256_broadcast_ss(h + r * I + k);
            a[r] = _mm256_fmadd_ps(hb, w0, a[r]);
            b[r] = _mm256_fmadd_ps(hb, w1, b[r]);
        }
    }
    for (int r = 0; r < R; r++) {  /* the product in float32: transformers' w * y, summed over A later */
        __m256 wr = _mm256_set1_ps(w[r]);
        _mm256_storeu_ps(y[r], _mm256_mul_ps(a[r], wr));
        _mm256_storeu_ps(y[r] + 8, _mm256_mul_ps(b[r], wr));
    }
}

/* One switch per tile: R is a constant in every branch, so the accumulators stay in registers. */
#define TILE_CASES(CALL) \
    switch (R) {         \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    case 4: CALL(4); break; \
    case 5: CALL(5); break; \
    default: CALL(6); break; \
    }

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
 * a torch process is torch's own, so the two share one thread pool). Gate/up tiles are (active expert, 8-column
 * panel) and down tiles (active expert, 16-column panel), handed out dynamically, so two threads share the work
 * even when one expert holds most rows. Every tile writes rows of its own; the per-token combine then adds a
 * token's A products in sorted (ascending expert) order from +0: the same bits whatever the thread count, and
 * the same order of additions as the serial kernel had. Returns 0, or -1 when scratch could not be allocated. */
__attribute__((target("avx2,fma"))) int pdserve_moe_f32(
    const float *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t A, const int64_t *ids, const float *w,
    const float *gu, const float *dn, float *out, int threads) {
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
    const int64_t gu_panels = I / 8, dn_panels = D / 16;
#pragma omp parallel num_threads(threads > 1 ? threads : 1) if (threads > 1)
    {
        const float *rows[MAX_ROWS];
        float *ys[MAX_ROWS];
        float wts[MAX_ROWS];
#pragma omp for schedule(dynamic, 4)
        for (int64_t k = 0; k < n_active * gu_panels; k++) {
            const int64_t e = active[k / gu_panels], j = k % gu_panels, s = start[e], n = start[e + 1] - s;
            const float *panel = gu + (e * gu_panels + j) * D * 16;
            const int64_t tiles = (n + MAX_ROWS - 1) / MAX_ROWS, per = (n + tiles - 1) / tiles; /* 8 = 4 + 4 */
            for (int64_t r0 = 0; r0 < n; r0 += per) {
                int R = (int)(n - r0 < per ? n - r0 : per);
                for (int r = 0; r < R; r++) rows[r] = x + (order[s + r0 + r] / A) * D;
#define GU(RR) gate_up_tile(RR, rows, panel, D, h + (s + r0) * I + 8 * j, I)
                TILE_CASES(GU)
#undef GU
            }
        } /* implicit barrier: every h row is complete before a down tile reads it */
#pragma omp for schedule(dynamic, 2)
        for (int64_t k = 0; k < n_active * dn_panels; k++) {
            const int64_t e = active[k / dn_panels], j = k % dn_panels, s = start[e], n = start[e + 1] - s;
            const float *panel = dn + (e * dn_panels + j) * I * 16;
            const int64_t tiles = (n + MAX_ROWS - 1) / MAX_ROWS, per = (n + tiles - 1) / tiles;
            for (int64_t r0 = 0; r0 < n; r0 += per) {
                int R = (int)(n - r0 < per ? n - r0 : per);
                for (int r = 0; r < R; r++) {
                    ys[r] = y + (s + r0 + r) * D + 16 * j;
                    wts[r] = w[order[s + r0 + r]];
                }
#define DN(RR) down_tile(RR, h + (s + r0) * I, I, panel, ys, wts)
                TILE_CASES(DN)
#undef DN
            }
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {  /* the combine: one thread per token row */
            int64_t mine[A]; /* this token's sorted positions, ascending (insertion sort: A is small) */
            for (int64_t a = 0; a < A; a++) {
                int64_t v = pos[t * A + a], b = a;
                for (; b > 0 && mine[b - 1] > v; b--) mine[b] = mine[b - 1];
                mine[b] = v;
            }
            float *o = out + t * D;
            for (int64_t c = 0; c < D; c += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t a = 0; a < A; a++) acc = _mm256_add_ps(acc, _mm256_loadu_ps(y + mine[a] * D + c));
                _mm256_storeu_ps(o + c, acc);
            }
        }
    }
    return 0;
}
