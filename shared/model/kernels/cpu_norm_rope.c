/* RMSNorm (optionally after the residual add before it) and the attention layer's q/k norm + RoPE on CPU, float32,
 * one call each (shared/model/kernels/
 * cpu_norm_rope.py builds this file with gcc at first use and calls it through ctypes; RMSNorm and apply_rotary
 * of shared/model/layers.py are the reference it is tested against).
 *
 * Why: at decode the tensors are tiny (32 tokens x 512), so torch's cost is dispatch, not arithmetic: its CPU
 * rms_norm is five ops and RoPE five more, each a few microseconds of dispatch and an allocation, four norms
 * and one RoPE per layer. Here each is one pass over rows in L1 (what that buys a step: benchmarks/kernel_ab.py
 * --kernel norm).
 *
 * Arithmetic, per row of n: the sum of squares in 16 lane-wise partial sums folded in a fixed order (not
 * torch's order: results differ from F.rms_norm in the last bits), r = 1 / sqrtf(sum / n + eps), then
 * w * (x * r) rounded after each product, as Llama's RMSNorm in float32. RoPE as apply_rotary writes it:
 * y[d] = x[d] * cos[d] + x[(d + half) mod dim] * signed_sin[d] (signed_sin = sin with its first half negated),
 * each product rounded, then the sum (built with -ffp-contract=off: no fused multiply-add), so the rotation is
 * bitwise torch's for the same inputs. Dims past the tables' `dim` (partial rotary) pass through.
 *
 * Vectors are GNU vector types of 16 floats; target_clones builds each function for AVX-512F, AVX2 and plain
 * x86-64 and picks one at load time, with the same bits on every ISA (the same operations in the same order).
 * Rows are split over OpenMP threads only when there are many (prefill); each row is computed by one thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define L 16 /* lanes of the partial sums */
typedef float vf __attribute__((vector_size(4 * L)));
typedef float vfu __attribute__((vector_size(4 * L), aligned(4))); /* unaligned loads and stores */

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
/* rows of work below which one thread does it all: waking a second costs more than the rows */
#define PARALLEL_FLOATS (1 << 16)

/* 1 / sqrt(mean(x^2) + eps) over n floats, the sum in L lane-wise partials folded pairwise in a fixed order */
static inline float inv_rms(const float *x, int64_t n, float eps) {
    vf acc = (vf){};
    int64_t i = 0;
    for (; i + L <= n; i += L) {
        const vf v = *(const vfu *)(x + i);
        acc += v * v;
    }
    float part[L];
    memcpy(part, &acc, sizeof part);
    for (int64_t t = 0; i + t < n; t++) part[t] += x[i + t] * x[i + t]; /* a tail of n % L: one more per lane */
    for (int width = L / 2; width >= 1; width /= 2)
        for (int t = 0; t < width; t++) part[t] += part[t + width];
    return 1.0f / sqrtf(part[0] / (float)n + eps);
}

/* out[i] = w[i] * (x[i] * r) for n floats (w NULL: no weight) */
static inline void scale_row(const float *x, const float *w, float r, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + L <= n; i += L) {
        vf y = *(const vfu *)(x + i) * r;
        if (w) y = *(const vfu *)(w + i) * y;
        *(vfu *)(out + i) = y;
    }
    for (; i < n; i++) out[i] = w ? w[i] * (x[i] * r) : x[i] * r;
}

/* out (rows, n) contiguous = RMSNorm of the rows of x (row r at x + r * x_stride) with weight w (n,). */
CLONES void pdserve_rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows,
                                 int64_t n, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        scale_row(row, w, inv_rms(row, n, eps), out + r * n, n);
    }
}

/* h = x + d (rows, n), all contiguous, and out = RMSNorm of h's rows with weight w: the residual add and the
 * next norm in one pass (h is the rounded float sum, bitwise torch's x + d). */
CLONES void pdserve_add_rms_norm_f32(const float *x, const float *d, const float *w, float *h, float *out,
                                     int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n, *dr = d + r * n;
        float *hr = h + r * n;
        int64_t i = 0;
        for (; i + L <= n; i += L) *(vfu *)(hr + i) = *(const vfu *)(xr + i) + *(const vfu *)(dr + i);
        for (; i < n; i++) hr[i] = xr[i] + dr[i];
        scale_row(hr, w, inv_rms(hr, n, eps), out + r * n, n);
    }
}

/* One head of hd floats: the optional per-head RMSNorm (w non-NULL), then RoPE over its first `dim` dims with
 * this token's cos / signed_sin rows (dim,); out (hd,). x and out do not overlap. */
static inline void norm_rope_head(const float *x, const float *w, float eps, const float *cos, const float *ssin,
                                  int64_t hd, int64_t dim, float *out) {
    float normed[hd];
    const float *h = x;
    if (w) {
        scale_row(x, w, inv_rms(x, hd, eps), normed, hd);
        h = normed;
    }
    const int64_t half = dim / 2;
    for (int64_t d = 0; d < half; d++) { /* x.roll(half) puts x[d + half] at d ... */
        const float a = h[d] * cos[d], b = h[d + half] * ssin[d];
        out[d] = a + b;
    }
    for (int64_t d = half; d < dim; d++) { /* ... and x[d - half] at d >= half */
        const float a = h[d] * cos[d], b = h[d - half] * ssin[d];
        out[d] = a + b;
    }
    for (int64_t d = dim; d < hd; d++) out[d] = h[d];
}

/* q (T, H, hd) and k (T, KVH, hd) with token rows q_stride / k_stride floats apart and heads contiguous inside
 * a row (views of the fused qkv projection); q_w, k_w (hd,) per-head norm weights or both NULL (no norm);
 * cos, ssin (T, dim) this step's tables. → q_out (T, H, hd), k_out (T, KVH, hd) contiguous. */
CLONES void pdserve_qk_norm_rope_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                                     const float *q_w, const float *k_w, float eps, const float *cos,
                                     const float *ssin, float *q_out, float *k_out, int64_t T, int64_t H,
                                     int64_t KVH, int64_t hd, int64_t dim, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * (H + KVH) * hd >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * dim, *s = ssin + t * dim;
        for (int64_t h = 0; h < H; h++)
            norm_rope_head(q + t * q_stride + h * hd, q_w, eps, c, s, hd, dim, q_out + (t * H + h) * hd);
        for (int64_t h = 0; h < KVH; h++)
            norm_rope_head(k + t * k_stride + h * hd, k_w, eps, c, s, hd, dim, k_out + (t * KVH + h) * hd);
    }
}
