/* CPU kernels of the banded response operator (bound in gpu_ops/_resample_c.py).
 *
 * Layouts (all contiguous, row-major):
 *   f      (M, N, B) float32      fine-grid inputs
 *   w      (N, A, W) float32 / bfloat16 / float16 (wdt = 0 / 1 / 2)
 *   starts (N, A)    int32        window starts, 0 <= starts <= B - W
 *   out    (M, N, A) float32
 * Every output element is written by exactly one thread in a fixed order: no atomics, and
 * the results do not depend on the thread count.
 *
 * Weights are widened to float32 inside the dot loops (bfloat16 is the top half of a
 * float32), so a half-precision operator moves half the bytes and no row is copied first.
 *
 * Specialisation: each kernel's inner code is an always-inlined body taking the weight dtype
 * (or the response) as an argument. Small wrappers fix it to a constant, one per value, and
 * the parallel loops call them through a table of function pointers, once per window or
 * per block of fine points. OpenMP outlines a parallel region before inlining, so a
 * constant passed into a function that holds the region would reach the loops as a
 * variable: a branch per weight load, and response loops that do not vectorise.
 *
 * Vectors are VL floats: 8 (one AVX2 register) or 16 (AVX-512). Register blocks are sized
 * for 16 vector registers (AVX2) or 32 (AVX-512): the forward's 4 inputs x 2 vectors of sums
 * plus 2 weight vectors fit either.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define VL 16
#define MB_MAX 8 /* inputs per register block in the transposed band */
#else
#define VL 8
#define MB_MAX 4
#endif

typedef float vf __attribute__((vector_size(4 * VL)));
typedef float vfu __attribute__((vector_size(4 * VL), aligned(4)));
typedef uint16_t vhu __attribute__((vector_size(2 * VL), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));

INLINE float wload(const void *w, const int wdt, int64_t i) {
    if (wdt == 0) return ((const float *)w)[i];
    if (wdt == 1) {
        uint32_t u = ((uint32_t)((const uint16_t *)w)[i]) << 16;
        float x;
        memcpy(&x, &u, sizeof x);
        return x;
    }
    return (float)((const _Float16 *)w)[i];
}

/* Weights i .. i + VL - 1 widened to float32. */
INLINE vf wloadv(const void *w, const int wdt, int64_t i) {
    if (wdt == 0) return *(const vfu *)((const float *)w + i);
    if (wdt == 1) {
        const vhu h = *(const vhu *)((const uint16_t *)w + i);
        const vu u = __builtin_convertvector(h, vu) << 16;
        vf x;
        memcpy(&x, &u, sizeof x);
        return x;
    }
    vf x;
    for (int t = 0; t < VL; t++) x[t] = (float)((const _Float16 *)w)[i + t];
    return x;
}

/* Weights j .. j + VL - 1 of a row of W, zeros outside [0, W). */
INLINE vf wloadv_edge(const void *w, const int wdt, int64_t j, int64_t W) {
    float tmp[VL];
    for (int t = 0; t < VL; t++) tmp[t] = (j + t >= 0 && j + t < W) ? wload(w, wdt, j + t) : 0.0f;
    vf x;
    memcpy(&x, tmp, sizeof x);
    return x;
}

INLINE vf fload(const float *p) { return *(const vfu *)p; }

INLINE float hsum(vf v) {
    float t = 0.f;
    for (int i = 0; i < VL; i++) t += v[i];
    return t;
}

/* The row of weights of (n, a) = band row r. */
INLINE const void *wrow(const void *w, const int wdt, int64_t r, int64_t W) {
    return (const char *)w + r * W * (wdt == 0 ? 4 : 2);
}

/* --- forward ----------------------------------------------------------------------------- */

/* o[k * os] = sum_j w[j] * fr[k * fs + j] for k < mb: one coarse point, mb inputs sharing
 * each weight load, two vectors per input for ILP. The tail uses an explicit fmaf: left to
 * the compiler, it was contracted for some weight dtypes and not others, and the half-precision
 * paths (fused, or widened first for M > 4) then differed in the last bit. */
INLINE void dot_mb(const float *fr, int64_t fs, const void *w, const int wdt, int64_t W,
                   float *o, int64_t os, const int mb) {
    vf acc[4][2];
    for (int k = 0; k < mb; k++) acc[k][0] = acc[k][1] = (vf){0};
    int64_t j = 0;
    for (; j + 2 * VL <= W; j += 2 * VL) {
        const vf w0 = wloadv(w, wdt, j), w1 = wloadv(w, wdt, j + VL);
        for (int k = 0; k < mb; k++) {
            acc[k][0] += w0 * fload(fr + k * fs + j);
            acc[k][1] += w1 * fload(fr + k * fs + j + VL);
        }
    }
    for (int k = 0; k < mb; k++) {
        float t = hsum(acc[k][0] + acc[k][1]);
        for (int64_t i = j; i < W; i++) t = __builtin_fmaf(wload(w, wdt, i), fr[k * fs + i], t);
        o[k * os] = t;
    }
}

/* dot_mb for a single input, with the weights prefetched 16 vectors ahead (measured, bfloat16
 * weights at M = 1: 0.61x the float32 time with the prefetch, 0.71x without). The additions
 * happen in exactly dot_mb's order (two sums, alternate vectors), so an input's result does
 * not depend on which other inputs share its batch: the server batches requests together,
 * and the same request must give the same bits. */
INLINE float dot_1(const float *fr, const void *w, const int wdt, int64_t W) {
    vf acc0 = {0}, acc1 = {0};
    const int es = wdt == 0 ? 4 : 2;
    int64_t j = 0;
    for (; j + 4 * VL <= W; j += 4 * VL) {
        __builtin_prefetch((const char *)w + (j + 16 * VL) * es);
        if (es == 4) __builtin_prefetch((const char *)w + (j + 16 * VL) * es + 64);
        acc0 += wloadv(w, wdt, j) * fload(fr + j);
        acc1 += wloadv(w, wdt, j + VL) * fload(fr + j + VL);
        acc0 += wloadv(w, wdt, j + 2 * VL) * fload(fr + j + 2 * VL);
        acc1 += wloadv(w, wdt, j + 3 * VL) * fload(fr + j + 3 * VL);
    }
    for (; j + 2 * VL <= W; j += 2 * VL) {
        acc0 += wloadv(w, wdt, j) * fload(fr + j);
        acc1 += wloadv(w, wdt, j + VL) * fload(fr + j + VL);
    }
    float t = hsum(acc0 + acc1);
    for (; j < W; j++) t = __builtin_fmaf(wload(w, wdt, j), fr[j], t);
    return t;
}

/* One coarse point's window w (W) for all M inputs, out o[m * os]. */
INLINE void dots(const float *fr, int64_t fs, const void *w, const int wdt, int64_t W, float *o,
                 int64_t os, int64_t M) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_mb(fr + m * fs, fs, w, wdt, W, o + m * os, os, 4);
    for (; m < M; m++) o[m * os] = dot_1(fr + m * fs, w, wdt, W);
}

/* Points a0 .. a1 - 1 of function n for all M inputs; buf holds W floats. */
INLINE void forward_points(const int wdt, const float *f, const void *w, const int32_t *starts,
                           float *out, int64_t M, int64_t N, int64_t A, int64_t B, int64_t W,
                           int64_t n, int64_t a0, int64_t a1, float *buf) {
    const int64_t fs = N * B, os = N * A;
    for (int64_t a = a0; a < a1; a++) {
        const void *wa = wrow(w, wdt, n * A + a, W);
        const float *fr = f + n * B + starts[n * A + a];
        float *o = out + n * A + a;
        /* Half-precision weights with many inputs: widened once into buf rather than once per
         * input block (measured faster at M = 64; fused is as fast at M <= 4). */
        if (wdt != 0 && M > 4) {
            for (int64_t j = 0; j < W; j++) buf[j] = wload(wa, wdt, j);
            dots(fr, fs, buf, 0, W, o, os, M);
        } else {
            dots(fr, fs, wa, wdt, W, o, os, M);
        }
    }
}

typedef void (*forward_fn)(const float *, const void *, const int32_t *, float *, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float *);
#define FORWARD(WDT)                                                                          \
    static void forward_##WDT(const float *f, const void *w, const int32_t *s, float *out,   \
                              int64_t M, int64_t N, int64_t A, int64_t B, int64_t W,          \
                              int64_t n, int64_t a0, int64_t a1, float *buf) {                \
        forward_points(WDT, f, w, s, out, M, N, A, B, W, n, a0, a1, buf);                     \
    }
FORWARD(0)
FORWARD(1)
FORWARD(2)
static const forward_fn FORWARDS[3] = {forward_0, forward_1, forward_2};

/* Tasks of 8 consecutive coarse points: one call through the table per task. */
void bs_forward(const float *f, const void *w, int wdt, const int32_t *starts, float *out,
                int64_t M, int64_t N, int64_t A, int64_t B, int64_t W, int nthreads) {
    const forward_fn run = FORWARDS[wdt];
    const int64_t step = 8, nblk = (A + step - 1) / step;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)W); /* a widened row */
#pragma omp for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t k = 0; k < nblk; k++) {
                const int64_t a1 = (k + 1) * step < A ? (k + 1) * step : A;
                run(f, w, starts, out, M, N, A, B, W, n, k * step, a1, buf);
            }
        free(buf);
    }
}

/* The stored band on bit-packed rows, packed (M, N, nbytes) uint8 (bits b < B): each row n's
 * M inputs are unpacked into a per-thread buffer of floats (M x ceil(B / 8) * 8, from a
 * 256-entry table of 8 floats per byte), then its coarse points take exactly bs_forward's
 * dots: the same sums in the same order as the band on unpacked floats, with no (M, N, B)
 * float tensor written to memory and read back. Tasks are whole rows (the caller takes
 * bs_forward where rows are fewer than threads). */
void bs_forward_bits(const uint8_t *packed, int64_t nbytes, int big, const void *w, int wdt,
                     const int32_t *starts, float *out, int64_t M, int64_t N, int64_t A,
                     int64_t B, int64_t W, int nthreads) {
    float lut[256][8];
    for (int v = 0; v < 256; v++)
        for (int j = 0; j < 8; j++) lut[v][j] = (float)((v >> (big ? 7 - j : j)) & 1);
    const int64_t nb = (B + 7) / 8, Bp = nb * 8, os = N * A;
#pragma omp parallel num_threads(nthreads)
    {
        float *f = (float *)malloc(sizeof(float) * (size_t)(M * Bp > 0 ? M * Bp : 1));
        float *buf = (float *)malloc(sizeof(float) * (size_t)(W > 0 ? W : 1));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t m = 0; m < M; m++) {
                const uint8_t *row = packed + (m * N + n) * nbytes;
                float *dst = f + m * Bp;
                for (int64_t k = 0; k < nb; k++) memcpy(dst + 8 * k, lut[row[k]], sizeof lut[0]);
            }
            for (int64_t a = 0; a < A; a++) {
                const void *wa = wrow(w, wdt, n * A + a, W);
                const float *fr = f + starts[n * A + a];
                float *o = out + n * A + a;
                if (wdt != 0 && M > 4) { /* as forward_points: half weights widened once */
                    for (int64_t j = 0; j < W; j++) buf[j] = wload(wa, wdt, j);
                    dots(fr, Bp, buf, 0, W, o, os, M);
                } else if (wdt == 0) {
                    dots(fr, Bp, wa, 0, W, o, os, M);
                } else if (wdt == 1) {
                    dots(fr, Bp, wa, 1, W, o, os, M);
                } else {
                    dots(fr, Bp, wa, 2, W, o, os, M);
                }
            }
        }
        free(f);
        free(buf);
    }
}

/* --- grad_f, any start order: scan every window per block of fine points ---------------- */

INLINE void scan_block(const int wdt, const float *g, const void *w, const int32_t *starts,
                       float *gf, int64_t M, int64_t N, int64_t A, int64_t B, int64_t W,
                       int64_t n, int64_t b0, int64_t b1) {
    for (int64_t m = 0; m < M; m++)
        memset(gf + (m * N + n) * B + b0, 0, sizeof(float) * (size_t)(b1 - b0));
    for (int64_t a = 0; a < A; a++) {
        const int64_t s = starts[n * A + a];
        const int64_t lo = s > b0 ? s : b0, hi = s + W < b1 ? s + W : b1;
        if (lo >= hi) continue;
        const void *wa = wrow(w, wdt, n * A + a, W);
        for (int64_t m = 0; m < M; m++) {
            const float gm = g[(m * N + n) * A + a];
            float *dst = gf + (m * N + n) * B;
#pragma omp simd
            for (int64_t j = lo; j < hi; j++) dst[j] += gm * wload(wa, wdt, j - s);
        }
    }
}

typedef void (*block_fn)(const float *, const void *, const int32_t *, float *, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
#define SCAN(WDT)                                                                             \
    static void scan_##WDT(const float *g, const void *w, const int32_t *s, float *gf,       \
                           int64_t M, int64_t N, int64_t A, int64_t B, int64_t W, int64_t n,  \
                           int64_t b0, int64_t b1) {                                          \
        scan_block(WDT, g, w, s, gf, M, N, A, B, W, n, b0, b1);                               \
    }
SCAN(0)
SCAN(1)
SCAN(2)
static const block_fn SCANS[3] = {scan_0, scan_1, scan_2};

static void blocks(const block_fn run, const float *g, const void *w, const int32_t *starts,
                   float *gf, int64_t M, int64_t N, int64_t A, int64_t B, int64_t W,
                   int64_t BB, int nthreads) {
    const int64_t nblk = (B + BB - 1) / BB;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < nblk; k++) {
            const int64_t b0 = k * BB, b1 = b0 + BB < B ? b0 + BB : B;
            run(g, w, starts, gf, M, N, A, B, W, n, b0, b1);
        }
}

void bs_backward_f(const float *g, const void *w, int wdt, const int32_t *starts, float *gf,
                   int64_t M, int64_t N, int64_t A, int64_t B, int64_t W, int64_t BB,
                   int nthreads) {
    blocks(SCANS[wdt], g, w, starts, gf, M, N, A, B, W, BB, nthreads);
}

/* --- grad_f, starts sorted along each row: register-blocked transposed band ------------- *
 * A tile of TB fine points is reached by one contiguous range of coarse points (sorted
 * starts). For mb inputs at a time the tile's mb x TB sums live in registers; each coarse
 * point adds g[m, a] * its weights to them, so a weight is loaded once per mb inputs, and
 * the tile's weights stay in L1 across the input blocks. */

#define TB (2 * VL) /* fine points per tile: two vectors */
#define SB 512      /* fine points per task */

/* First a in [lo, hi) with key(a) > v, key(a) = starts[a] + off (non-decreasing). */
static int64_t upper(const int32_t *s, int64_t lo, int64_t hi, int64_t off, int64_t v) {
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (s[mid] + off > v) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

INLINE void tile_mb(const float *g, const void *w, const int wdt, const int32_t *s,
                    float *gf, const int mb, int64_t m0, int64_t n, int64_t N, int64_t A,
                    int64_t B, int64_t W, int64_t t0, int64_t tw, int64_t a_lo, int64_t a_hi) {
    vf acc[MB_MAX][2];
    for (int k = 0; k < mb; k++) acc[k][0] = acc[k][1] = (vf){0};
    const float *gk = g + (m0 * N + n) * A;
    for (int64_t a = a_lo; a < a_hi; a++) {
        const int64_t sa = s[a];
        const void *wa = wrow(w, wdt, n * A + a, W);
        vf w0, w1;
        if (tw == TB && sa <= t0 && sa + W >= t0 + TB) {
            w0 = wloadv(wa, wdt, t0 - sa);
            w1 = wloadv(wa, wdt, t0 - sa + VL);
        } else { /* the window ends or starts inside the tile, or the grid ends in it */
            w0 = wloadv_edge(wa, wdt, t0 - sa, tw < W + sa - t0 ? tw + t0 - sa : W);
            w1 = wloadv_edge(wa, wdt, t0 - sa + VL, tw < W + sa - t0 ? tw + t0 - sa : W);
        }
        /* Separate statements per k keep acc in registers (no address is taken). */
        for (int k = 0; k < mb; k++) {
            const float gm = gk[k * N * A + a];
            acc[k][0] += gm * w0;
            acc[k][1] += gm * w1;
        }
    }
    for (int k = 0; k < mb; k++) {
        float *dst = gf + ((m0 + k) * N + n) * B + t0;
        if (tw == TB) {
            *(vfu *)dst = acc[k][0];
            *(vfu *)(dst + VL) = acc[k][1];
        } else {
            float tmp[TB];
            memcpy(tmp, &acc[k][0], sizeof(vf));
            memcpy(tmp + VL, &acc[k][1], sizeof(vf));
            memcpy(dst, tmp, sizeof(float) * (size_t)tw);
        }
    }
}

INLINE void sorted_block(const int wdt, const float *g, const void *w, const int32_t *starts,
                         float *gf, int64_t M, int64_t N, int64_t A, int64_t B, int64_t W,
                         int64_t n, int64_t b0, int64_t b1) {
    const int32_t *s = starts + n * A;
    for (int64_t t0 = b0; t0 < b1; t0 += TB) {
        const int64_t tw = t0 + TB < b1 ? TB : b1 - t0;
        /* windows [s, s + W) that reach [t0, t0 + tw): s + W > t0 and s < t0 + tw */
        const int64_t a_lo = upper(s, 0, A, W, t0);
        const int64_t a_hi = upper(s, a_lo, A, 0, t0 + tw - 1);
        int64_t m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX)
            tile_mb(g, w, wdt, s, gf, MB_MAX, m, n, N, A, B, W, t0, tw, a_lo, a_hi);
        for (; m < M; m++) tile_mb(g, w, wdt, s, gf, 1, m, n, N, A, B, W, t0, tw, a_lo, a_hi);
    }
}

#define SORTED(WDT)                                                                           \
    static void sorted_##WDT(const float *g, const void *w, const int32_t *s, float *gf,     \
                             int64_t M, int64_t N, int64_t A, int64_t B, int64_t W,           \
                             int64_t n, int64_t b0, int64_t b1) {                             \
        sorted_block(WDT, g, w, s, gf, M, N, A, B, W, n, b0, b1);                             \
    }
SORTED(0)
SORTED(1)
SORTED(2)
static const block_fn SORTEDS[3] = {sorted_0, sorted_1, sorted_2};

void bs_backward_f_sorted(const float *g, const void *w, int wdt, const int32_t *starts,
                          float *gf, int64_t M, int64_t N, int64_t A, int64_t B, int64_t W,
                          int nthreads) {
    blocks(SORTEDS[wdt], g, w, starts, gf, M, N, A, B, W, SB, nthreads);
}

/* grad_w[n, a, j] = sum_m g[m, n, a] * f[m, n, starts[n, a] + j], float32 (N, A, W). */
void bs_backward_w(const float *g, const float *f, const int32_t *starts, float *gw, int64_t M,
                   int64_t N, int64_t A, int64_t B, int64_t W, int nthreads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t a = 0; a < A; a++) {
            float *dst = gw + (n * A + a) * W;
            const int64_t s = starts[n * A + a];
            memset(dst, 0, sizeof(float) * (size_t)W);
            for (int64_t m = 0; m < M; m++) {
                const float gm = g[(m * N + n) * A + a];
                const float *src = f + (m * N + n) * B + s;
#pragma omp simd
                for (int64_t j = 0; j < W; j++) dst[j] += gm * src[j];
            }
        }
    }
}

/* --- on the fly: the weights of a response computed per window -------------------------- *
 * Layouts: x (B,) double (sorted), c (N, A) double, first/last (N, A) int64 (each window is
 * [first, last), at most wmax points), f (M, N, B) float32. The offsets c - x are formed in
 * double (c and x may be large while the response is narrow), then the response is evaluated
 * in float32 into a per-thread buffer: the same numbers the Triton kernels use.
 * Response codes (gpu_ops.responses.NamedResponse.code): 0 gaussian, 1 boxcar, 2 triangle,
 * 3 lorentzian, 4 laplacian, 5 exponential, 6 alpha, 7 epanechnikov (all unit peak, at their
 * own origin: the callers move c for a centred causal response), and 8 a table
 * (gpu_ops.responses.TABLE_CODE): K breakpoints tx, increasing, and their values ty,
 * linear in between, evaluated in double from the double offsets. */

#define TABLE 8
#define NCODES 9

/* The response the kernels evaluate: a named one's parameter, or a table. */
typedef struct {
    float p;              /* the named response's parameter */
    const float *tx, *ty; /* the table (code TABLE): K breakpoints, then K values */
    int64_t K;
} resp_t;

INLINE resp_t resp_of(float p, const float *table, int64_t K) {
    const resp_t R = {p, table, table ? table + K : NULL, K};
    return R;
}

/* The table's segment [tx[i], tx[i + 1]] holding offset d, walked to from the segment i
 * (0 <= i <= K - 2): offsets visited in order cost a step or two each. Past either end it is
 * the end segment: the windows decide what is inside, and a window's offset can only pass
 * an end by a rounding. */
INLINE int64_t table_walk(const resp_t *R, double d, int64_t i) {
    while (i > 0 && d < R->tx[i]) i--;
    while (i < R->K - 2 && d >= R->tx[i + 1]) i++;
    return i;
}

/* The segment of offset d by bisection (the first guess of a walk). */
static int64_t table_find(const resp_t *R, double d) {
    int64_t lo = 0, hi = R->K - 2;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (R->tx[mid] <= d) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* The table at d on segment i (clamped to it), and its slope there. */
INLINE float table_value(const resp_t *R, double d, int64_t i) {
    const double x0 = R->tx[i], x1 = R->tx[i + 1], y0 = R->ty[i], y1 = R->ty[i + 1];
    double t = (d - x0) / (x1 - x0);
    t = t < 0.0 ? 0.0 : (t > 1.0 ? 1.0 : t);
    return (float)(y0 + (y1 - y0) * t);
}

INLINE float table_slope(const resp_t *R, int64_t i) {
    return (float)(((double)R->ty[i + 1] - R->ty[i]) / ((double)R->tx[i + 1] - R->tx[i]));
}

/* w[j] = table(c - xs[j]) for j < len (offsets decreasing in j); with dw, also the slope. */
INLINE void table_response(const resp_t *R, const double *xs, double c, int64_t len, float *w,
                           float *dw) {
    if (len <= 0) return;
    int64_t i = table_find(R, c - xs[0]);
    for (int64_t j = 0; j < len; j++) {
        const double d = c - xs[j];
        i = table_walk(R, d, i);
        w[j] = table_value(R, d, i);
        if (dw) dw[j] = table_slope(R, i);
    }
}

/* exp(x) for x <= 0, relative error ~2e-7: Cephes' expf polynomial after a ln 2 range
 * reduction, without calls or branches so that the loops below vectorise. Arguments below
 * -87 are clamped (the result, ~1e-38, is zero for every purpose here). */
INLINE float exp_neg(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float t = x * 1.44269504088896341f;
    const float k = (t + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 trick */
    const float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)k + 127) << 23}; /* 2^k */
    return y * scale.f;
}

/* d[j] = c - xs[j] in double, rounded to float32 (its own loop: mixing the double and float
 * lanes in one loop keeps gcc from vectorising the responses). */
INLINE void offsets(const double *xs, double c, int64_t len, float *d) {
#pragma omp simd
    for (int64_t j = 0; j < len; j++) d[j] = (float)(c - xs[j]);
}

/* w[j] = r(w[j]): the response at the offsets held in w, in place, j < len. */
INLINE void shape(const int code, int64_t len, float p, float *w) {
    const float ip = 1.0f / p;
#pragma omp simd
    for (int64_t j = 0; j < len; j++) {
        const float d = w[j];
        const float u = d * ip;
        float r;
        if (code == 0) r = exp_neg(-0.5f * u * u);
        else if (code == 1) r = (float)(__builtin_fabsf(d) <= p);
        else if (code == 2) {
            const float t = 1.0f - __builtin_fabsf(u);
            r = t > 0.0f ? t : 0.0f;
        }
        else if (code == 3) r = 1.0f / (1.0f + u * u);
        else if (code == 4) r = exp_neg(-__builtin_fabsf(u));
        else if (code == 5) r = u >= 0.0f ? exp_neg(-u) : 0.0f;
        else if (code == 6) r = u >= 0.0f ? u * exp_neg(1.0f - u) : 0.0f;
        else {
            const float t = 1.0f - u * u;
            r = t > 0.0f ? t : 0.0f;
        }
        w[j] = r;
    }
}

/* w[j] = r(c - xs[j]) for j < len. */
INLINE void response(const int code, const double *xs, double c, int64_t len, const resp_t *R,
                     float *w) {
    if (code == TABLE) {
        table_response(R, xs, c, len, w, NULL);
        return;
    }
    offsets(xs, c, len, w);
    shape(code, len, R->p, w);
}

/* dd[j] = dr/dd and dp[j] = dr/dp at d = c - xs[j], j < len (boxcar: zero almost everywhere;
 * a table: its slope, and no parameter). */
INLINE void derivatives(const int code, const double *xs, double c, int64_t len,
                        const resp_t *R, float *dd, float *dp) {
    if (code == TABLE) {
        float *w = dp; /* the values are not needed: dp holds them, then zeros */
        table_response(R, xs, c, len, w, dd);
        memset(dp, 0, sizeof(float) * (size_t)len);
        return;
    }
    const float p = R->p, ip = 1.0f / p;
    offsets(xs, c, len, dd);
#pragma omp simd
    for (int64_t j = 0; j < len; j++) {
        const float d = dd[j];
        const float u = d * ip;
        float a, b;
        if (code == 0) {
            const float r = exp_neg(-0.5f * u * u);
            a = -u * ip * r;
            b = u * u * ip * r;
        } else if (code == 1) {
            a = 0.0f;
            b = 0.0f;
        } else if (code == 2) {
            const float ad = __builtin_fabsf(d);
            const float on = (float)(ad < p);
            const float sgn = (float)(d > 0) - (float)(d < 0);
            a = -on * sgn * ip;
            b = on * ad * ip * ip;
        } else if (code == 3) {
            const float q = 1.0f / (1.0f + u * u);
            a = -2.0f * u * q * q * ip;
            b = 2.0f * u * u * q * q * ip;
        } else if (code == 4) {
            const float au = __builtin_fabsf(u);
            const float r = exp_neg(-au);
            const float sgn = (float)(d > 0) - (float)(d < 0);
            a = -sgn * ip * r;
            b = au * ip * r;
        } else if (code == 5) {
            const float on = (float)(u >= 0.0f);
            const float r = on * exp_neg(-(u > 0.0f ? u : 0.0f));
            a = -r * ip;
            b = u * ip * r;
        } else if (code == 6) {
            const float on = (float)(u >= 0.0f);
            const float e = on * exp_neg(1.0f - (u > 0.0f ? u : 0.0f));
            a = (1.0f - u) * e * ip;
            b = -u * (1.0f - u) * e * ip;
        } else {
            const float on = (float)(__builtin_fabsf(u) < 1.0f);
            a = -2.0f * u * ip * on;
            b = 2.0f * u * u * ip * on;
        }
        dd[j] = a;
        dp[j] = b;
    }
}

typedef void (*response_fn)(const double *, double, int64_t, const resp_t *, float *);
typedef void (*derivatives_fn)(const double *, double, int64_t, const resp_t *, float *,
                               float *);
#define RESPONSE(CODE)                                                                        \
    static void response_##CODE(const double *xs, double c, int64_t len, const resp_t *R,    \
                                float *w) {                                                   \
        response(CODE, xs, c, len, R, w);                                                     \
    }                                                                                         \
    static void derivatives_##CODE(const double *xs, double c, int64_t len, const resp_t *R, \
                                   float *dd, float *dp) {                                    \
        derivatives(CODE, xs, c, len, R, dd, dp);                                             \
    }
RESPONSE(0)
RESPONSE(1)
RESPONSE(2)
RESPONSE(3)
RESPONSE(4)
RESPONSE(5)
RESPONSE(6)
RESPONSE(7)
RESPONSE(8)
static const response_fn RESPONSES[NCODES] = {response_0, response_1, response_2,
                                              response_3, response_4, response_5,
                                              response_6, response_7, response_8};
static const derivatives_fn DERIVATIVES[NCODES] = {
    derivatives_0, derivatives_1, derivatives_2, derivatives_3, derivatives_4,
    derivatives_5, derivatives_6, derivatives_7, derivatives_8};

static float *thread_buffer(int64_t n) {
    return (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
}

void bs_otf_forward(const float *f, const double *x, const double *c, const int64_t *first,
                    const int64_t *last, float p, int code, const float *table, int64_t K,
                    float *out, int64_t M, int64_t N, int64_t A, int64_t B, int64_t wmax,
                    int nthreads) {
    const response_fn r = RESPONSES[code];
    const resp_t R = resp_of(p, table, K);
#pragma omp parallel num_threads(nthreads)
    {
        float *w = thread_buffer(wmax);
#pragma omp for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t a = 0; a < A; a++) {
                const int64_t lo = first[n * A + a], len = last[n * A + a] - lo;
                float *o = out + n * A + a;
                if (len <= 0) {
                    for (int64_t m = 0; m < M; m++) o[m * N * A] = 0.0f;
                    continue;
                }
                r(x + lo, c[n * A + a], len, &R, w);
                dots(f + n * B + lo, N * B, w, 0, len, o, N * A, M);
            }
        }
        free(w);
    }
}

/* grad_f: per (function, block of BB fine points), every window reaching the block adds
 * g[m, n, a] * its weights there; each weight is evaluated once overall (the block cuts the
 * window), every output is written by one thread, in a fixed order. */
void bs_otf_backward_f(const float *g, const double *x, const double *c, const int64_t *first,
                       const int64_t *last, float p, int code, const float *table, int64_t K,
                       float *gf, int64_t M, int64_t N, int64_t A, int64_t B, int64_t BB,
                       int nthreads) {
    const response_fn r = RESPONSES[code];
    const resp_t R = resp_of(p, table, K);
    const int64_t nblk = (B + BB - 1) / BB;
#pragma omp parallel num_threads(nthreads)
    {
        float *w = thread_buffer(BB);
#pragma omp for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t k = 0; k < nblk; k++) {
                const int64_t b0 = k * BB, b1 = b0 + BB < B ? b0 + BB : B;
                for (int64_t m = 0; m < M; m++)
                    memset(gf + (m * N + n) * B + b0, 0, sizeof(float) * (size_t)(b1 - b0));
                for (int64_t a = 0; a < A; a++) {
                    const int64_t fa = first[n * A + a], la = last[n * A + a];
                    const int64_t lo = fa > b0 ? fa : b0, hi = la < b1 ? la : b1;
                    if (lo >= hi) continue;
                    r(x + lo, c[n * A + a], hi - lo, &R, w);
                    for (int64_t m = 0; m < M; m++) {
                        const float gm = g[(m * N + n) * A + a];
                        float *dst = gf + (m * N + n) * B + lo;
#pragma omp simd
                        for (int64_t j = 0; j < hi - lo; j++) dst[j] += gm * w[j];
                    }
                }
            }
        }
        free(w);
    }
}

/* grad_c[n, a] = sum_m g[m, n, a] sum_j dr/dd f[m, n, j] and the parameter's partial
 * gp[n, a] likewise with dr/dp (summed by the caller): one (n, a) per iteration, so every
 * output is written once. Not called for boxcar (its derivatives are zero). */
void bs_otf_backward_cp(const float *f, const float *g, const double *x, const double *c,
                        const int64_t *first, const int64_t *last, float p, int code,
                        const float *table, int64_t K, float *gc, float *gp, int64_t M,
                        int64_t N, int64_t A, int64_t B, int64_t wmax, int nthreads) {
    const derivatives_fn dr = DERIVATIVES[code];
    const resp_t R = resp_of(p, table, K);
#pragma omp parallel num_threads(nthreads)
    {
        float *dd = thread_buffer(2 * wmax), *dp = dd + wmax;
        float *sc = thread_buffer(2 * M), *sp = sc + M;
#pragma omp for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t a = 0; a < A; a++) {
                const int64_t lo = first[n * A + a], len = last[n * A + a] - lo;
                double acc_c = 0.0, acc_p = 0.0;
                if (len > 0) {
                    dr(x + lo, c[n * A + a], len, &R, dd, dp);
                    dots(f + n * B + lo, N * B, dd, 0, len, sc, 1, M);
                    dots(f + n * B + lo, N * B, dp, 0, len, sp, 1, M);
                    for (int64_t m = 0; m < M; m++) {
                        const double gm = g[(m * N + n) * A + a];
                        acc_c += gm * sc[m];
                        acc_p += gm * sp[m];
                    }
                }
                gc[n * A + a] = (float)acc_c;
                gp[n * A + a] = (float)acc_p;
            }
        }
        free(dd);
        free(sc);
    }
}

/* --- from packed bits: event scatter and prefix sums -------------------------------------- *
 * Inputs are bit-packed rows, packed (M, N, nbytes) uint8, bit b of a row at byte b / 8, from
 * the top bit down ("big") or the bottom bit up ("little"); bits at b >= B are ignored. Each
 * row is one task (its outputs are written by one thread, in a fixed order). Coarse points
 * are sorted along each row, so the windows holding a fine point b are one contiguous range
 * of coarse points, [lo, hi), and both ends only move forward as b grows. */

/* The set bits of byte v in increasing bit index, one at a time: j, then v without it. */
INLINE int next_bit(unsigned v, const int big) {
    return big ? __builtin_clz(v) - 24 : __builtin_ctz(v);
}
INLINE unsigned drop_bit(unsigned v, int j, const int big) {
    return big ? v & ~(0x80u >> j) : v & (v - 1);
}

/* The events (set bits at b < B) of one row, in increasing order, into ev; their number.
 * Eight bytes at a time while all their bits are below B (a set bit costs a count of
 * leading or trailing zeros, and a word's loop exits once, not each byte's), then byte by
 * byte. "big" reads the word byte-swapped, so bits from the top down are the events in
 * order. */
static int64_t row_events(const uint8_t *row, int64_t nbytes, int big, int64_t B, int32_t *ev) {
    int64_t n = 0, k = 0;
    const int64_t below = B / 8 < nbytes ? B / 8 : nbytes; /* bytes whose bits are all < B */
    for (; k + 8 <= below; k += 8) {
        uint64_t w;
        memcpy(&w, row + k, 8);
        const int32_t base = (int32_t)(k * 8);
        if (big) {
            w = __builtin_bswap64(w);
            while (w) {
                const int j = __builtin_clzll(w);
                ev[n++] = base + j;
                w ^= 0x8000000000000000ull >> j;
            }
        } else {
            while (w) {
                ev[n++] = base + __builtin_ctzll(w);
                w &= w - 1;
            }
        }
    }
    for (; k < nbytes; k++) {
        unsigned v = row[k];
        while (v) {
            const int j = next_bit(v, big);
            const int64_t b = k * 8 + j;
            if (b >= B) return n;
            ev[n++] = (int32_t)b;
            v = drop_bit(v, j, big);
        }
    }
    return n;
}

/* Set bits over all rows: counts[r] for r < R (the dispatcher's density). */
void bs_bit_counts(const uint8_t *packed, int64_t R, int64_t nbytes, int64_t *counts,
                   int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *row = packed + r * nbytes;
        int64_t n = 0, k = 0;
        for (; k + 8 <= nbytes; k += 8) {
            uint64_t word;
            memcpy(&word, row + k, 8);
            n += __builtin_popcountll(word);
        }
        for (; k < nbytes; k++) n += __builtin_popcount(row[k]);
        counts[r] = n;
    }
}

/* Stored band: out[a] += w[a, b - starts[a]] for every event b and window a holding it. */
INLINE void events_band_row(const int wdt, const int32_t *ev, int64_t E, const void *w,
                            const int32_t *s, float *o, int64_t A, int64_t W) {
    int64_t lo = 0, hi = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t b = ev[e];
        while (hi < A && s[hi] <= b) hi++;
        while (lo < hi && s[lo] + W <= b) lo++;
        for (int64_t a = lo; a < hi; a++) o[a] += wload(w, wdt, a * W + b - s[a]);
    }
}

typedef void (*events_band_fn)(const int32_t *, int64_t, const void *, const int32_t *, float *,
                               int64_t, int64_t);
#define EVENTS_BAND(WDT)                                                                      \
    static void events_band_##WDT(const int32_t *ev, int64_t E, const void *w,               \
                                  const int32_t *s, float *o, int64_t A, int64_t W) {         \
        events_band_row(WDT, ev, E, w, s, o, A, W);                                           \
    }
EVENTS_BAND(0)
EVENTS_BAND(1)
EVENTS_BAND(2)
static const events_band_fn EVENTS_BANDS[3] = {events_band_0, events_band_1, events_band_2};

void bs_events_band(const uint8_t *packed, int64_t nbytes, int big, const void *w, int wdt,
                    const int32_t *starts, float *out, int64_t M, int64_t N, int64_t A,
                    int64_t B, int64_t W, int nthreads) {
    const events_band_fn run = EVENTS_BANDS[wdt];
    const int64_t es = wdt == 0 ? 4 : 2;
#pragma omp parallel num_threads(nthreads)
    {
        int32_t *ev = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B > 0 ? B : 1));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M * N; r++) {
            const int64_t n = r % N;
            float *o = out + r * A;
            memset(o, 0, sizeof(float) * (size_t)A);
            const int64_t E = row_events(packed + r * nbytes, nbytes, big, B, ev);
            run(ev, E, (const char *)w + n * A * W * es, starts + n * A, o, A, W);
        }
        free(ev);
    }
}

/* On the fly: out[a] += r(c[a] - x[b]) over the windows [first[a], last[a]) holding b; the
 * responses of one event over its contiguous coarse range are evaluated as one vector. */
INLINE void events_otf_row(const int code, const int32_t *ev, int64_t E, const double *x,
                           const double *c, const int64_t *first, const int64_t *last,
                           const resp_t *R, float *o, int64_t A, float *buf) {
    int64_t lo = 0, hi = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t b = ev[e];
        while (hi < A && first[hi] <= b) hi++;
        while (lo < hi && last[lo] <= b) lo++;
        const int64_t len = hi - lo;
        if (len <= 0) continue;
        const double xb = x[b];
        if (code == TABLE) { /* offsets increasing in a: one walk along the table */
            int64_t i = table_find(R, c[lo] - xb);
            for (int64_t j = 0; j < len; j++) {
                const double d = c[lo + j] - xb;
                i = table_walk(R, d, i);
                o[lo + j] += table_value(R, d, i);
            }
            continue;
        }
#pragma omp simd
        for (int64_t j = 0; j < len; j++) buf[j] = (float)(c[lo + j] - xb);
        shape(code, len, R->p, buf);
#pragma omp simd
        for (int64_t j = 0; j < len; j++) o[lo + j] += buf[j];
    }
}

typedef void (*events_otf_fn)(const int32_t *, int64_t, const double *, const double *,
                              const int64_t *, const int64_t *, const resp_t *, float *,
                              int64_t, float *);
#define EVENTS_OTF(CODE)                                                                      \
    static void events_otf_##CODE(const int32_t *ev, int64_t E, const double *x,             \
                                  const double *c, const int64_t *fi, const int64_t *la,      \
                                  const resp_t *R, float *o, int64_t A, float *buf) {         \
        events_otf_row(CODE, ev, E, x, c, fi, la, R, o, A, buf);                              \
    }
EVENTS_OTF(0)
EVENTS_OTF(1)
EVENTS_OTF(2)
EVENTS_OTF(3)
EVENTS_OTF(4)
EVENTS_OTF(5)
EVENTS_OTF(6)
EVENTS_OTF(7)
EVENTS_OTF(8)
static const events_otf_fn EVENTS_OTFS[NCODES] = {
    events_otf_0, events_otf_1, events_otf_2, events_otf_3, events_otf_4,
    events_otf_5, events_otf_6, events_otf_7, events_otf_8};

void bs_events_otf(const uint8_t *packed, int64_t nbytes, int big, const double *x,
                   const double *c, const int64_t *first, const int64_t *last, float p, int code,
                   const float *table, int64_t K, float *out, int64_t M, int64_t N, int64_t A,
                   int64_t B, int nthreads) {
    const events_otf_fn run = EVENTS_OTFS[code];
    const resp_t R = resp_of(p, table, K);
#pragma omp parallel num_threads(nthreads)
    {
        int32_t *ev = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B > 0 ? B : 1));
        float *buf = thread_buffer(A);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M * N; r++) {
            const int64_t n = r % N;
            float *o = out + r * A;
            memset(o, 0, sizeof(float) * (size_t)A);
            const int64_t E = row_events(packed + r * nbytes, nbytes, big, B, ev);
            run(ev, E, x, c + n * A, first + n * A, last + n * A, &R, o, A, buf);
        }
        free(ev);
        free(buf);
    }
}

/* On a lattice: x evenly spaced, x[b] = x0 + b dx, and each row's sorted coarse points a whole
 * number `step` of fine points apart, c[a] = c0 + a step dx. The offset c[a] - x[b] is then
 * c0 - x0 + (a step - b) dx: with b = q step + s (0 <= s < step), a function of s and
 * j = a - q alone, so the response is tabulated once per geometry, table[s][j - jmin]
 * (step x J float32; one table per distinct c0, tid (N,) picks a row's). Each event adds one
 * contiguous run of its phase's row to the outputs: no response evaluated, one vector add
 * per event. q and s follow the events (increasing b): a division only where an event moves
 * to another coarse step. The coarse points an event reaches are its windows' [lo, hi)
 * (walk: the windows found from the exact offsets, which a rounding may tip at a tie), or,
 * where the caller found those windows to be the lattice's own and zeroed the tables outside
 * them ("baked"), the whole run j in [jmin, jmin + J), the same for every event of one coarse
 * step q. Baked, the events of one step are summed a chunk of the run at a time in vector
 * registers (each event: one load and one add per vector), then the chunk is added to the
 * outputs once. Rows of the tables are J floats padded with zeros to a multiple of 16 (whole
 * vectors, aligned rows): a padding zero lands on an output as a harmless + 0.
 * The caller checked that every (a, b) reached falls inside the table. */
INLINE void lattice_step(const int64_t b, const int64_t step, int64_t *prev, int64_t *q,
                         int64_t *s) {
    *s += b - *prev;
    *prev = b;
    if (*s >= step) {
        const int64_t t = *s / step;
        *q += t;
        *s -= t * step;
    }
}

static void lattice_walk(const int32_t *ev, int64_t E, const float *T, int64_t step, int64_t J,
                         int64_t jmin, const int64_t *fi, const int64_t *la, float *restrict o,
                         int64_t A, int32_t *ph, int32_t *qs) {
    (void)ph;
    (void)qs;
    int64_t lo = 0, hi = 0, q = 0, s = 0, prev = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t b = ev[e];
        lattice_step(b, step, &prev, &q, &s);
        while (hi < A && fi[hi] <= b) hi++;
        while (lo < hi && la[lo] <= b) lo++;
        const int64_t len = hi - lo;
        const float *restrict v = T + s * J + (lo - q - jmin);
        float *restrict dst = o + lo;
#pragma omp simd
        for (int64_t j = 0; j < len; j++) dst[j] += v[j];
    }
}

#define LATTICE_CHUNK 4 /* vectors summed in registers per pass over a step's events */

/* acc[k] = sum over the events [e0, e1) of their rows' vectors k of the chunk at j0 (nv of
 * them: a constant where called, so the unused accumulators vanish). */
INLINE void lattice_sum(const int nv, const float *T, const int32_t *ph, int64_t e0, int64_t e1,
                        int64_t j0, vf *acc) {
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t e = e0; e < e1; e++) {
        const float *v = T + ph[e] + j0;
        a0 += *(const vfu *)v;
        if (nv > 1) a1 += *(const vfu *)(v + VL);
        if (nv > 2) a2 += *(const vfu *)(v + 2 * VL);
        if (nv > 3) a3 += *(const vfu *)(v + 3 * VL);
    }
    acc[0] = a0;
    acc[1] = a1;
    acc[2] = a2;
    acc[3] = a3;
}

static void lattice_baked(const int32_t *ev, int64_t E, const float *T, int64_t step, int64_t J,
                          int64_t jmin, const int64_t *fi, const int64_t *la, float *restrict o,
                          int64_t A, int32_t *ph, int32_t *qs) {
    (void)fi;
    (void)la;
    int64_t q = 0, s = 0, prev = 0;
    for (int64_t e = 0; e < E; e++) { /* each event's step and its row's offset */
        lattice_step(ev[e], step, &prev, &q, &s);
        qs[e] = (int32_t)q;
        ph[e] = (int32_t)(s * J);
    }
    for (int64_t e0 = 0, e1; e0 < E; e0 = e1) {
        for (e1 = e0 + 1; e1 < E && qs[e1] == qs[e0];) e1++;
        const int64_t base = qs[e0] + jmin; /* the output of j = jmin */
        for (int64_t j0 = 0; j0 < J; j0 += LATTICE_CHUNK * VL) {
            const int64_t left = (J - j0) / VL;
            const int nv = left < LATTICE_CHUNK ? (int)left : LATTICE_CHUNK;
            vf acc[LATTICE_CHUNK];
            switch (nv) {
            case 1: lattice_sum(1, T, ph, e0, e1, j0, acc); break;
            case 2: lattice_sum(2, T, ph, e0, e1, j0, acc); break;
            case 3: lattice_sum(3, T, ph, e0, e1, j0, acc); break;
            default: lattice_sum(4, T, ph, e0, e1, j0, acc); break;
            }
            const int64_t at = base + j0;
            if (at >= 0 && at + nv * VL <= A) {
                for (int k = 0; k < nv; k++) *(vfu *)(o + at + k * VL) += acc[k];
            } else { /* a step near either end: the outputs inside [0, A) */
                const float *sum = (const float *)acc;
                for (int64_t l = 0; l < nv * VL; l++)
                    if (at + l >= 0 && at + l < A) o[at + l] += sum[l];
            }
        }
    }
}

void bs_events_lattice(const uint8_t *packed, int64_t nbytes, int big, const float *tables,
                       const int64_t *tid, int64_t step, int64_t J, int64_t jmin, int walk,
                       const int64_t *first, const int64_t *last, float *out, int64_t M,
                       int64_t N, int64_t A, int64_t B, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        const size_t cap = (size_t)(B > 0 ? B : 1);
        int32_t *ev = (int32_t *)malloc(sizeof(int32_t) * 3 * cap), *ph = ev + cap, *qs = ph + cap;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M * N; r++) {
            const int64_t n = r % N;
            float *o = out + r * A;
            memset(o, 0, sizeof(float) * (size_t)A);
            const int64_t E = row_events(packed + r * nbytes, nbytes, big, B, ev);
            const float *T = tables + tid[n] * step * J;
            (walk ? lattice_walk : lattice_baked)(ev, E, T, step, J, jmin, first + n * A,
                                                  last + n * A, o, A, ph, qs);
        }
        free(ev);
    }
}

/* Prefix sums of a piecewise polynomial response, r(d) = sum_j coef[k][j] d^j on piece k.
 * Piece k of coarse point a covers the fine points [bound[k + 1][a], bound[k][a]) (P + 1
 * bounds per coarse point, each non-decreasing in a). Per piece, a sliding window over the
 * row's events keeps T_j = sum (c[a] - x[b])^j over the events inside, j <= 2: moving to the
 * next coarse point re-centres the sums on it (T2 += 2 delta T1 + delta^2 T0, T1 += delta T0),
 * then adds the events entering and removes those leaving, so every number stays of the
 * window's size (no prefix sums over the whole row to cancel) and an empty window restarts
 * from exact zeros. Cost per row: the events times P, plus A times P. */
#define PREFIX_MAX_PIECES 8
void bs_prefix(const uint8_t *packed, int64_t nbytes, int big, const double *x, const double *c,
               const int64_t *bounds, const double *coef, int64_t P, float *out, int64_t M,
               int64_t N, int64_t A, int64_t B, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int32_t *ev = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B > 0 ? B : 1));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M * N; r++) {
            const int64_t n = r % N;
            const double *cn = c + n * A;
            float *o = out + r * A;
            const int64_t E = row_events(packed + r * nbytes, nbytes, big, B, ev);
            int64_t in_lo[PREFIX_MAX_PIECES] = {0}, in_hi[PREFIX_MAX_PIECES] = {0};
            double T[PREFIX_MAX_PIECES][3] = {{0}};
            double prev = A > 0 ? cn[0] : 0.0;
            for (int64_t a = 0; a < A; a++) {
                const double ca = cn[a], delta = ca - prev;
                prev = ca;
                double acc = 0.0;
                for (int64_t k = 0; k < P; k++) {
                    double *t = T[k];
                    t[2] += 2.0 * delta * t[1] + delta * delta * t[0];
                    t[1] += delta * t[0];
                    /* piece k: fine points [bounds[(k + 1) A + a], bounds[k A + a]) */
                    const int64_t b_lo = bounds[((k + 1) * N + n) * A + a];
                    const int64_t b_hi = bounds[(k * N + n) * A + a];
                    while (in_lo[k] < in_hi[k] && ev[in_lo[k]] < b_lo) {
                        const double d = ca - x[ev[in_lo[k]++]];
                        t[0] -= 1.0;
                        t[1] -= d;
                        t[2] -= d * d;
                    }
                    if (in_lo[k] == in_hi[k]) { /* empty: restart exactly, past b_lo */
                        t[0] = t[1] = t[2] = 0.0;
                        while (in_hi[k] < E && ev[in_hi[k]] < b_lo) in_hi[k]++;
                        in_lo[k] = in_hi[k];
                    }
                    while (in_hi[k] < E && ev[in_hi[k]] < b_hi) {
                        const double d = ca - x[ev[in_hi[k]++]];
                        t[0] += 1.0;
                        t[1] += d;
                        t[2] += d * d;
                    }
                    const double *q = coef + k * 3;
                    acc += q[0] * t[0] + q[1] * t[1] + q[2] * t[2];
                }
                o[a] = (float)acc;
            }
        }
        free(ev);
    }
}
