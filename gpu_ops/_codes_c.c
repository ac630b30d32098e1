/* CPU kernels of gpu_ops.codes: n-bit codes decoded through a code table, and scores of
 * packed codes summed through a per-byte lookup table.
 *
 * Built on first use by gpu_ops/_cbuild.py and called through ctypes from
 * gpu_ops/_codes_c.py, which owns the argument checks. Threads are plain pthreads started
 * per call (see _bits_c.c for why not OpenMP), the rows split evenly over them.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#define BS_MAX_THREADS 64

/* ---- decode ------------------------------------------------------------------------------ */

typedef struct {
    const uint8_t *x; /* row r, byte k at x[r * xrs + k] */
    int64_t xrs;
    char *out; /* row r, element j at out[(r * ors + j) * esize] */
    int64_t ors;
    int64_t count;          /* codes per row */
    int bits, big, is64;    /* code_bits; big-endian codes in a byte; float64 output */
    const double *table;    /* 2**bits values, NaN = missing */
    const double *missing;  /* element j's value for a missing code at missing[j * mstride] */
    int64_t mstride;
    int64_t lo, hi; /* rows of this span */
} decode_t;

static void decode_span(const decode_t *d) {
    const int per = 8 / d->bits, mask = (1 << d->bits) - 1;
    int shift[8];
    for (int c = 0; c < per; c++) shift[c] = d->big ? 8 - d->bits * (c + 1) : d->bits * c;
    int miss[16];
    float tf[16];
    for (int c = 0; c <= mask; c++) {
        miss[c] = isnan(d->table[c]);
        tf[c] = (float)d->table[c];
    }
    for (int64_t r = d->lo; r < d->hi; r++) {
        const uint8_t *xr = d->x + r * d->xrs;
        if (d->is64) {
            double *o = (double *)d->out + r * d->ors;
            for (int64_t j = 0; j < d->count; j++) {
                const int code = (xr[j / per] >> shift[j % per]) & mask;
                o[j] = miss[code] ? d->missing[j * d->mstride] : d->table[code];
            }
        } else {
            float *o = (float *)d->out + r * d->ors;
            int64_t j = 0;
            const int64_t full = d->count / per;
            for (int64_t k = 0; k < full; k++) { /* whole bytes: the inner loop unrolls */
                const int b = xr[k];
                for (int c = 0; c < per; c++, j++) {
                    const int code = (b >> shift[c]) & mask;
                    o[j] = miss[code] ? (float)d->missing[j * d->mstride] : tf[code];
                }
            }
            for (; j < d->count; j++) {
                const int code = (xr[j / per] >> shift[j % per]) & mask;
                o[j] = miss[code] ? (float)d->missing[j * d->mstride] : tf[code];
            }
        }
    }
}

static void *decode_thread(void *arg) {
    decode_span((const decode_t *)arg);
    return NULL;
}

/* Decode `rows` rows of packed codes into float32 (is64 = 0) or float64 (is64 = 1).
 *
 * x: row r at x + r * xrs, ceil(count * bits / 8) contiguous bytes.
 * out: row r at element r * ors, `count` contiguous elements.
 * table: 2**bits doubles, NaN marking the missing code(s); missing: the value of element j
 * when its code is missing, at missing[j * mstride] (mstride 0: one value for all).
 */
void bs_decode_codes(const uint8_t *x, int64_t rows, int64_t xrs, void *out, int64_t ors,
                     int64_t count, int bits, int big, const double *table,
                     const double *missing, int64_t mstride, int is64, int nthreads) {
    if (rows <= 0 || count <= 0) return;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > BS_MAX_THREADS) nthreads = BS_MAX_THREADS;
    if (nthreads > rows) nthreads = (int)rows;
    decode_t spans[BS_MAX_THREADS];
    pthread_t ids[BS_MAX_THREADS];
    int started[BS_MAX_THREADS] = {0};
    for (int t = 0; t < nthreads; t++)
        spans[t] = (decode_t){x,       xrs,     (char *)out, ors,  count,
                              bits,    big,     is64,        table, missing,
                              mstride, rows * t / nthreads,  rows * (t + 1) / nthreads};
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&ids[t], NULL, decode_thread, &spans[t]) == 0;
    decode_span(&spans[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            decode_span(&spans[t]);
    }
}

/* ---- score ------------------------------------------------------------------------------- */

/* Tiles: the lookup table of SCORE_POS byte positions (SCORE_POS * 256 * S values: 128 KiB
 * for S = 4 float64) stays in L2 while every sample of a block of SCORE_ROWS adds its bytes
 * at those positions, so each part of the table is read from memory once per row block. */
#define SCORE_POS 16
#define SCORE_ROWS 2048

typedef struct {
    const uint8_t *x; /* row r, byte k at x[r * xrs + k] */
    int64_t xrs, nb;
    const void *lut; /* (nb, 256, S) */
    int64_t S;
    void *out; /* (rows, S) contiguous, accumulated into (zeroed by the caller) */
    int is64;
    int64_t lo, hi;
} score_t;

/* Four rows at a time: four independent chains of adds (one chain waits on each add's
 * latency), S = 4 held in registers as one vector per row. */
#define SCORE_SPAN(T, NAME)                                                                  \
    static void NAME(const score_t *d) {                                                     \
        const T *lut = (const T *)d->lut;                                                    \
        T *out = (T *)d->out;                                                                \
        const int64_t S = d->S, xrs = d->xrs;                                                \
        for (int64_t r0 = d->lo; r0 < d->hi; r0 += SCORE_ROWS) {                             \
            const int64_t r1 = r0 + SCORE_ROWS < d->hi ? r0 + SCORE_ROWS : d->hi;            \
            for (int64_t p0 = 0; p0 < d->nb; p0 += SCORE_POS) {                              \
                const int64_t p1 = p0 + SCORE_POS < d->nb ? p0 + SCORE_POS : d->nb;          \
                int64_t r = r0;                                                              \
                if (S == 4) {                                                                \
                    for (; r + 4 <= r1; r += 4) {                                            \
                        const uint8_t *x0 = d->x + r * xrs;                                  \
                        T a[4][4];                                                           \
                        memcpy(a, out + r * 4, sizeof a);                                    \
                        for (int64_t p = p0; p < p1; p++) {                                  \
                            const T *base = lut + (p << 10);                                 \
                            const T *v0 = base + x0[p] * 4;                                  \
                            const T *v1 = base + x0[p + xrs] * 4;                            \
                            const T *v2 = base + x0[p + 2 * xrs] * 4;                        \
                            const T *v3 = base + x0[p + 3 * xrs] * 4;                        \
                            for (int k = 0; k < 4; k++) {                                    \
                                a[0][k] += v0[k];                                            \
                                a[1][k] += v1[k];                                            \
                                a[2][k] += v2[k];                                            \
                                a[3][k] += v3[k];                                            \
                            }                                                                \
                        }                                                                    \
                        memcpy(out + r * 4, a, sizeof a);                                    \
                    }                                                                        \
                }                                                                            \
                for (; r < r1; r++) {                                                        \
                    const uint8_t *xr = d->x + r * xrs;                                      \
                    T *acc = out + r * S;                                                    \
                    for (int64_t p = p0; p < p1; p++) {                                      \
                        const T *v = lut + ((p << 8) + xr[p]) * S;                           \
                        for (int64_t s = 0; s < S; s++) acc[s] += v[s];                      \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }

SCORE_SPAN(float, score_span_f32)
SCORE_SPAN(double, score_span_f64)

#if defined(__AVX__)
/* float64, S = 4 (two scores, the dosage sum and the allele count): one 256-bit vector per
 * row, four rows at a time (measured 1.6x the portable loop's speed). */
static void score_span_f64x4(const score_t *d) {
    const double *lut = (const double *)d->lut;
    double *out = (double *)d->out;
    const int64_t xrs = d->xrs;
    for (int64_t r0 = d->lo; r0 < d->hi; r0 += SCORE_ROWS) {
        const int64_t r1 = r0 + SCORE_ROWS < d->hi ? r0 + SCORE_ROWS : d->hi;
        for (int64_t p0 = 0; p0 < d->nb; p0 += SCORE_POS) {
            const int64_t p1 = p0 + SCORE_POS < d->nb ? p0 + SCORE_POS : d->nb;
            int64_t r = r0;
            for (; r + 4 <= r1; r += 4) {
                const uint8_t *x0 = d->x + r * xrs;
                double *o = out + r * 4;
                __m256d a0 = _mm256_loadu_pd(o), a1 = _mm256_loadu_pd(o + 4);
                __m256d a2 = _mm256_loadu_pd(o + 8), a3 = _mm256_loadu_pd(o + 12);
                for (int64_t p = p0; p < p1; p++) {
                    const double *base = lut + (p << 10);
                    a0 = _mm256_add_pd(a0, _mm256_loadu_pd(base + x0[p] * 4));
                    a1 = _mm256_add_pd(a1, _mm256_loadu_pd(base + x0[p + xrs] * 4));
                    a2 = _mm256_add_pd(a2, _mm256_loadu_pd(base + x0[p + 2 * xrs] * 4));
                    a3 = _mm256_add_pd(a3, _mm256_loadu_pd(base + x0[p + 3 * xrs] * 4));
                }
                _mm256_storeu_pd(o, a0);
                _mm256_storeu_pd(o + 4, a1);
                _mm256_storeu_pd(o + 8, a2);
                _mm256_storeu_pd(o + 12, a3);
            }
            for (; r < r1; r++) {
                const uint8_t *xr = d->x + r * xrs;
                __m256d a = _mm256_loadu_pd(out + r * 4);
                for (int64_t p = p0; p < p1; p++)
                    a = _mm256_add_pd(a, _mm256_loadu_pd(lut + (p << 10) + xr[p] * 4));
                _mm256_storeu_pd(out + r * 4, a);
            }
        }
    }
}
#endif

static void *score_thread(void *arg) {
    const score_t *d = (const score_t *)arg;
#if defined(__AVX__)
    if (d->is64 && d->S == 4) {
        score_span_f64x4(d);
        return NULL;
    }
#endif
    if (d->is64)
        score_span_f64(d);
    else
        score_span_f32(d);
    return NULL;
}

/* out[r, s] += sum_p lut[p, x[r, p], s] for `rows` rows of nb bytes (float32 or float64). */
void bs_score_codes(const uint8_t *x, int64_t rows, int64_t xrs, int64_t nb, const void *lut,
                    int64_t S, void *out, int is64, int nthreads) {
    if (rows <= 0 || nb <= 0 || S <= 0) return;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > BS_MAX_THREADS) nthreads = BS_MAX_THREADS;
    if (nthreads > rows) nthreads = (int)rows;
    score_t spans[BS_MAX_THREADS];
    pthread_t ids[BS_MAX_THREADS];
    int started[BS_MAX_THREADS] = {0};
    for (int t = 0; t < nthreads; t++)
        spans[t] = (score_t){x, xrs, nb, lut, S, out, is64, rows * t / nthreads,
                             rows * (t + 1) / nthreads};
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&ids[t], NULL, score_thread, &spans[t]) == 0;
    score_thread(&spans[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            score_thread(&spans[t]);
    }
}

/* ---- score a variant-major .bed ---------------------------------------------------------- */

/* A PLINK .bed holds one row of 2-bit codes per variant (four samples a byte, the first in
 * the lowest bits). bs_score_bed sums, for every sample, what each variant's code adds
 * (values (variants, 4, C)) without transposing the file first: the bytes of four variants
 * at one sample byte form a 4x4 matrix of codes in a uint32 (variant r, sample k at bit
 * 8 r + 2 k), two delta swaps transpose it (sample k's four codes in byte k), and each byte
 * indexes a 256-entry table of the four variants' summed values, built per group of four
 * variants from two 16-entry halves. Two groups (8 variants) a pass: one read and write of a
 * sample's C accumulators per 8 variants. The rows of a pass past `variants` add zeros. */

typedef struct {
    const uint8_t *bed; /* variant v's sample byte j at bed[v * brs + j] */
    int64_t brs, variants;
    const double *values; /* (variants, 4, C): what variant v's code k adds to column c */
    int64_t C;
    double *out; /* (4 * sample bytes, C), accumulated into */
    int64_t lo, hi; /* the sample bytes of this span */
    double *lut;    /* scratch: (2 x 256 + 32) x C (two tables, then two 16-entry halves) */
} bed_t;

static inline uint32_t transpose_4x4_codes(uint32_t w) {
    uint32_t t = ((w >> 6) ^ w) & 0x00CC00CCu;
    w ^= t ^ (t << 6);
    t = ((w >> 12) ^ w) & 0x0000F0F0u;
    w ^= t ^ (t << 12);
    return w;
}

/* lut (256, C): lut[i, c] = sum_r values[v0 + r, (i >> 2 r) & 3, c] over r < 4 (zero for
 * variants past the end). */
static void bed_group_table(const bed_t *d, int64_t v0, double *lut) {
    const int64_t C = d->C;
    double *half = d->lut + 512 * C; /* (2, 16, C) */
    for (int h = 0; h < 2; h++) {
        const int64_t va = v0 + 2 * h, vb = va + 1;
        const double *a = va < d->variants ? d->values + va * 4 * C : NULL;
        const double *b = vb < d->variants ? d->values + vb * 4 * C : NULL;
        for (int i = 0; i < 16; i++)
            for (int64_t c = 0; c < C; c++)
                half[(h * 16 + i) * C + c] =
                    (a ? a[(i & 3) * C + c] : 0.0) + (b ? b[(i >> 2) * C + c] : 0.0);
    }
    for (int i = 0; i < 256; i++)
        for (int64_t c = 0; c < C; c++)
            lut[i * C + c] = half[(i & 15) * C + c] + half[(16 + (i >> 4)) * C + c];
}

static inline __attribute__((always_inline)) void bed_pass(const bed_t *d, int64_t v0,
                                                           const int64_t C) {
    const uint8_t *r[8];
    for (int k = 0; k < 8; k++) /* a row past the end reads row v0: its values are zeros */
        r[k] = d->bed + (v0 + k < d->variants ? v0 + k : v0) * d->brs;
    const double *la = d->lut, *lb = d->lut + 256 * C;
    for (int64_t j = d->lo; j < d->hi; j++) {
        const uint32_t wa = transpose_4x4_codes((uint32_t)r[0][j] | (uint32_t)r[1][j] << 8 |
                                                (uint32_t)r[2][j] << 16 |
                                                (uint32_t)r[3][j] << 24);
        const uint32_t wb = transpose_4x4_codes((uint32_t)r[4][j] | (uint32_t)r[5][j] << 8 |
                                                (uint32_t)r[6][j] << 16 |
                                                (uint32_t)r[7][j] << 24);
        double *o = d->out + 4 * j * C;
        for (int k = 0; k < 4; k++) {
            const double *pa = la + ((wa >> (8 * k)) & 255) * C;
            const double *pb = lb + ((wb >> (8 * k)) & 255) * C;
            for (int64_t c = 0; c < C; c++) o[k * C + c] += pa[c] + pb[c];
        }
    }
}

static void *bed_thread(void *arg) {
    const bed_t *d = (const bed_t *)arg;
    for (int64_t v0 = 0; v0 < d->variants; v0 += 8) {
        bed_group_table(d, v0, d->lut);
        bed_group_table(d, v0 + 4, d->lut + 256 * d->C);
        if (d->C == 4) /* two scores, the dosage sum, the allele count: unrolled */
            bed_pass(d, v0, 4);
        else
            bed_pass(d, v0, d->C);
    }
    return NULL;
}

/* out[4 j + k, c] += sum_v values[v, code of sample 4 j + k at variant v, c] for the
 * `variants` rows of a variant-major .bed block (row v at bed + v * brs, `nbs` sample bytes
 * used), the sample bytes split over `nthreads` threads. `lut` is scratch of
 * nthreads x (2 x 256 + 32) x C doubles. */
void bs_score_bed(const uint8_t *bed, int64_t variants, int64_t brs, int64_t nbs,
                  const double *values, int64_t C, double *out, double *lut, int nthreads) {
    if (variants <= 0 || nbs <= 0 || C <= 0) return;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > BS_MAX_THREADS) nthreads = BS_MAX_THREADS;
    if (nthreads > nbs) nthreads = (int)nbs;
    bed_t spans[BS_MAX_THREADS];
    pthread_t ids[BS_MAX_THREADS];
    int started[BS_MAX_THREADS] = {0};
    for (int t = 0; t < nthreads; t++)
        spans[t] = (bed_t){bed, brs, variants, values, C, out, nbs * t / nthreads,
                           nbs * (t + 1) / nthreads, lut + (int64_t)t * 544 * C};
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&ids[t], NULL, bed_thread, &spans[t]) == 0;
    bed_thread(&spans[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            bed_thread(&spans[t]);
    }
}
