/* Paged decode attention on CPU, float32: every decode token of one layer attends over its own sequence's
 * KV blocks read in place from the cache, in one call (shared/model/kernels/cpu_attention.py builds this file
 * with gcc at first use and calls it through ctypes; the torch bucket path of shared/model/paged_attention.py
 * is the reference it is tested against).
 *
 * Why: the torch path copies each bucket's blocks out of the cache (index_select) before SDPA; at decode the
 * copy costs more than the attention. Here each K/V row is read once, where it lies.
 *
 * Shapes: Bd decode tokens (one per sequence), H query heads, KVH KV heads, g = H / KVH, hd head dim, N blocks
 * of B slots. cache (2, N, B, KVH, hd): K half then V half, slot = block * B + offset. q, out (Bd, H, hd);
 * query head j*g + i uses KV head j. tables (Bd, NBmax) int64 block ids, lens (Bd,) int64 keys per sequence
 * (this step's token included, its K/V already in the cache). window > 0: keys more than window - 1 behind the
 * query (at lens - 1) are masked.
 *
 * Per (sequence, KV head) one online softmax (running max and sum) over tiles of TILE keys, the g query heads of
 * that KV head together, so each K and V row is loaded once for all g. Vectors run along hd: W = 16 floats
 * (AVX-512) when hd % 16 == 0, else 8 (AVX2), chosen at run time; a tile's scores are W-lane FMA partial sums
 * per (query, key), folded W keys at a time into one vector of scores (no horizontal sum per key), and the values
 * accumulate by FMA. The (sequence, KV head) pairs are handed to OpenMP threads dynamically; each pair is
 * computed by one thread in a fixed order, so the result is bitwise the same at any thread count. Sums run in
 * another order than SDPA's: results differ in the last bits.
 */
#ifndef PDSERVE_ATTN_ISA
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 16 /* keys per online-softmax step */

/* 16: AVX-512F, 8: AVX2 + FMA, 0: neither (the caller keeps the torch path). */
int pdserve_attention_width(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 8;
    return 0;
}

struct args {
    const float *q, *k, *v;
    const int64_t *tables, *lens;
    float *out;
    int64_t H, KVH, hd, B, nb_max, window;
    float scale;
};

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* the per-ISA half of this file, twice: `attend_avx2` and `attend_avx512` */
#define PDSERVE_ATTN_ISA 1
#define W 8
#define SUF avx2
#define TARGET "avx2,fma"
#define FMA(a, b, c) ((VF)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#include "cpu_attention.c" /* this file again (found next to itself) */
#undef W
#undef SUF
#undef TARGET
#undef FMA
#define W 16
#define SUF avx512
#define TARGET "avx512f"
#define FMA(a, b, c) ((VF)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#include "cpu_attention.c" /* this file again (found next to itself) */
#undef W
#undef SUF
#undef TARGET
#undef FMA

/* out = attention of every decode token; `threads` OpenMP threads (torch's intra-op count: the library links
 * libgomp.so.1, torch's own in a torch process). Returns 0, or -1 when no ISA this CPU has fits hd. */
int pdserve_paged_decode_f32(const float *q, const float *cache, const int64_t *tables, const int64_t *lens,
                             float *out, int64_t Bd, int64_t H, int64_t KVH, int64_t hd, int64_t N, int64_t B,
                             int64_t nb_max, int64_t window, float scale, int threads) {
    const int width = pdserve_attention_width();
    void (*attend)(const struct args *, int64_t, int64_t);
    if (width == 16 && hd % 16 == 0)
        attend = attend_avx512;
    else if (width >= 8 && hd % 8 == 0)
        attend = attend_avx2;
    else
        return -1;
    const struct args a = {q, cache, cache + N * B * KVH * hd, tables, lens, out, H, KVH, hd, B, nb_max, window, scale};
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 1 ? threads : 1) if (threads > 1)
    for (int64_t p = 0; p < Bd * KVH; p++) attend(&a, p / KVH, p % KVH);
    return 0;
}

/* The same after writing this step's K/V rows into the cache: token b's k row (KVH * hd floats, contiguous, at
 * k + b * ks) and v row (at v + b * vs) go to slot slots[b] of the K and V halves, as the torch path's
 * index_copy_ writes them (the same bytes), before any sequence attends. One call instead of five torch ops a
 * layer. Returns -2 (nothing written) when a slot lies outside the cache, else as pdserve_paged_decode_f32. */
int pdserve_write_paged_decode_f32(const float *q, const float *k, int64_t ks, const float *v, int64_t vs,
                                   const int64_t *slots, float *cache, const int64_t *tables, const int64_t *lens,
                                   float *out, int64_t Bd, int64_t H, int64_t KVH, int64_t hd, int64_t N, int64_t B,
                                   int64_t nb_max, int64_t window, float scale, int threads) {
    const int64_t row = KVH * hd;
    float *kc = cache, *vc = cache + N * B * row;
    for (int64_t b = 0; b < Bd; b++)
        if (slots[b] < 0 || slots[b] >= N * B) return -2;
    for (int64_t b = 0; b < Bd; b++) {
        memcpy(kc + slots[b] * row, k + b * ks, (size_t)row * sizeof(float));
        memcpy(vc + slots[b] * row, v + b * vs, (size_t)row * sizeof(float));
    }
    return pdserve_paged_decode_f32(q, cache, tables, lens, out, Bd, H, KVH, hd, N, B, nb_max, window, scale, threads);
}

#else /* PDSERVE_ATTN_ISA: one ISA's kernel, W floats per vector */

typedef float CAT(vf, W) __attribute__((vector_size(4 * W)));
typedef int32_t CAT(vi, W) __attribute__((vector_size(4 * W)));
typedef float CAT(vfu, W) __attribute__((vector_size(4 * W), aligned(4))); /* unaligned loads and stores */
#define VF CAT(vf, W)
#define VI CAT(vi, W)
#define VFU CAT(vfu, W)

/* exp(x) for x <= 0 (softmax: scores minus their max), Cephes' single-precision polynomial (about 1 ulp);
 * below -87.3 it returns exp(-87.3) ~ 1e-38 instead of a denormal or 0. */
__attribute__((target(TARGET))) static inline VF CAT(exp_, SUF)(VF x) {
    const VF lo = (VF){} - 87.3f;
    const VI below = x < lo;
    x = (VF)(((VI)x & ~below) | ((VI)lo & below));
    const VF magic = (VF){} + 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    const VF fx = (x * 1.44269504088896341f + magic) - magic;
    x = x - fx * 0.693359375f;
    x = x - fx * -2.12194440e-4f;
    VF y = (VF){} + 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + (x + 1.0f);
    const VI pow2n = (__builtin_convertvector(fx, VI) + 127) << 23;
    return y * (VF)pow2n;
}

/* fold(x, y): lanes LO... of x|y (indices W.. are y's) plus the lanes h further on: each block of 2h lanes of x
 * and of y halved into h lanes of partial sums, x's block before y's */
#define FOLD(x, y, h, ...) (__builtin_shuffle(x, y, (VI){__VA_ARGS__}) + __builtin_shuffle(x, y, (VI){__VA_ARGS__} + h))

/* W vectors → one: lane t is the sum of the lanes of the vector for key t, where v holds key t's vector at
 * v[REV[t]] (bit-reversed: the folds deliver the keys in natural order). A fixed order of additions. */
#if W == 16
static const int CAT(rev_, SUF)[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
__attribute__((target(TARGET))) static inline VF CAT(reduce_, SUF)(const VF *v) {
    VF e[8], f[4], h[2];
    for (int p = 0; p < 8; p++)
        e[p] = FOLD(v[2 * p], v[2 * p + 1], 8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    for (int p = 0; p < 4; p++)
        f[p] = FOLD(e[2 * p], e[2 * p + 1], 4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    for (int p = 0; p < 2; p++)
        h[p] = FOLD(f[2 * p], f[2 * p + 1], 2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    return FOLD(h[0], h[1], 1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
}
#else
static const int CAT(rev_, SUF)[8] = {0, 4, 2, 6, 1, 5, 3, 7};
__attribute__((target(TARGET))) static inline VF CAT(reduce_, SUF)(const VF *v) {
    VF e[4], f[2];
    for (int p = 0; p < 4; p++) e[p] = FOLD(v[2 * p], v[2 * p + 1], 4, 0, 1, 2, 3, 8, 9, 10, 11);
    for (int p = 0; p < 2; p++) f[p] = FOLD(e[2 * p], e[2 * p + 1], 2, 0, 1, 8, 9, 4, 5, 12, 13);
    return FOLD(f[0], f[1], 1, 0, 8, 2, 10, 4, 12, 6, 14);
}
#endif
#undef FOLD

/* Sequence b, KV head j: its g query heads over keys start..len-1, read through the block table. Inlined
 * into each (g, C) case of attend_ below with constants, so the accumulators live in registers and the g dot
 * products of a key run as g independent FMA chains (as a loop over runtime bounds, every accumulator went
 * through memory and each dot product waited on its own C-FMA chain). */
__attribute__((target(TARGET), always_inline)) static inline void CAT(attend_core_, SUF)(const struct args *a,
                                                                                      int64_t b, int64_t j,
                                                                                      const int64_t g,
                                                                                      const int64_t C) {
    const int64_t hd = a->hd, len = a->lens[b];
    const int64_t start = a->window > 0 && len > a->window ? len - a->window : 0;
    const int64_t *table = a->tables + b * a->nb_max;
    const float *q = a->q + (b * a->H + j * g) * hd; /* g rows of hd */
    float *out = a->out + (b * a->H + j * g) * hd;
    float m[g], l[g], s[g][TILE];
    VF acc[g][C], dots[g][TILE];
    for (int64_t i = 0; i < g; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        for (int64_t c = 0; c < C; c++) acc[i][c] = (VF){};
    }
    for (int64_t t0 = start; t0 < len; t0 += TILE) {
        const int n = len - t0 < TILE ? (int)(len - t0) : TILE;
        const float *kr[TILE], *vr[TILE];
        for (int t = 0; t < n; t++) {
            const int64_t pos = t0 + t, slot = table[pos / a->B] * a->B + pos % a->B;
            kr[t] = a->k + (slot * a->KVH + j) * hd;
            vr[t] = a->v + (slot * a->KVH + j) * hd;
        }
        for (int t = 0; t < TILE; t++) { /* per key, the g dot products' W partial sums */
            const float *k = kr[t < n ? t : n - 1]; /* past a short tile's end: a repeat, never read */
            VF d[g];
            for (int64_t i = 0; i < g; i++) d[i] = (VF){};
            for (int64_t c = 0; c < C; c++) {
                const VF kv = *(const VFU *)(k + c * W);
                for (int64_t i = 0; i < g; i++) d[i] = FMA(*(const VFU *)(q + i * hd + c * W), kv, d[i]);
            }
            for (int64_t i = 0; i < g; i++) dots[i][t / W * W + CAT(rev_, SUF)[t % W]] = d[i];
        }
        for (int64_t i = 0; i < g; i++) /* the scores, W keys a vector */
            for (int t = 0; t < TILE; t += W) *(VFU *)(s[i] + t) = CAT(reduce_, SUF)(dots[i] + t) * a->scale;
        for (int64_t i = 0; i < g; i++) { /* the running max, the tile's weights, the rescale */
            float mx = m[i];
            for (int t = 0; t < n; t++) mx = s[i][t] > mx ? s[i][t] : mx;
            const float alpha = CAT(exp_, SUF)((VF){} + (m[i] - mx))[0]; /* m = -inf: ~1e-38 times zeros */
            for (int t0v = 0; t0v < TILE; t0v += W) {
                VF x = *(VFU *)(s[i] + t0v) - mx;
                *(VFU *)(s[i] + t0v) = CAT(exp_, SUF)(x);
            }
            float sum = 0.0f;
            for (int t = 0; t < n; t++) sum += s[i][t];
            l[i] = l[i] * alpha + sum;
            m[i] = mx;
            for (int64_t c = 0; c < C; c++) acc[i][c] *= alpha;
        }
        for (int t = 0; t < n; t++) /* values: each V row once for the g queries */
            for (int64_t c = 0; c < C; c++) {
                const VF vv = *(const VFU *)(vr[t] + c * W);
                for (int64_t i = 0; i < g; i++) acc[i][c] = FMA((VF){} + s[i][t], vv, acc[i][c]);
            }
    }
    for (int64_t i = 0; i < g; i++) {
        const float inv = 1.0f / l[i];
        for (int64_t c = 0; c < C; c++) *(VFU *)(out + i * hd + c * W) = acc[i][c] * inv;
    }
}

/* attend_core with the common (queries per KV head, vectors per head) pairs as constants; others at run time */
__attribute__((target(TARGET))) static void CAT(attend_, SUF)(const struct args *a, int64_t b, int64_t j) {
    const int64_t g = a->H / a->KVH, C = a->hd / W;
#define CASE(G, CC) \
    if (g == G && C == CC) return CAT(attend_core_, SUF)(a, b, j, G, CC);
#define CASES(G) CASE(G, 4) CASE(G, 8) CASE(G, 16)
    CASES(1) CASES(2) CASES(4) CASES(8)
#undef CASES
#undef CASE
    CAT(attend_core_, SUF)(a, b, j, g, C);
}

#undef VF
#undef VI
#undef VFU
#endif
