/* A gather of byte ranges into one contiguous destination with non-temporal (streaming) stores, split over
 * OpenMP threads (shared/model/kernels/cpu_stream_copy.py builds this file with gcc at first use and calls it
 * through ctypes; torch's copy_ of the same slices is the reference it is tested against).
 *
 * Why: the same-host KV send (shared/kv/transfer/segment_send.py) copies a request's blocks into a shared
 * segment that another process reads next, not this core. A plain store first reads each destination line
 * into the cache (read for ownership), then writes it back later: three passes over memory per byte copied. A
 * streaming store writes the line straight to memory: two passes, and it does not evict the prefill's own
 * working set. Measured with benchmarks/kv_transfer_bench.py (docs/benchmarks.md).
 *
 * Layout: piece i is `lengths[i]` bytes at `src + src_offsets[i]`; the pieces land back to back in `dst`, in
 * order. The total is cut into one equal span per thread (each starting on a 64-byte line of dst); within a
 * span the bytes before the first 16-byte boundary of dst and after the last one go through memcpy, the rest
 * through 16-byte SSE2 streaming stores (every x86-64 CPU has them; a 64-byte line is combined in the CPU's
 * write-combining buffers either way). Each thread ends with an sfence: its streaming stores are visible before
 * the call returns (and the caller replies that the bytes are there). Other architectures: memcpy.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>

static void stream_bytes(char *dst, const char *src, int64_t n) {
    const int64_t head = (int64_t)((16 - ((uintptr_t)dst & 15)) & 15);
    if (n < head + 64) {  /* too short to be worth it */
        memcpy(dst, src, (size_t)n);
        return;
    }
    memcpy(dst, src, (size_t)head);
    dst += head, src += head, n -= head;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        const __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, (size_t)(n - i));
}
#define FENCE() _mm_sfence()
#else
static void stream_bytes(char *dst, const char *src, int64_t n) { memcpy(dst, src, (size_t)n); }
#define FENCE() ((void)0)
#endif

/* bytes below which one thread does it all: waking another costs more than it saves */
#define PARALLEL_BYTES (1 << 20)

/* Copy bytes [lo, hi) of the concatenated pieces into dst + lo; `starts` holds each piece's first byte in the
 * concatenation (starts[count] = the total). */
static void copy_span(char *dst, const char *src, const int64_t *src_offsets, const int64_t *starts, int64_t count,
                      int64_t lo, int64_t hi) {
    int64_t a = 0, b = count; /* the piece holding byte lo: the last with starts[p] <= lo */
    while (b - a > 1) {
        const int64_t mid = (a + b) / 2;
        if (starts[mid] <= lo) a = mid; else b = mid;
    }
    for (int64_t p = a; p < count && lo < hi; p++) {
        const int64_t end = starts[p + 1] < hi ? starts[p + 1] : hi;
        if (end > lo) stream_bytes(dst + lo, src + src_offsets[p] + (lo - starts[p]), end - lo);
        lo = end > lo ? end : lo;
    }
}

/* `starts` has count + 1 entries, filled here (the caller supplies the memory: no allocation in C). */
void pdserve_gather_stream(char *dst, const char *src, const int64_t *src_offsets, const int64_t *lengths,
                           int64_t *starts, int64_t count, int threads) {
    int64_t total = 0;
    for (int64_t p = 0; p < count; p++) starts[p] = total, total += lengths[p];
    starts[count] = total;
    if (threads < 1 || total < PARALLEL_BYTES) threads = 1;
    const int64_t span = ((total + threads - 1) / threads + 63) & ~(int64_t)63;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t lo = (int64_t)t * span, hi = lo + span < total ? lo + span : total;
        if (lo < hi) copy_span(dst, src, src_offsets, starts, count, lo, hi);
        FENCE(); /* each thread's own streaming stores, before the region's barrier */
    }
}
