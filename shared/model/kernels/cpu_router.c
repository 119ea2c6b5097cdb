/* The MoE router's selection on CPU: float32 logits (T, E) → the top-A expert ids and their weights, one call
 * per layer (shared/model/kernels/cpu_router.py builds this file with gcc at first use and calls it through
 * ctypes; Router.forward's torch ops in shared/model/routing.py are the reference it is tested against).
 *
 * Why: at decode the logits are (32, 8); torch's softmax, topk, sum, add and divide cost a few microseconds of
 * dispatch each, ~75 us a layer measured inside a step, for nanoseconds of arithmetic.
 *
 * Two orders, as the architectures define them:
 * - softmax first (Qwen-MoE, Mixtral, OLMoE, DeepSeek-V2 greedy): p = softmax over the E logits, computed as
 *   torch's CPU softmax does (exp(x - max), summed, times 1 / sum; expf is glibc's, not torch's vectorized
 *   exp, so p may differ in the last bit); the experts of the A largest p, chosen on the logits (p is
 *   monotonic in them: the same experts, except where torch's rounding ties or swaps two p a few ulps
 *   apart), then their p, optionally / (their sum + 1e-20), times the scaling factor.
 * - top-A first (gpt-oss): the A largest logits, then the softmax over those A.
 * Ids come in descending order of their score, as torch.topk's sorted output; equal scores: the lower id
 * first (torch.topk's order among equal values is its implementation's: on CPU not the lower id first). Rows are split over OpenMP threads only when there are many (prefill); each row is one thread's.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_LOGITS (1 << 16) /* below this, one thread: waking a second costs more than the rows */
#define MAX_TOP 64                /* top-A larger than this: refused by the caller */

/* ids[0..A) ← the A largest of v[0..E), descending, ties to the lower index (an insertion into A slots) */
static void top(const float *v, int64_t E, int64_t A, int64_t *ids) {
    float best[MAX_TOP];
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {
        if (n == A && !(v[e] > best[A - 1])) continue; /* not strictly better than the last kept */
        int64_t at = n < A ? n++ : A - 1;
        while (at > 0 && v[e] > best[at - 1]) { /* strictly: an equal score stays behind the earlier id */
            best[at] = best[at - 1];
            ids[at] = ids[at - 1];
            at--;
        }
        best[at] = v[e];
        ids[at] = e;
    }
}

/* softmax of n values in place, in torch's CPU order: max, exp(x - max) and their sum, times 1 / sum */
static void softmax(float *v, int64_t n) {
    float mx = v[0];
    for (int64_t i = 1; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        v[i] = expf(v[i] - mx);
        sum += v[i];
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; i++) v[i] *= inv;
}

/* logits (T, E) contiguous → ids (T, A), weights (T, A). topk_first: gpt-oss's order (renorm and scale are
 * then ignored: its weights are the softmax of the chosen A). Returns 0, or -1 for A outside 1..min(E, 64). */
int pdserve_route_f32(const float *logits, int64_t T, int64_t E, int64_t A, int topk_first, int renorm,
                      float scale, int64_t *ids, float *weights, int threads) {
    if (A < 1 || A > E || A > MAX_TOP) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * E >= PARALLEL_LOGITS)
    for (int64_t t = 0; t < T; t++) {
        const float *row = logits + t * E;
        int64_t *id = ids + t * A;
        float *w = weights + t * A;
        if (topk_first) {
            top(row, E, A, id);
            for (int64_t a = 0; a < A; a++) w[a] = row[id[a]];
            softmax(w, A);
            continue;
        }
        float p[E];
        for (int64_t e = 0; e < E; e++) p[e] = row[e];
        softmax(p, E);
        top(row, E, A, id); /* on the logits: the order of p, without exp's rounding in the way */
        float sum = 0.0f;
        for (int64_t a = 0; a < A; a++) {
            w[a] = p[id[a]];
            sum += w[a];
        }
        if (renorm) {
            const float denom = sum + 1e-20f;
            for (int64_t a = 0; a < A; a++) w[a] /= denom;
        }
        if (scale != 1.0f)
            for (int64_t a = 0; a < A; a++) w[a] *= scale;
    }
    return 0;
}
