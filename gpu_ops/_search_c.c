/* CPU kernels of the search ops (bound in gpu_ops/_search_c.py): popcounts, Hamming top-k,
 * Tanimoto top-k and Tanimoto threshold search on packed rows, never unpacked.
 *
 * Layouts: queries (Q, W) and corpus (N, W) uint8, bytes of a row contiguous, rows `qrs` /
 * `crs` bytes apart; popcounts (N,) int32; ids (N,) int64 or NULL (row numbers), < 2**31.
 *
 * Popcount paths, chosen per call (`path`, gpu_ops/_search_c.py picks it from the CPU's
 * features or BITSERVE_POPCOUNT_PATH):
 *   0 portable  64-bit words, a SWAR bit count (any CPU, any compiler)
 *   1 popcnt    64-bit words, the POPCNT instruction
 *   2 avx2      32-byte vectors, the nibble-table (pshufb) count summed by vpsadbw, the rest
 *               of the row by POPCNT words
 *   3 avx512    64-byte vectors, VPOPCNTQ; the row's tail by a masked load
 * Each path is one function per operation (AND for Tanimoto, XOR for Hamming, AND with an
 * all-ones row for plain popcounts) counting one query against a run of corpus rows.
 *
 * Order: every pair gets one 64-bit key, smaller = better, that orders pairs exactly as the
 * ops promise (best score first, ties by the lower id):
 *   hamming:  distance << 32 | id
 *   tanimoto: (bits(+inf) - bits(similarity)) << 32 | id   (float32 bits; similarity >= 0)
 * Each thread keeps, per query of a block, a max-heap of its k smallest keys; the heaps are
 * merged at the end, so the top k do not depend on the number of threads or the order tiles
 * were scanned in.
 *
 * Similarity: (float)((double)c / (double)(a + b - c)), 0 when a + b - c = 0, in every path
 * and in the references; compared with the threshold as float32. The popcount bound
 * (float)((double)min(a, b) / max(a, b)) is >= every similarity of a pair with those
 * popcounts (division and rounding are monotone), so skipping a row whose bound is below
 * the threshold or below the k-th best similarity (strictly) never drops a result.
 *
 * Tiling: the corpus is cut into tiles of about 16 KiB; the queries into blocks (64, fewer
 * when k is large). Each tile is read once per block, from the cache for every query of
 * the block. For Tanimoto the queries are sorted by popcount first, so a block's queries
 * have similar popcounts, and the tiles are visited outward from the tile of the block's
 * median popcount when the corpus is in popcount order, so the k-th best scores rise fast
 * and the bound prunes both sides.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BS_X86 1
#endif

#define INLINE static inline __attribute__((always_inline))
#define TILE_BYTES 16384
#define QBLOCK 64
#define HEAP_BUDGET (1 << 20) /* keys per thread's heaps: caps the query block when k is big */
#define INF_BITS 0x7F800000u
#define NO_KEY UINT64_MAX

typedef void (*count_fn)(const uint8_t *q, const uint8_t *rows, int64_t crs, int64_t n,
                         int64_t W, int32_t *out);

INLINE uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

INLINE uint64_t load_tail(const uint8_t *p, int64_t n) {
    uint64_t v = 0;
    memcpy(&v, p, (size_t)n);
    return v;
}

INLINE int pc_swar(uint64_t x) {
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return (int)((x * 0x0101010101010101ULL) >> 56);
}

#define OP_AND(a, b) ((a) & (b))
#define OP_XOR(a, b) ((a) ^ (b))

/* --- scalar paths: 64-bit words, four sums in flight ------------------------------------ */

#define SCALAR_COUNT(NAME, ATTR, PC, OP)                                                      \
    ATTR static void NAME(const uint8_t *q, const uint8_t *rows, int64_t crs, int64_t n,      \
                          int64_t W, int32_t *out) {                                          \
        const int64_t nw = W / 8, tail = W % 8;                                               \
        const uint64_t qt = tail ? load_tail(q + 8 * nw, tail) : 0;                           \
        for (int64_t i = 0; i < n; i++) {                                                     \
            const uint8_t *r = rows + i * crs;                                                \
            int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, w = 0;                                    \
            for (; w + 4 <= nw; w += 4) {                                                     \
                s0 += PC(OP(load64(q + 8 * w), load64(r + 8 * w)));                           \
                s1 += PC(OP(load64(q + 8 * w + 8), load64(r + 8 * w + 8)));                   \
                s2 += PC(OP(load64(q + 8 * w + 16), load64(r + 8 * w + 16)));                 \
                s3 += PC(OP(load64(q + 8 * w + 24), load64(r + 8 * w + 24)));                 \
            }                                                                                 \
            for (; w < nw; w++) s0 += PC(OP(load64(q + 8 * w), load64(r + 8 * w)));           \
            if (tail) s0 += PC(OP(qt, load_tail(r + 8 * nw, tail)));                          \
            out[i] = (int32_t)(s0 + s1 + s2 + s3);                                            \
        }                                                                                     \
    }

SCALAR_COUNT(and_portable, , pc_swar, OP_AND)
SCALAR_COUNT(xor_portable, , pc_swar, OP_XOR)

#ifdef BS_X86
#define ATTR_POPCNT __attribute__((target("popcnt")))
SCALAR_COUNT(and_popcnt, ATTR_POPCNT, __builtin_popcountll, OP_AND)
SCALAR_COUNT(xor_popcnt, ATTR_POPCNT, __builtin_popcountll, OP_XOR)

/* --- AVX2: nibble-table counts per byte, summed by vpsadbw ------------------------------- */

#define ATTR_AVX2 __attribute__((target("avx2,popcnt")))

ATTR_AVX2 static inline __m256i bytes_pc(__m256i v, __m256i lut, __m256i low) {
    const __m256i lo = _mm256_and_si256(v, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    return _mm256_add_epi8(_mm256_shuffle_epi8(lut, lo), _mm256_shuffle_epi8(lut, hi));
}

ATTR_AVX2 static inline int64_t hsum64(__m256i v) {
    const __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return _mm_cvtsi128_si64(_mm_add_epi64(s, _mm_unpackhi_epi64(s, s)));
}

/* The per-lane sums (vpsadbw) of one row's popcounts over nv 32-byte chunks. Byte counters
 * hold at most 8 per chunk: flushed to 64-bit sums every 31 chunks. */
#define AVX2_ROW(NAME, VOP)                                                                   \
    ATTR_AVX2 INLINE __m256i NAME(const uint8_t *q, const uint8_t *r, int64_t nv,            \
                                  __m256i lut, __m256i low) {                                 \
        const __m256i zero = _mm256_setzero_si256();                                          \
        __m256i sums = zero;                                                                  \
        for (int64_t v0 = 0; v0 < nv; v0 += 31) {                                             \
            const int64_t v1 = v0 + 31 < nv ? v0 + 31 : nv;                                   \
            __m256i acc = zero;                                                               \
            for (int64_t v = v0; v < v1; v++) {                                               \
                const __m256i a = _mm256_loadu_si256((const __m256i *)(q + 32 * v));          \
                const __m256i b = _mm256_loadu_si256((const __m256i *)(r + 32 * v));          \
                acc = _mm256_add_epi8(acc, bytes_pc(VOP(a, b), lut, low));                    \
            }                                                                                 \
            sums = _mm256_add_epi64(sums, _mm256_sad_epu8(acc, zero));                        \
        }                                                                                     \
        return sums;                                                                          \
    }

/* Four rows' lane sums (each total < 2**32) to four int32 totals in one vector. */
ATTR_AVX2 INLINE __m128i hsum4(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
    const __m256i x = _mm256_or_si256(s0, _mm256_slli_epi64(s1, 32));
    const __m256i y = _mm256_or_si256(s2, _mm256_slli_epi64(s3, 32));
    const __m256i z = _mm256_add_epi64(_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y));
    return _mm_add_epi64(_mm256_castsi256_si128(z), _mm256_extracti128_si256(z, 1));
}

/* Rows of nv whole chunks plus (W % 32) / 8 words and W % 8 tail bytes (POPCNT), four rows
 * at a time. Always inlined into the callers below with nv a constant for the common widths
 * (128 and 256 bytes), so the chunk loops unroll and the query stays in registers. */
#define AVX2_BODY(NAME, ROW, OP)                                                              \
    ATTR_AVX2 INLINE void NAME(const uint8_t *q, const uint8_t *rows, int64_t crs, int64_t n, \
                               int64_t W, int64_t nv, int32_t *out) {                         \
        const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4,  \
                                             0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4); \
        const __m256i low = _mm256_set1_epi8(0x0F);                                           \
        const int64_t nw = (W - 32 * nv) / 8, tail = W % 8;                                   \
        const uint8_t *qw = q + 32 * nv;                                                      \
        const uint64_t qt = tail ? load_tail(qw + 8 * nw, tail) : 0;                          \
        int64_t i = 0;                                                                        \
        for (; i + 4 <= n; i += 4) {                                                          \
            const uint8_t *r = rows + i * crs;                                                \
            const __m128i t = hsum4(ROW(q, r, nv, lut, low), ROW(q, r + crs, nv, lut, low),   \
                                    ROW(q, r + 2 * crs, nv, lut, low),                        \
                                    ROW(q, r + 3 * crs, nv, lut, low));                       \
            _mm_storeu_si128((__m128i *)(out + i), t);                                        \
        }                                                                                     \
        for (; i < n; i++) out[i] = (int32_t)hsum64(ROW(q, rows + i * crs, nv, lut, low));    \
        if (nw == 0 && tail == 0) return;                                                     \
        for (i = 0; i < n; i++) {                                                             \
            const uint8_t *rw = rows + i * crs + 32 * nv;                                     \
            int64_t s = 0;                                                                    \
            for (int64_t w = 0; w < nw; w++)                                                  \
                s += __builtin_popcountll(OP(load64(qw + 8 * w), load64(rw + 8 * w)));        \
            if (tail) s += __builtin_popcountll(OP(qt, load_tail(rw + 8 * nw, tail)));        \
            out[i] += (int32_t)s;                                                             \
        }                                                                                     \
    }

#define AVX2_COUNT(NAME, VOP, OP)                                                             \
    AVX2_ROW(NAME##_row, VOP)                                                                 \
    AVX2_BODY(NAME##_body, NAME##_row, OP)                                                    \
    ATTR_AVX2 static void NAME(const uint8_t *q, const uint8_t *rows, int64_t crs, int64_t n, \
                               int64_t W, int32_t *out) {                                     \
        if (W == 128) NAME##_body(q, rows, crs, n, 128, 4, out);                              \
        else if (W == 256) NAME##_body(q, rows, crs, n, 256, 8, out);                         \
        else NAME##_body(q, rows, crs, n, W, W / 32, out);                                    \
    }

AVX2_COUNT(and_avx2, _mm256_and_si256, OP_AND)
AVX2_COUNT(xor_avx2, _mm256_xor_si256, OP_XOR)

/* --- AVX-512 VPOPCNTDQ: 64-byte vectors, a masked load for the tail ---------------------- */

#define ATTR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vpopcntdq,popcnt")))

#define AVX512_COUNT(NAME, VOP)                                                               \
    ATTR_AVX512 static void NAME(const uint8_t *q, const uint8_t *rows, int64_t crs,          \
                                 int64_t n, int64_t W, int32_t *out) {                        \
        const int64_t nv = W / 64, rem = W % 64;                                              \
        const __mmask64 m = rem ? (~0ULL >> (64 - rem)) : 0;                                  \
        const __m512i qt = _mm512_maskz_loadu_epi8(m, q + 64 * nv);                           \
        for (int64_t i = 0; i < n; i++) {                                                     \
            const uint8_t *r = rows + i * crs;                                                \
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();                 \
            int64_t v = 0;                                                                    \
            for (; v + 2 <= nv; v += 2) {                                                     \
                s0 = _mm512_add_epi64(s0, _mm512_popcnt_epi64(VOP(                            \
                    _mm512_loadu_si512(q + 64 * v), _mm512_loadu_si512(r + 64 * v))));        \
                s1 = _mm512_add_epi64(s1, _mm512_popcnt_epi64(VOP(                            \
                    _mm512_loadu_si512(q + 64 * v + 64), _mm512_loadu_si512(r + 64 * v + 64)))); \
            }                                                                                 \
            if (v < nv)                                                                       \
                s0 = _mm512_add_epi64(s0, _mm512_popcnt_epi64(VOP(                            \
                    _mm512_loadu_si512(q + 64 * v), _mm512_loadu_si512(r + 64 * v))));        \
            if (rem)                                                                          \
                s1 = _mm512_add_epi64(s1, _mm512_popcnt_epi64(VOP(                            \
                    qt, _mm512_maskz_loadu_epi8(m, r + 64 * nv))));                           \
            out[i] = (int32_t)_mm512_reduce_add_epi64(_mm512_add_epi64(s0, s1));              \
        }                                                                                     \
    }

AVX512_COUNT(and_avx512, _mm512_and_si512)
AVX512_COUNT(xor_avx512, _mm512_xor_si512)
#endif /* BS_X86 */

/* Whether this CPU can run `path`. */
int bs_path_supported(int path) {
    if (path == 0) return 1;
#ifdef BS_X86
    __builtin_cpu_init();
    if (path == 1) return __builtin_cpu_supports("popcnt");
    if (path == 2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    if (path == 3)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vpopcntdq") && __builtin_cpu_supports("popcnt");
#endif
    return 0;
}

static count_fn count_for(int path, int xor_op) {
#ifdef BS_X86
    switch (path) {
        case 1: return xor_op ? xor_popcnt : and_popcnt;
        case 2: return xor_op ? xor_avx2 : and_avx2;
        case 3: return xor_op ? xor_avx512 : and_avx512;
        default: break;
    }
#endif
    (void)path;
    return xor_op ? xor_portable : and_portable;
}

static int64_t tile_rows_for(int64_t W) {
    int64_t t = TILE_BYTES / W;
    return t < 16 ? 16 : t;
}

/* --- popcounts ----------------------------------------------------------------------------- */

void bs_popcount(const uint8_t *x, int64_t R, int64_t rs, int64_t W, int32_t *out, int path,
                 int nthreads) {
    uint8_t *ones = malloc((size_t)W);
    if (!ones) return;
    memset(ones, 0xFF, (size_t)W);
    const count_fn count = count_for(path, 0);
    const int64_t T = tile_rows_for(W), ntiles = (R + T - 1) / T;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t r0 = t * T, n = R - r0 < T ? R - r0 : T;
        count(ones, x + r0 * rs, rs, n, W, out + r0);
    }
    free(ones);
}

/* --- bounded heaps of keys ------------------------------------------------------------------ */

/* Max-heap of at most k keys (the root is the worst kept). */
INLINE void heap_push(uint64_t *h, int64_t *size, int64_t k, uint64_t key) {
    int64_t i;
    if (*size < k) {
        i = (*size)++;
        while (i > 0) {
            const int64_t p = (i - 1) / 2;
            if (h[p] >= key) break;
            h[i] = h[p];
            i = p;
        }
        h[i] = key;
        return;
    }
    if (key >= h[0]) return;
    i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= k) break;
        if (c + 1 < k && h[c + 1] > h[c]) c++;
        if (h[c] <= key) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = key;
}

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

INLINE uint64_t row_id(const int64_t *ids, int64_t row) {
    return (uint64_t)(ids ? ids[row] : row);
}

INLINE uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

INLINE float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE float similarity(int64_t c, int64_t a, int64_t b) {
    const int64_t u = a + b - c;
    return u > 0 ? (float)((double)c / (double)u) : 0.0f;
}

/* The best similarity a row of popcount b can reach with a query of popcount a. */
INLINE float pop_bound(int64_t a, int64_t b) {
    const int64_t mn = a < b ? a : b, mx = a < b ? b : a;
    return mx > 0 ? (float)((double)mn / (double)mx) : 0.0f;
}

/* The popcounts b whose bound with a query of popcount a reaches `cut`: [*blo, *bhi], empty
 * when *blo > *bhi. The bound rises with b up to a, then falls: two binary searches. */
static void cut_range(int64_t a, float cut, int64_t bits, int64_t *blo, int64_t *bhi) {
    if (a == 0) { /* every bound is 0 */
        *blo = 0;
        *bhi = cut <= 0.0f ? bits : -1;
        return;
    }
    int64_t lo = 0, hi = a; /* the smallest b <= a that reaches (b = a: bound 1) */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (pop_bound(a, mid) >= cut) hi = mid;
        else lo = mid + 1;
    }
    *blo = lo;
    lo = a;
    hi = bits; /* the largest b >= a that reaches */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (pop_bound(a, mid) >= cut) lo = mid;
        else hi = mid - 1;
    }
    *bhi = lo;
}

/* Row r's popcount is in [blo, bhi]. */
INLINE int in_range(const int32_t *pc, int64_t r, int64_t blo, int64_t bhi) {
    return pc[r] >= blo && pc[r] <= bhi;
}

INLINE uint64_t tanimoto_key(float sim, uint64_t id) {
    return ((uint64_t)(INF_BITS - float_bits(sim)) << 32) | id;
}

/* Merge every thread's heaps of one query (nt * k keys, NO_KEY where empty), best first. */
static int64_t merge_heaps(uint64_t *all, int64_t nt, int64_t k, const int64_t *sizes,
                           int64_t stride, uint64_t *buf) {
    int64_t m = 0;
    for (int64_t t = 0; t < nt; t++)
        for (int64_t j = 0; j < sizes[t * stride]; j++) buf[m++] = all[t * stride * k + j];
    qsort(buf, (size_t)m, sizeof(uint64_t), cmp_u64);
    return m < k ? m : k;
}

/* --- the shared scan: tiles x query blocks, per-thread heaps -------------------------------- */

typedef struct {
    const uint8_t *q;
    int64_t Q, qrs;
    const uint8_t *c;
    int64_t N, crs, W;
    const int32_t *pc; /* tanimoto: corpus popcounts */
    const int64_t *ids;
    int64_t k;
    float thr;
    int tanimoto, sorted, path, nthreads;
} scan_t;

/* Tile t's popcount range. */
typedef struct {
    int32_t lo, hi;
} prange_t;

/* The first row at or after `from` whose popcount is >= b, in a sorted corpus. */
static int64_t lower_row(const int32_t *pc, int64_t N, int64_t b) {
    int64_t lo = 0, hi = N;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (pc[mid] < b) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Rows [*r0, *r1) of a sorted corpus whose popcounts can reach `cut` with a query of
 * popcount a (the bound is unimodal in b, so they are one run). */
static void reach_rows(const scan_t *s, int64_t a, float cut, int64_t *r0, int64_t *r1) {
    int64_t blo, bhi;
    cut_range(a, cut, 8 * s->W, &blo, &bhi);
    if (blo > bhi) {
        *r0 = *r1 = 0;
        return;
    }
    *r0 = lower_row(s->pc, s->N, blo);
    *r1 = lower_row(s->pc, s->N, bhi + 1);
}

/* Tile visiting order: outward from tile `mid` when the corpus is sorted, else in order. */
static void tile_order(int64_t *order, int64_t ntiles, int64_t mid) {
    int64_t m = 0, lo = mid, hi = mid + 1;
    while (lo >= 0 || hi < ntiles) {
        if (lo >= 0) order[m++] = lo--;
        if (hi < ntiles) order[m++] = hi++;
    }
}

/* One query block's top-k: keys into out_keys (nq, k), NO_KEY where empty. */
static void topk_block(const scan_t *s, const int64_t *qrows, int64_t nq, const int64_t *qpc,
                       const prange_t *pr, int64_t *order, uint64_t *out_keys) {
    const int64_t k = s->k, T = tile_rows_for(s->W), ntiles = (s->N + T - 1) / T;
    const count_fn count = count_for(s->path, !s->tanimoto);
    int64_t mid = 0;
    if (s->tanimoto && s->sorted && ntiles > 0)
        mid = lower_row(s->pc, s->N, qpc[nq / 2]) / T;
    if (mid >= ntiles) mid = ntiles - 1;
    tile_order(order, ntiles, mid);
    int nt = s->nthreads < 1 ? 1 : s->nthreads;
    uint64_t *heaps = malloc(sizeof(uint64_t) * (size_t)(nt * nq * k));
    int64_t *sizes = calloc((size_t)(nt * nq), sizeof(int64_t));
    if (!heaps || !sizes) goto done;
#pragma omp parallel num_threads(nt)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        uint64_t *h = heaps + (int64_t)tid * nq * k;
        int64_t *sz = sizes + (int64_t)tid * nq;
        int32_t *cnt = malloc(sizeof(int32_t) * (size_t)T);
        float *lastcut = malloc(sizeof(float) * (size_t)nq); /* per query: the cut of brange */
        int64_t *brange = malloc(sizeof(int64_t) * 2 * (size_t)nq);
        for (int64_t j = 0; lastcut && j < nq; j++) lastcut[j] = -1.0f;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < ntiles; i++) {
            if (!cnt || !lastcut || !brange) continue;
            const int64_t t = order[i], r0 = t * T, n = s->N - r0 < T ? s->N - r0 : T;
            const uint8_t *rows = s->c + r0 * s->crs;
            for (int64_t j = 0; j < nq; j++) {
                const uint8_t *qr = s->q + qrows[j] * s->qrs;
                uint64_t *hj = h + j * k;
                if (!s->tanimoto) {
                    count(qr, rows, s->crs, n, s->W, cnt);
                    /* Only a distance at most the k-th best's can enter (a tie by its id). */
                    int32_t worst = sz[j] < k ? INT32_MAX : (int32_t)(hj[0] >> 32);
                    for (int64_t g = 0; g < n; g += 16) { /* groups of 16: a vector test */
                        const int64_t ge = g + 16 < n ? g + 16 : n;
                        int any = 0;
                        for (int64_t r = g; r < ge; r++) any |= cnt[r] <= worst;
                        if (!any) continue;
                        for (int64_t r = g; r < ge; r++) {
                            if (cnt[r] > worst) continue;
                            const uint64_t key =
                                ((uint64_t)cnt[r] << 32) | row_id(s->ids, r0 + r);
                            if (sz[j] < k || key < hj[0]) {
                                heap_push(hj, &sz[j], k, key);
                                if (sz[j] == k) worst = (int32_t)(hj[0] >> 32);
                            }
                        }
                    }
                    continue;
                }
                const int64_t a = qpc[j];
                float cut = s->thr;
                if (sz[j] == k) {
                    const float kth = bits_float(INF_BITS - (uint32_t)(hj[0] >> 32));
                    if (kth > cut) cut = kth;
                }
                if (cut != lastcut[j]) { /* the popcounts that can still enter */
                    cut_range(a, cut, 8 * s->W, &brange[2 * j], &brange[2 * j + 1]);
                    lastcut[j] = cut;
                }
                const int64_t blo = brange[2 * j], bhi = brange[2 * j + 1];
                if (pr[t].hi < blo || pr[t].lo > bhi) continue;
                const int32_t *pc = s->pc + r0;
                for (int64_t r = 0; r < n;) { /* runs of rows in range (one, when sorted) */
                    while (r < n && !in_range(pc, r, blo, bhi)) r++;
                    int64_t e = r;
                    while (e < n && in_range(pc, e, blo, bhi)) e++;
                    if (e == r) break;
                    count(qr, rows + r * s->crs, s->crs, e - r, s->W, cnt);
                    for (int64_t x = r; x < e; x++) {
                        const float sim = similarity(cnt[x - r], a, pc[x]);
                        if (!(sim >= s->thr)) continue;
                        const uint64_t key = tanimoto_key(sim, row_id(s->ids, r0 + x));
                        if (sz[j] < k || key < hj[0]) heap_push(hj, &sz[j], k, key);
                    }
                    r = e;
                }
            }
        }
        free(cnt);
        free(lastcut);
        free(brange);
    }
    {
        uint64_t *buf = malloc(sizeof(uint64_t) * (size_t)(nt * k));
        if (!buf) goto done;
        for (int64_t j = 0; j < nq; j++) {
            const int64_t m = merge_heaps(heaps + j * k, nt, k, sizes + j, nq, buf);
            for (int64_t x = 0; x < k; x++) out_keys[j * k + x] = x < m ? buf[x] : NO_KEY;
        }
        free(buf);
    }
done:
    free(heaps);
    free(sizes);
}

/* Per-tile popcount ranges (for an unsorted corpus, the min and max of each tile). */
static prange_t *tile_ranges(const scan_t *s) {
    const int64_t T = tile_rows_for(s->W), ntiles = (s->N + T - 1) / T;
    prange_t *pr = malloc(sizeof(prange_t) * (size_t)(ntiles > 0 ? ntiles : 1));
    if (!pr) return NULL;
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t r0 = t * T, r1 = s->N < r0 + T ? s->N : r0 + T;
        int32_t lo = s->pc[r0], hi = s->pc[r0];
        for (int64_t r = r0 + 1; r < r1; r++) {
            if (s->pc[r] < lo) lo = s->pc[r];
            if (s->pc[r] > hi) hi = s->pc[r];
        }
        pr[t].lo = lo;
        pr[t].hi = hi;
    }
    return pr;
}

static int cmp_pair(const void *a, const void *b) {
    const int64_t *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]) ? (x[0] > y[0]) - (x[0] < y[0])
                                         : (x[1] > y[1]) - (x[1] < y[1]);
}

/* The queries' popcounts, and their order: by popcount for Tanimoto (blocks of similar
 * queries), as given for Hamming. Returns 0 on allocation failure. */
static int query_order(const scan_t *s, int64_t *qpc_all, int64_t *qorder) {
    int32_t *pcq = malloc(sizeof(int32_t) * (size_t)(s->Q > 0 ? s->Q : 1));
    int64_t *pairs = malloc(sizeof(int64_t) * 2 * (size_t)(s->Q > 0 ? s->Q : 1));
    if (!pcq || !pairs) {
        free(pcq);
        free(pairs);
        return 0;
    }
    bs_popcount(s->q, s->Q, s->qrs, s->W, pcq, s->path, 1);
    for (int64_t i = 0; i < s->Q; i++) {
        pairs[2 * i] = s->tanimoto ? pcq[i] : 0;
        pairs[2 * i + 1] = i;
    }
    qsort(pairs, (size_t)s->Q, 2 * sizeof(int64_t), cmp_pair);
    for (int64_t i = 0; i < s->Q; i++) {
        qorder[i] = pairs[2 * i + 1];
        qpc_all[i] = pcq[qorder[i]];
    }
    free(pcq);
    free(pairs);
    return 1;
}

/* Top-k of every query: keys (Q, k) in the caller's query order. Returns 0 on failure. */
static int topk(const scan_t *s, uint64_t *keys) {
    const int64_t T = tile_rows_for(s->W), ntiles = (s->N + T - 1) / T;
    int64_t qb = HEAP_BUDGET / s->k;
    if (qb > QBLOCK) qb = QBLOCK;
    if (qb < 1) qb = 1;
    int64_t *qpc = malloc(sizeof(int64_t) * (size_t)(s->Q + 1));
    int64_t *qorder = malloc(sizeof(int64_t) * (size_t)(s->Q + 1));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(ntiles + 1));
    uint64_t *block = malloc(sizeof(uint64_t) * (size_t)(qb * s->k));
    prange_t *pr = s->tanimoto ? tile_ranges(s) : NULL;
    int ok = qpc && qorder && order && block && (pr || !s->tanimoto) && query_order(s, qpc, qorder);
    for (int64_t j0 = 0; ok && j0 < s->Q; j0 += qb) {
        const int64_t nq = s->Q - j0 < qb ? s->Q - j0 : qb;
        if (ntiles == 0) {
            for (int64_t x = 0; x < nq * s->k; x++) block[x] = NO_KEY;
        } else {
            topk_block(s, qorder + j0, nq, qpc + j0, pr, order, block);
        }
        for (int64_t j = 0; j < nq; j++)
            memcpy(keys + qorder[j0 + j] * s->k, block + j * s->k, sizeof(uint64_t) * s->k);
    }
    free(qpc);
    free(qorder);
    free(order);
    free(block);
    free(pr);
    return ok;
}

int bs_hamming_topk(const uint8_t *q, int64_t Q, int64_t qrs, const uint8_t *c, int64_t N,
                    int64_t crs, int64_t W, const int64_t *ids, int64_t k, int32_t *out_d,
                    int64_t *out_i, int path, int nthreads) {
    const scan_t s = {q, Q, qrs, c, N, crs, W, NULL, ids, k, 0.0f, 0, 0, path, nthreads};
    uint64_t *keys = malloc(sizeof(uint64_t) * (size_t)(Q * k + 1));
    if (!keys || !topk(&s, keys)) {
        free(keys);
        return 0;
    }
    for (int64_t x = 0; x < Q * k; x++) {
        const int empty = keys[x] == NO_KEY;
        out_d[x] = empty ? -1 : (int32_t)(keys[x] >> 32);
        out_i[x] = empty ? -1 : (int64_t)(keys[x] & 0xFFFFFFFFu);
    }
    free(keys);
    return 1;
}

int bs_tanimoto_topk(const uint8_t *q, int64_t Q, int64_t qrs, const uint8_t *c, int64_t N,
                     int64_t crs, int64_t W, const int32_t *pc, const int64_t *ids,
                     int sorted, int64_t k, float thr, float *out_s, int64_t *out_i, int path,
                     int nthreads) {
    const scan_t s = {q, Q, qrs, c, N, crs, W, pc, ids, k, thr, 1, sorted, path, nthreads};
    uint64_t *keys = malloc(sizeof(uint64_t) * (size_t)(Q * k + 1));
    if (!keys || !topk(&s, keys)) {
        free(keys);
        return 0;
    }
    for (int64_t x = 0; x < Q * k; x++) {
        const int empty = keys[x] == NO_KEY;
        out_s[x] = empty ? 0.0f : bits_float(INF_BITS - (uint32_t)(keys[x] >> 32));
        out_i[x] = empty ? -1 : (int64_t)(keys[x] & 0xFFFFFFFFu);
    }
    free(keys);
    return 1;
}

/* --- threshold search: every hit, as CSR --------------------------------------------------- */

typedef struct {
    uint64_t *keys;
    int64_t n, cap;
} hits_t;

static int hits_add(hits_t *h, uint64_t key) {
    if (h->n == h->cap) {
        const int64_t cap = h->cap ? 2 * h->cap : 64;
        uint64_t *k = realloc(h->keys, sizeof(uint64_t) * (size_t)cap);
        if (!k) return 0;
        h->keys = k;
        h->cap = cap;
    }
    h->keys[h->n++] = key;
    return 1;
}

typedef struct {
    int64_t Q, total;
    hits_t *per_query; /* Q lists, each sorted best first */
} result_t;

/* One query block: every thread appends its hits to its own lists (nt * nq), then each
 * query's lists are joined and sorted. Returns 0 on allocation failure. */
static int threshold_block(const scan_t *s, const int64_t *qrows, int64_t nq, const int64_t *qpc,
                           const prange_t *pr, hits_t *out) {
    const int64_t T = tile_rows_for(s->W), ntiles = (s->N + T - 1) / T;
    const count_fn count = count_for(s->path, 0);
    int nt = s->nthreads < 1 ? 1 : s->nthreads;
    int64_t *rr = malloc(sizeof(int64_t) * 2 * (size_t)nq); /* rows, in a sorted corpus */
    int64_t *br = malloc(sizeof(int64_t) * 2 * (size_t)nq); /* popcounts that can hit */
    hits_t *lists = calloc((size_t)(nt * nq), sizeof(hits_t));
    int failed = !rr || !br || !lists;
    int64_t t0 = ntiles, t1 = 0; /* the tiles any query of the block can hit */
    for (int64_t j = 0; !failed && j < nq; j++) {
        int64_t r0 = 0, r1 = s->N;
        cut_range(qpc[j], s->thr, 8 * s->W, &br[2 * j], &br[2 * j + 1]);
        if (s->sorted) reach_rows(s, qpc[j], s->thr, &r0, &r1);
        rr[2 * j] = r0;
        rr[2 * j + 1] = r1;
        if (r0 < r1) {
            if (r0 / T < t0) t0 = r0 / T;
            if ((r1 - 1) / T + 1 > t1) t1 = (r1 - 1) / T + 1;
        }
    }
#pragma omp parallel num_threads(nt) if (!failed)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        hits_t *mine = lists ? lists + (int64_t)tid * nq : NULL;
        int32_t *cnt = malloc(sizeof(int32_t) * (size_t)T);
        int bad = !cnt || !mine;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = t0; t < t1; t++) {
            if (bad) continue;
            const int64_t r0 = t * T, n = s->N - r0 < T ? s->N - r0 : T;
            const uint8_t *rows = s->c + r0 * s->crs;
            for (int64_t j = 0; j < nq && !bad; j++) {
                const int64_t a = qpc[j], blo = br[2 * j], bhi = br[2 * j + 1];
                if (pr[t].hi < blo || pr[t].lo > bhi) continue;
                int64_t lo = rr[2 * j] - r0, hi = rr[2 * j + 1] - r0;
                if (lo < 0) lo = 0;
                if (hi > n) hi = n;
                const int32_t *pc = s->pc + r0;
                for (int64_t r = lo; r < hi;) { /* runs of rows in range (one, when sorted) */
                    while (r < hi && !in_range(pc, r, blo, bhi)) r++;
                    int64_t e = r;
                    while (e < hi && in_range(pc, e, blo, bhi)) e++;
                    if (e == r) break;
                    count(s->q + qrows[j] * s->qrs, rows + r * s->crs, s->crs, e - r, s->W, cnt);
                    for (int64_t x = r; x < e; x++) {
                        const float sim = similarity(cnt[x - r], a, pc[x]);
                        if (sim >= s->thr &&
                            !hits_add(&mine[j], tanimoto_key(sim, row_id(s->ids, r0 + x))))
                            bad = 1;
                    }
                    r = e;
                }
            }
        }
        free(cnt);
        if (bad) {
#pragma omp atomic write
            failed = 1;
        }
    }
    for (int64_t j = 0; !failed && j < nq; j++) {
        hits_t *dst = &out[qrows[j]];
        for (int t = 0; t < nt && !failed; t++) {
            const hits_t *src = &lists[(int64_t)t * nq + j];
            for (int64_t x = 0; x < src->n && !failed; x++)
                if (!hits_add(dst, src->keys[x])) failed = 1;
        }
        qsort(dst->keys, (size_t)dst->n, sizeof(uint64_t), cmp_u64);
    }
    for (int64_t x = 0; lists && x < nt * nq; x++) free(lists[x].keys);
    free(lists);
    free(rr);
    free(br);
    return !failed;
}

static void result_free(result_t *r) {
    if (!r) return;
    for (int64_t j = 0; r->per_query && j < r->Q; j++) free(r->per_query[j].keys);
    free(r->per_query);
    free(r);
}

/* Every hit of every query; NULL on allocation failure. `*total` is the number of hits:
 * the caller allocates the outputs and calls bs_threshold_take. */
void *bs_tanimoto_threshold(const uint8_t *q, int64_t Q, int64_t qrs, const uint8_t *c,
                            int64_t N, int64_t crs, int64_t W, const int32_t *pc,
                            const int64_t *ids, int sorted, float thr, int path, int nthreads,
                            int64_t *total) {
    const scan_t s = {q, Q, qrs, c, N, crs, W, pc, ids, 1, thr, 1, sorted, path, nthreads};
    result_t *res = calloc(1, sizeof(result_t));
    int64_t *qpc = malloc(sizeof(int64_t) * (size_t)(Q + 1));
    int64_t *qorder = malloc(sizeof(int64_t) * (size_t)(Q + 1));
    prange_t *pr = N > 0 ? tile_ranges(&s) : NULL;
    int ok = res && qpc && qorder && (pr || N == 0) && query_order(&s, qpc, qorder);
    if (ok) {
        res->Q = Q;
        res->per_query = calloc((size_t)(Q + 1), sizeof(hits_t));
        ok = res->per_query != NULL;
    }
    for (int64_t j0 = 0; ok && N > 0 && j0 < Q; j0 += QBLOCK) {
        const int64_t nq = Q - j0 < QBLOCK ? Q - j0 : QBLOCK;
        ok = threshold_block(&s, qorder + j0, nq, qpc + j0, pr, res->per_query);
    }
    free(qpc);
    free(qorder);
    free(pr);
    if (!ok) {
        result_free(res);
        return NULL;
    }
    for (int64_t j = 0; j < Q; j++) res->total += res->per_query[j].n;
    *total = res->total;
    return res;
}

/* Write the CSR of a bs_tanimoto_threshold result and free it (call exactly once; a NULL
 * output pointer just frees). */
void bs_threshold_take(void *handle, int64_t *offsets, int64_t *out_i, float *out_s) {
    result_t *r = handle;
    if (r && offsets) {
        int64_t at = 0;
        offsets[0] = 0;
        for (int64_t j = 0; j < r->Q; j++) {
            const hits_t *h = &r->per_query[j];
            for (int64_t x = 0; x < h->n; x++, at++) {
                out_s[at] = bits_float(INF_BITS - (uint32_t)(h->keys[x] >> 32));
                out_i[at] = (int64_t)(h->keys[x] & 0xFFFFFFFFu);
            }
            offsets[j + 1] = at;
        }
    }
    result_free(r);
}
