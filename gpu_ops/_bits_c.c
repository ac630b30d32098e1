/* CPU bit unpacking for gpu_ops.bits: one table-row copy per input byte.
 *
 * Built on first use by gpu_ops/_cbuild.py (cc -O3 -march=native ...; no OpenMP used here)
 * and called through ctypes from gpu_ops/_bits_c.py, which owns the argument checks.
 *
 * The table holds, for each byte value, its 8 bits as finished output values in output
 * order (256 x 8 x esize bytes: 2 KiB for uint8, 8 KiB for float32, so it stays in L1).
 * Unpacking a byte is then one fixed-size copy of 8 * esize bytes (one 64-bit store for
 * uint8, one 32-byte vector store for float32), which the compiler emits from memcpy with a
 * constant size. The work is the flattened (row, byte) index space split evenly over the
 * threads, so both many short rows and one long row use every thread.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX__)
#include <immintrin.h>
#define BS_STREAM 1
#endif

#define BS_MAX_THREADS 64

typedef struct {
    const uint8_t *x; /* row r, byte k at x[r * xrs + k * xis] */
    int64_t xrs, xis;
    char *out; /* row r, element j at out[(r * ors + j) * esize] */
    int64_t ors;
    const char *table; /* 256 rows of 8 elements */
    int64_t valid;     /* elements per row */
    int64_t nb;        /* bytes read per row: ceil(valid / 8) */
    int64_t lo, hi;    /* this span of the flattened (row, byte) index space */
    int esize, stream;
} span_t;

/* Bytes k..kfull-1 of one row (all 8 values kept), one specialised loop per element size
 * so that every copy has a compile-time size. */
#define PLAIN_ROW(E)                                                                          \
    static void plain_row_##E(const uint8_t *xr, int64_t xis, char *orow, const char *table, \
                              int64_t k, int64_t kfull) {                                     \
        if (xis == 1) {                                                                       \
            for (; k < kfull; k++)                                                            \
                memcpy(orow + k * 8 * E, table + (int64_t)xr[k] * 8 * E, 8 * E);              \
        } else {                                                                              \
            for (; k < kfull; k++)                                                            \
                memcpy(orow + k * 8 * E, table + (int64_t)xr[k * xis] * 8 * E, 8 * E);        \
        }                                                                                     \
    }

PLAIN_ROW(1)
PLAIN_ROW(2)
PLAIN_ROW(4)
PLAIN_ROW(8)

#ifdef BS_STREAM
/* Non-temporal stores of whole table rows: the output goes to memory without first being
 * read into the cache (an ordinary store reads each line before overwriting it). Only for
 * big outputs, which the caller would not find in the cache anyway. Returns the first byte
 * not done: k itself when the destination is not aligned for streaming. */
static int64_t stream_row(const uint8_t *xr, int64_t xis, char *orow, const char *table,
                          int esize, int64_t k, int64_t kfull) {
    const int64_t w = 8 * esize;
    const uintptr_t align = w < 32 ? (uintptr_t)w : 32;
    if ((uintptr_t)(orow + k * w) % align) return k;
    switch (esize) {
        case 1:
            for (; k < kfull; k++) {
                long long v;
                memcpy(&v, table + (int64_t)xr[k * xis] * 8, 8);
                _mm_stream_si64((long long *)(orow + k * 8), v);
            }
            break;
        case 2:
            for (; k < kfull; k++) {
                const char *src = table + (int64_t)xr[k * xis] * 16;
                _mm_stream_si128((__m128i *)(orow + k * 16), _mm_loadu_si128((const __m128i *)src));
            }
            break;
        case 4:
            for (; k < kfull; k++) {
                const char *src = table + (int64_t)xr[k * xis] * 32;
                _mm256_stream_si256((__m256i *)(orow + k * 32),
                                    _mm256_loadu_si256((const __m256i *)src));
            }
            break;
        default:
            for (; k < kfull; k++) {
                const char *src = table + (int64_t)xr[k * xis] * 64;
                char *dst = orow + k * 64;
                _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
                _mm256_stream_si256((__m256i *)(dst + 32),
                                    _mm256_loadu_si256((const __m256i *)(src + 32)));
            }
            break;
    }
    return k;
}
#endif

static void run_span(const span_t *s) {
    const int E = s->esize;
    const int64_t full = s->valid / 8; /* bytes whose 8 values are all kept */
    int64_t r = s->lo / s->nb, k = s->lo % s->nb;
    for (int64_t i = s->lo; i < s->hi; r++, k = 0) {
        const uint8_t *xr = s->x + r * s->xrs;
        char *orow = s->out + r * s->ors * E;
        int64_t kend = k + (s->hi - i);
        if (kend > s->nb) kend = s->nb;
        i += kend - k;
        const int64_t kfull = kend < full ? kend : full;
#ifdef BS_STREAM
        if (s->stream) k = stream_row(xr, s->xis, orow, s->table, E, k, kfull);
#endif
        switch (E) {
            case 1: plain_row_1(xr, s->xis, orow, s->table, k, kfull); break;
            case 2: plain_row_2(xr, s->xis, orow, s->table, k, kfull); break;
            case 4: plain_row_4(xr, s->xis, orow, s->table, k, kfull); break;
            default: plain_row_8(xr, s->xis, orow, s->table, k, kfull); break;
        }
        if (kfull < kend) { /* the row's last byte, cut mid-byte by count */
            memcpy(orow + kfull * 8 * E, s->table + (int64_t)xr[kfull * s->xis] * 8 * E,
                   (size_t)(s->valid - 8 * kfull) * (size_t)E);
        }
    }
#ifdef BS_STREAM
    if (s->stream) _mm_sfence(); /* streamed stores are weakly ordered: publish them */
#endif
}

static void *span_thread(void *arg) {
    run_span((const span_t *)arg);
    return NULL;
}

/* Unpack `rows` rows of packed bytes (see span_t for the layout; strides of x in bytes,
 * ors in elements; the elements of an output row are contiguous).
 *
 * valid:  elements written per row; nb = ceil(valid / 8) bytes are read per row.
 * esize:  1, 2, 4 or 8.
 * nthreads: threads to use (1: only the caller's).
 * stream: nonzero for non-temporal stores (where the CPU has them).
 *
 * Threads are plain pthreads started per call and joined by blocking, not OpenMP: an
 * OpenMP barrier spin-waits, and on a host where another process holds a core the spinning
 * caller kept the worker off the CPU for a whole time slice (measured: 8-12 ms per call
 * for a 0.5 ms unpack, against 1 ms with pthreads). Starting a thread costs tens of
 * microseconds, hence the caller's size threshold.
 */
void bs_unpack(const uint8_t *x, int64_t rows, int64_t xrs, int64_t xis, void *out, int64_t ors,
               const void *table, int64_t valid, int esize, int nthreads, int stream) {
    const int64_t nb = (valid + 7) / 8;
    const int64_t total = rows * nb;
    if (total <= 0) return;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > BS_MAX_THREADS) nthreads = BS_MAX_THREADS;
    if (nthreads > total) nthreads = (int)total;
    span_t spans[BS_MAX_THREADS];
    pthread_t ids[BS_MAX_THREADS];
    int started[BS_MAX_THREADS] = {0};
    for (int t = 0; t < nthreads; t++) {
        spans[t] = (span_t){x,     xrs, xis, (char *)out,           ors,
                            (const char *)table, valid, nb, total * t / nthreads,
                            total * (t + 1) / nthreads, esize, stream};
    }
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&ids[t], NULL, span_thread, &spans[t]) == 0;
    run_span(&spans[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_span(&spans[t]); /* no thread to be had: do its share here */
    }
}
