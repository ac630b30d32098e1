/* CPU kernels of the banded response operator (gpu_ops/resample.py).
 *
 * Layouts (all contiguous, row-major):
 *   f      (M, N, B) float32      fine-grid inputs
 *   w      (N, A, W) float32 / bfloat16 / float16 (wdt = 0 / 1 / 2)
 *   starts (N, A)    int32        window starts, 0 <= starts <= B - W, in any order
 *   out    (M, N, A) float32
 * Every output element is written by exactly one thread in a fixed order: no atomics, and
 * the results do not depend on the thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Widen weights [lo, hi) of one row to float32; a float32 row is used in place. */
static const float *row_f32(const void *w, int wdt, int64_t row, int64_t W, int64_t lo,
                            int64_t hi, float *buf) {
    if (wdt == 0) return (const float *)w + row * W;
    const uint16_t *src = (const uint16_t *)w + row * W;
    if (wdt == 1) {
        uint32_t *dst = (uint32_t *)buf; /* bfloat16 is the top half of a float32 */
        for (int64_t j = lo; j < hi; j++) dst[j] = ((uint32_t)src[j]) << 16;
    } else {
        const _Float16 *h = (const _Float16 *)src;
        for (int64_t j = lo; j < hi; j++) buf[j] = (float)h[j];
    }
    return buf;
}

void bs_forward(const float *f, const void *w, int wdt, const int32_t *starts, float *out,
                int64_t M, int64_t N, int64_t A, int64_t B, int64_t W, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = wdt == 0 ? NULL : (float *)malloc(sizeof(float) * (size_t)(W > 0 ? W : 1));
#pragma omp for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t a = 0; a < A; a++) {
                const float *wr = row_f32(w, wdt, n * A + a, W, 0, W, buf);
                const int64_t s = starts[n * A + a];
                int64_t m = 0;
                /* Four inputs at a time share each weight load. */
                for (; m + 4 <= M; m += 4) {
                    const float *f0 = f + (m * N + n) * B + s;
                    const float *f1 = f0 + N * B, *f2 = f1 + N * B, *f3 = f2 + N * B;
                    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                    for (int64_t j = 0; j < W; j++) {
                        const float wj = wr[j];
                        a0 += wj * f0[j];
                        a1 += wj * f1[j];
                        a2 += wj * f2[j];
                        a3 += wj * f3[j];
                    }
                    out[(m * N + n) * A + a] = a0;
                    out[((m + 1) * N + n) * A + a] = a1;
                    out[((m + 2) * N + n) * A + a] = a2;
                    out[((m + 3) * N + n) * A + a] = a3;
                }
                for (; m < M; m++) {
                    const float *f0 = f + (m * N + n) * B + s;
                    float a0 = 0.f;
#pragma omp simd reduction(+ : a0)
                    for (int64_t j = 0; j < W; j++) a0 += wr[j] * f0[j];
                    out[(m * N + n) * A + a] = a0;
                }
            }
        }
        free(buf);
    }
}

/* grad_f = the transposed band applied to g (M, N, A). Each thread owns a block of fine
 * points of one function and adds the overlapping windows in coarse-point order, so the
 * starts need not be sorted. */
void bs_backward_f(const float *g, const void *w, int wdt, const int32_t *starts, float *gf,
                   int64_t M, int64_t N, int64_t A, int64_t B, int64_t W, int64_t BB,
                   int nthreads) {
    const int64_t nblk = (B + BB - 1) / BB;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = wdt == 0 ? NULL : (float *)malloc(sizeof(float) * (size_t)(W > 0 ? W : 1));
#pragma omp for collapse(2) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t k = 0; k < nblk; k++) {
                const int64_t b0 = k * BB, b1 = b0 + BB < B ? b0 + BB : B;
                for (int64_t m = 0; m < M; m++)
                    memset(gf + (m * N + n) * B + b0, 0, sizeof(float) * (size_t)(b1 - b0));
                for (int64_t a = 0; a < A; a++) {
                    const int64_t s = starts[n * A + a];
                    const int64_t lo = s > b0 ? s : b0, hi = s + W < b1 ? s + W : b1;
                    if (lo >= hi) continue;
                    const float *wr = row_f32(w, wdt, n * A + a, W, lo - s, hi - s, buf) - s;
                    for (int64_t m = 0; m < M; m++) {
                        const float gm = g[(m * N + n) * A + a];
                        float *dst = gf + (m * N + n) * B;
#pragma omp simd
                        for (int64_t j = lo; j < hi; j++) dst[j] += gm * wr[j];
                    }
                }
            }
        }
        free(buf);
    }
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
