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
 * The scratch rows are thread-local: calls from several threads at once are safe.
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

/* out[token_r][16j..16j+16] += w_r * (h_r . down panel j) for the tile's R rows (h_r: I floats). */
__attribute__((target("avx2,fma"), always_inline)) static inline void down_tile(
    const int R, const float *h, int64_t I, const float *panel, float *const *out, const float *w) {
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
    for (int r = 0; r < R; r++) {  /* the product in float32, then added: transformers' w * y, summed over A */
        __m256 wr = _mm256_set1_ps(w[r]);
        _mm256_storeu_ps(out[r], _mm256_add_ps(_mm256_loadu_ps(out[r]), _mm256_mul_ps(a[r], wr)));
        _mm256_storeu_ps(out[r] + 8, _mm256_add_ps(_mm256_loadu_ps(out[r] + 8), _mm256_mul_ps(b[r], wr)));
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

static __thread float *scratch = NULL; /* (rows of the largest expert, I) SiLU(gate) * up, grown as needed */
static __thread int64_t scratch_floats = 0;
static __thread int64_t *order = NULL; /* pairs sorted by expert: index t * A + a of the flat routing */
static __thread int64_t order_len = 0;

static int grow(int64_t floats, int64_t pairs) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)((floats + 15) / 16 * 64));
        scratch_floats = scratch ? floats : 0;
        if (!scratch) return -1;
    }
    if (pairs > order_len) {
        free(order);
        order = malloc((size_t)pairs * sizeof *order);
        order_len = order ? pairs : 0;
        if (!order) return -1;
    }
    return 0;
}

/* out (T, D) = sum over a of w[t][a] * expert_{ids[t][a]}(x[t]). ids: int64 (T, A) in [0, E); w: float32 (T, A).
 * Returns 0, or -1 when scratch memory could not be allocated (out is then undefined). */
__attribute__((target("avx2,fma"))) int pdserve_moe_f32(
    const float *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t A, const int64_t *ids, const float *w,
    const float *gu, const float *dn, float *out) {
    int64_t P = T * A;
    if (grow(T * I, P + E + 1) != 0) return -1;
    int64_t *start = order + P; /* (E + 1,) where each expert's run of sorted pairs starts */
    memset(start, 0, (size_t)(E + 1) * sizeof *start);
    for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    {
        int64_t fill[E]; /* where each expert's next pair goes */
        memcpy(fill, start, (size_t)E * sizeof *fill);
        for (int64_t p = 0; p < P; p++) order[fill[ids[p]]++] = p; /* stable: a token's pairs keep their order */
    }
    memset(out, 0, (size_t)(T * D) * sizeof *out);
    const float *rows[MAX_ROWS];
    float *outs[MAX_ROWS];
    float wts[MAX_ROWS];
    for (int64_t e = 0; e < E; e++) {
        int64_t n = start[e + 1] - start[e];
        if (n == 0) continue;
        const int64_t *pairs = order + start[e];
        const float *gu_e = gu + e * I * D * 2, *dn_e = dn + e * D * I;
        int64_t tiles = (n + MAX_ROWS - 1) / MAX_ROWS, per = (n + tiles - 1) / tiles; /* balanced: 8 = 4 + 4 */
        for (int64_t j = 0; j < I / 8; j++) {  /* each panel once, for every tile of this expert's rows */
            const float *panel = gu_e + j * D * 16;
            for (int64_t r0 = 0; r0 < n; r0 += per) {
                int R = (int)(n - r0 < per ? n - r0 : per);
                for (int r = 0; r < R; r++) rows[r] = x + (pairs[r0 + r] / A) * D;
#define GU(RR) gate_up_tile(RR, rows, panel, D, scratch + r0 * I + 8 * j, I)
                TILE_CASES(GU)
#undef GU
            }
        }
        for (int64_t j = 0; j < D / 16; j++) {
            const float *panel = dn_e + j * I * 16;
            for (int64_t r0 = 0; r0 < n; r0 += per) {
                int R = (int)(n - r0 < per ? n - r0 : per);
                for (int r = 0; r < R; r++) {
                    outs[r] = out + (pairs[r0 + r] / A) * D + 16 * j;
                    wts[r] = w[pairs[r0 + r]];
                }
#define DN(RR) down_tile(RR, scratch + r0 * I, I, panel, outs, wts)
                TILE_CASES(DN)
#undef DN
            }
        }
    }
    return 0;
}
