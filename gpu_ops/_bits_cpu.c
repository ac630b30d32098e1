/* CPU bit unpacking for gpu_ops.bits: one table-row copy per input byte.
 *
 * Built on first use by gpu_ops/_cbuild.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes from gpu_ops/_bits_cpu.py, which owns the argument checks.
 *
 * The table holds, for each byte value, its 8 bits as finished output values in output
 * order (256 x 8 x esize bytes: 2 KiB for uint8, 8 KiB for float32, so it stays in L1).
 * Unpacking a byte is then one fixed-size copy of 8 * esize bytes (one 64-bit store for
 * uint8, one 32-byte vector store for float32), which the compiler emits from memcpy with a
 * constant size. The work is the flattened (row, byte) index space split evenly over the
 * threads, so both many short rows and one long row use every thread.
 */
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
#define BS_STREAM 1
#endif

/* One specialised loop per element size, so every copy has a compile-time size. */
#define UNPACK_SPAN(E)                                                                     \
    static void unpack_span_##E(const uint8_t *x, int64_t xrs, int64_t xis, char *out,     \
                                int64_t ors, const char *table, int64_t valid, int64_t nb, \
                                int64_t lo, int64_t hi) {                                  \
        const int64_t full = valid / 8; /* bytes whose 8 values are all kept */            \
        int64_t r = lo / nb, k = lo % nb;                                                  \
        for (int64_t i = lo; i < hi; r++, k = 0) {                                         \
            const uint8_t *xr = x + r * xrs;                                               \
            char *orow = out + r * ors * E;                                                \
            int64_t kend = k + (hi - i);                                                   \
            if (kend > nb) kend = nb;                                                      \
            i += kend - k;                                                                 \
            int64_t kfull = kend < full ? kend : full;                                     \
            if (xis == 1) {                                                                \
                for (; k < kfull; k++)                                                     \
                    memcpy(orow + k * 8 * E, table + (int64_t)xr[k] * 8 * E, 8 * E);       \
            } else {                                                                       \
                for (; k < kfull; k++)                                                     \
                    memcpy(orow + k * 8 * E, table + (int64_t)xr[k * xis] * 8 * E, 8 * E); \
            }                                                                              \
            if (k < kend) /* the row's last byte, cut mid-byte by count */                 \
                memcpy(orow + k * 8 * E, table + (int64_t)xr[k * xis] * 8 * E,             \
                       (size_t)(valid - 8 * k) * E);                                       \
        }                                                                                  \
    }

UNPACK_SPAN(1)
UNPACK_SPAN(2)
UNPACK_SPAN(4)
UNPACK_SPAN(8)

#ifdef BS_STREAM
/* Non-temporal stores of whole table rows: the output goes to memory without first being
 * read into the cache (a normal store reads each line before overwriting it). Only for
 * outputs much bigger than the cache, which the caller would not find there anyway.
 * Returns the number of bytes done from k (0 when dst is not aligned for streaming). */
static int64_t stream_row(const uint8_t *xr, int64_t xis, char *orow, const char *table,
                          int esize, int64_t k, int64_t kfull) {
    const int64_t w = 8 * esize;
    const int64_t align = w < 32 ? w : 32;
    if (((uintptr_t)(orow + k * w)) % (uintptr_t)align) return 0;
    int64_t k0 = k;
    switch (esize) {
        case 1:
            for (; k < kfull; k++) {
                long long v;
                memcpy(&v, table + (int64_t)xr[k * xis] * 8, 8);
                _mm_stream_si64((long long *)(orow + k * 8), v);
            }
            break;
        case 2:
            for (; k < kfull; k++)
                _mm_stream_si128((__m128i *)(orow + k * 16),
                                 _mm_loadu_si128((const __m128i *)(table + (int64_t)xr[k * xis] * 16)));
            break;
        case 4:
            for (; k < kfull; k++)
                _mm256_stream_si256((__m256i *)(orow + k * 32),
                                    _mm256_loadu_si256((const __m256i *)(table + (int64_t)xr[k * xis] * 32)));
            break;
        default:
            for (; k < kfull; k++) {
                const char *src = table + (int64_t)xr[k * xis] * 64;
                _mm256_stream_si256((__m256i *)(orow + k * 64), _mm256_loadu_si256((const __m256i *)src));
                _mm256_stream_si256((__m256i *)(orow + k * 64 + 32),
                                    _mm256_loadu_si256((const __m256i *)(src + 32)));
            }
            break;
    }
    return k - k0;
}

static void stream_span(const uint8_t *x, int64_t xrs, int64_t xis, char *out, int64_t ors,
                        const char *table, int64_t valid, int64_t nb, int64_t lo, int64_t hi,
                        int esize) {
    const int64_t full = valid / 8;
    int64_t r = lo / nb, k = lo % nb;
    for (int64_t i = lo; i < hi; r++, k = 0) {
        const uint8_t *xr = x + r * xrs;
        char *orow = out + r * ors * esize;
        int64_t kend = k + (hi - i);
        if (kend > nb) kend = nb;
        i += kend - k;
        int64_t kfull = kend < full ? kend : full;
        k += stream_row(xr, xis, orow, table, esize, k, kfull);
        for (; k < kend; k++) { /* unaligned rows, and the last byte cut by count */
            int64_t m = valid - 8 * k < 8 ? valid - 8 * k : 8;
            memcpy(orow + k * 8 * esize, table + (int64_t)xr[k * xis] * 8 * esize, (size_t)(m * esize));
        }
    }
    _mm_sfence(); /* order the streamed stores before the threads join */
}
#endif

/* Unpack `rows` rows of packed bytes.
 *
 * x:      row r, byte k at x[r * xrs + k * xis] (strides in bytes).
 * out:    row r, element j at ((char *)out)[(r * ors + j) * esize] (ors in elements); the
 *         elements of a row are contiguous.
 * table:  256 * 8 elements of esize bytes.
 * valid:  elements written per row (<= 8 * nb); nb = ceil(valid / 8) bytes are read.
 * esize:  1, 2, 4 or 8.
 * nthreads: OpenMP threads to use (1: run on the caller's thread).
 * stream: nonzero for non-temporal stores (where the CPU has them).
 */
void bs_unpack(const uint8_t *x, int64_t rows, int64_t xrs, int64_t xis, void *out, int64_t ors,
               const void *table, int64_t valid, int esize, int nthreads, int stream) {
    const int64_t nb = (valid + 7) / 8;
    const int64_t total = rows * nb;
    if (total <= 0) return;
    (void)stream;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > total) nthreads = (int)total;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
        const char *tab = (const char *)table;
        char *o = (char *)out;
#ifdef BS_STREAM
        if (stream) {
            stream_span(x, xrs, xis, o, ors, tab, valid, nb, lo, hi, esize);
        } else
#endif
        switch (esize) {
            case 1: unpack_span_1(x, xrs, xis, o, ors, tab, valid, nb, lo, hi); break;
            case 2: unpack_span_2(x, xrs, xis, o, ors, tab, valid, nb, lo, hi); break;
            case 4: unpack_span_4(x, xrs, xis, o, ors, tab, valid, nb, lo, hi); break;
            default: unpack_span_8(x, xrs, xis, o, ors, tab, valid, nb, lo, hi); break;
        }
    }
}
