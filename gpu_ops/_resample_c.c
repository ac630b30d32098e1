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
 * Each public entry point dispatches on wdt to an always-inlined body with wdt a constant,
 * so the compiler emits one specialised loop per weight dtype.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* 16 floats: one AVX-512 register, two AVX2 ones (GCC/Clang vector extensions). */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u16v __attribute__((vector_size(64)));

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

/* Weights i .. i + 15 widened to float32. */
INLINE v16 wload16(const void *w, const int wdt, int64_t i) {
    if (wdt == 0) return *(const v16u *)((const float *)w + i);
    if (wdt == 1) {
        const h16u h = *(const h16u *)((const uint16_t *)w + i);
        const u16v u = __builtin_convertvector(h, u16v) << 16;
        v16 x;
        memcpy(&x, &u, sizeof x);
        return x;
    }
    v16 x;
    for (int t = 0; t < 16; t++) x[t] = (float)((const _Float16 *)w)[i + t];
    return x;
}

/* --- forward: one dot product per (coarse point, input), MB inputs per weight load ------- */

INLINE float hsum(v16 v) {
    float t = 0.f;
    for (int i = 0; i < 16; i++) t += v[i];
    return t;
}

/* out[k * ostride] = sum_j w[row + j] * fr[k * fstride + j] for k < mb: one coarse point,
 * mb inputs sharing each weight load, two vectors per input for ILP. */
INLINE void dot_mb(const float *fr, int64_t fstride, const void *w, const int wdt, int64_t row,
                   int64_t W, float *out, int64_t ostride, const int mb) {
    v16 acc[4][2];
    for (int k = 0; k < mb; k++) acc[k][0] = acc[k][1] = (v16){0};
    int64_t j = 0;
    for (; j + 32 <= W; j += 32) {
        const v16 w0 = wload16(w, wdt, row + j), w1 = wload16(w, wdt, row + j + 16);
        for (int k = 0; k < mb; k++) {
            acc[k][0] += w0 * *(const v16u *)(fr + k * fstride + j);
            acc[k][1] += w1 * *(const v16u *)(fr + k * fstride + j + 16);
        }
    }
    for (int k = 0; k < mb; k++) {
        float t = hsum(acc[k][0] + acc[k][1]);
        for (int64_t i = j; i < W; i++) t += wload(w, wdt, row + i) * fr[k * fstride + i];
        out[k * ostride] = t;
    }
}

INLINE void forward_body(const float *f, const void *w, const int wdt, const int32_t *starts,
                         float *out, int64_t M, int64_t N, int64_t A, int64_t B, int64_t W,
                         int nthreads) {
    /* Half-precision weights with many inputs: widen each row once into an L1 buffer rather
     * than once per input block (measured faster at M = 64; fused is as fast at M <= 4). */
    const int widen = wdt != 0 && M > 4;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = widen ? (float *)malloc(sizeof(float) * (size_t)W) : NULL;
#pragma omp for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t a = 0; a < A; a++) {
                const int64_t s = starts[n * A + a], row = (n * A + a) * W;
                const float *fr = f + n * B + s;
                float *o = out + n * A + a;
                const int64_t fs = N * B, os = N * A;
                int64_t m = 0;
                if (buf != NULL) {
                    for (int64_t j = 0; j < W; j++) buf[j] = wload(w, wdt, row + j);
                    for (; m + 4 <= M; m += 4) dot_mb(fr + m * fs, fs, buf, 0, 0, W, o + m * os, os, 4);
                    for (; m < M; m++) dot_mb(fr + m * fs, fs, buf, 0, 0, W, o + m * os, os, 1);
                } else {
                    for (; m + 4 <= M; m += 4) dot_mb(fr + m * fs, fs, w, wdt, row, W, o + m * os, os, 4);
                    for (; m < M; m++) dot_mb(fr + m * fs, fs, w, wdt, row, W, o + m * os, os, 1);
                }
            }
        }
        free(buf);
    }
}

void bs_forward(const float *f, const void *w, int wdt, const int32_t *starts, float *out,
                int64_t M, int64_t N, int64_t A, int64_t B, int64_t W, int nthreads) {
    if (wdt == 0) forward_body(f, w, 0, starts, out, M, N, A, B, W, nthreads);
    else if (wdt == 1) forward_body(f, w, 1, starts, out, M, N, A, B, W, nthreads);
    else forward_body(f, w, 2, starts, out, M, N, A, B, W, nthreads);
}

/* --- grad_f, any start order: scan every window per block of fine points ---------------- */

INLINE void backward_f_scan_body(const float *g, const void *w, const int wdt,
                                 const int32_t *starts, float *gf, int64_t M, int64_t N,
                                 int64_t A, int64_t B, int64_t W, int64_t BB, int nthreads) {
    const int64_t nblk = (B + BB - 1) / BB;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t k = 0; k < nblk; k++) {
            const int64_t b0 = k * BB, b1 = b0 + BB < B ? b0 + BB : B;
            for (int64_t m = 0; m < M; m++)
                memset(gf + (m * N + n) * B + b0, 0, sizeof(float) * (size_t)(b1 - b0));
            for (int64_t a = 0; a < A; a++) {
                const int64_t s = starts[n * A + a];
                const int64_t lo = s > b0 ? s : b0, hi = s + W < b1 ? s + W : b1;
                if (lo >= hi) continue;
                const int64_t row = (n * A + a) * W - s;
                for (int64_t m = 0; m < M; m++) {
                    const float gm = g[(m * N + n) * A + a];
                    float *dst = gf + (m * N + n) * B;
#pragma omp simd
                    for (int64_t j = lo; j < hi; j++) dst[j] += gm * wload(w, wdt, row + j);
                }
            }
        }
    }
}

void bs_backward_f(const float *g, const void *w, int wdt, const int32_t *starts, float *gf,
                   int64_t M, int64_t N, int64_t A, int64_t B, int64_t W, int64_t BB,
                   int nthreads) {
    if (wdt == 0) backward_f_scan_body(g, w, 0, starts, gf, M, N, A, B, W, BB, nthreads);
    else if (wdt == 1) backward_f_scan_body(g, w, 1, starts, gf, M, N, A, B, W, BB, nthreads);
    else backward_f_scan_body(g, w, 2, starts, gf, M, N, A, B, W, BB, nthreads);
}

/* --- grad_f, starts sorted along each row: register-blocked transposed band ------------- *
 * A tile of TB fine points is reached by one contiguous range of coarse points (sorted
 * starts). For MB inputs at a time the tile's MB x TB sums live in registers; each coarse
 * point adds g[m, a] * its weights to them, so a weight is loaded once per MB inputs, and
 * the tile's weights stay in L1 across the input blocks. */

#define TB 32 /* fine points per tile: two 16-float vectors */
#define SB 512 /* fine points per task */

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
    v16 acc[8][2];
    for (int k = 0; k < mb; k++) acc[k][0] = acc[k][1] = (v16){0};
    const float *gk = g + (m0 * N + n) * A;
    for (int64_t a = a_lo; a < a_hi; a++) {
        const int64_t sa = s[a];
        const int64_t row = (n * A + a) * W + (t0 - sa); /* weight index of tile point 0 */
        v16 w0, w1;
        if (tw == TB && sa <= t0 && sa + W >= t0 + TB) {
            w0 = wload16(w, wdt, row);
            w1 = wload16(w, wdt, row + 16);
        } else { /* the window ends or starts inside the tile: zeros outside it */
            const int64_t lo = sa > t0 ? sa - t0 : 0;
            const int64_t hi = sa + W < t0 + tw ? sa + W - t0 : tw;
            float tmp[TB] = {0};
            for (int64_t t = lo; t < hi; t++) tmp[t] = wload(w, wdt, row + t);
            memcpy(&w0, tmp, sizeof w0);
            memcpy(&w1, tmp + 16, sizeof w1);
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
            *(v16u *)dst = acc[k][0];
            *(v16u *)(dst + 16) = acc[k][1];
        } else {
            float tmp[TB];
            memcpy(tmp, &acc[k][0], sizeof(v16));
            memcpy(tmp + 16, &acc[k][1], sizeof(v16));
            memcpy(dst, tmp, sizeof(float) * (size_t)tw);
        }
    }
}

INLINE void backward_f_sorted_body(const float *g, const void *w, const int wdt,
                                   const int32_t *starts, float *gf, int64_t M, int64_t N,
                                   int64_t A, int64_t B, int64_t W, int nthreads) {
    const int64_t nblk = (B + SB - 1) / SB;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t k = 0; k < nblk; k++) {
            const int32_t *s = starts + n * A;
            const int64_t b0 = k * SB, b1 = b0 + SB < B ? b0 + SB : B;
            for (int64_t t0 = b0; t0 < b1; t0 += TB) {
                const int64_t tw = t0 + TB < b1 ? TB : b1 - t0;
                /* windows [s, s + W) that reach [t0, t0 + tw): s + W > t0 and s < t0 + tw */
                const int64_t a_lo = upper(s, 0, A, W, t0);
                const int64_t a_hi = upper(s, a_lo, A, 0, t0 + tw - 1);
                int64_t m = 0;
                for (; m + 8 <= M; m += 8)
                    tile_mb(g, w, wdt, s, gf, 8, m, n, N, A, B, W, t0, tw, a_lo, a_hi);
                for (; m + 4 <= M; m += 4)
                    tile_mb(g, w, wdt, s, gf, 4, m, n, N, A, B, W, t0, tw, a_lo, a_hi);
                for (; m < M; m++)
                    tile_mb(g, w, wdt, s, gf, 1, m, n, N, A, B, W, t0, tw, a_lo, a_hi);
            }
        }
    }
}

void bs_backward_f_sorted(const float *g, const void *w, int wdt, const int32_t *starts,
                          float *gf, int64_t M, int64_t N, int64_t A, int64_t B, int64_t W,
                          int nthreads) {
    if (wdt == 0) backward_f_sorted_body(g, w, 0, starts, gf, M, N, A, B, W, nthreads);
    else if (wdt == 1) backward_f_sorted_body(g, w, 1, starts, gf, M, N, A, B, W, nthreads);
    else backward_f_sorted_body(g, w, 2, starts, gf, M, N, A, B, W, nthreads);
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
