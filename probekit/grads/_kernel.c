/* The grad probe's fused chunk kernel: every statistic of a chunk of a gradient in one pass.
 *
 * Called through ctypes from probekit/grads/kernel.py (which holds a numpy twin of every
 * function here, used where this extension was not built, and tested against it value for
 * value). Two functions per floating-point width:
 *
 *   pk_minmax_*  max and min over the non-NaN elements, the largest finite |x|, the NaN count
 *                (the first pass: the significance threshold is a property of the whole
 *                gradient, so it is known before the bits are packed);
 *   pk_stats_*   in one pass: the sum of squares (float64 accumulators; float32 products are
 *                exact in float64), the sign bits (x > 0) and significance bits (|x| > thr),
 *                packed 8 per byte most significant bit first (numpy.packbits order), and,
 *                with want_counts, the count of x <= b for each bound, of exact zeros and of
 *                NaNs.
 *
 * Comparisons are made in the element's own width: for float32 elements the threshold and the
 * bounds are rounded to float32 first (to nearest), as numpy and torch compare a float32 array
 * with a Python float. On x86-64 a float32 AVX2 path is chosen at run time where the CPU has
 * it; every path gives the same bits and counts, and sums that differ only in the order of
 * float64 additions. Paths: portable C (any CPU), AVX2 and AVX-512 (x86-64, chosen at run time).
 *
 * The module init below only makes this file a valid extension module for setuptools; nothing
 * is called through the Python C API.
 */
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PK_MAXB 64 /* bounds handled in vector registers; more take the portable path */

/* ------------------------------------------------------------------ portable C paths */

#define PK_MINMAX(NAME, T)                                                                   \
    int64_t NAME(const T *x, int64_t n, double *out) {                                     \
        T mx = -INFINITY, mn = INFINITY, am = 0;                                           \
        int64_t nans = 0;                                                                  \
        for (int64_t i = 0; i < n; i++) { /* branch-free: a NaN compares false */          \
            T v = x[i];                                                                    \
            T a = v < 0 ? -v : v;                                                          \
            nans += v != v;                                                                \
            mx = v > mx ? v : mx;                                                          \
            mn = v < mn ? v : mn;                                                          \
            am = (a > am) & (a < (T)INFINITY) ? a : am;                                    \
        }                                                                                  \
        out[0] = (double)mx; out[1] = (double)mn; out[2] = (double)am;                     \
        return nans;                                                                       \
    }

PK_MINMAX(pk_minmax_f32_c, float)
PK_MINMAX(pk_minmax_f64, double)

/* counts: nb bound counts, then zeros, then NaNs (only with want_counts). Written for the
 * compiler's vectoriser: a fixed 8-element inner loop per byte, one loop per count. */
#define PK_STATS(NAME, T)                                                                    \
    double NAME(const T *x, int64_t n, double thr_d, uint8_t *signs, uint8_t *sig,          \
                const double *bounds, int32_t nb, int64_t *counts, int32_t want_counts) {   \
        T thr = (T)thr_d;                                                                  \
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                          \
        int64_t i = 0, nfull = n & ~(int64_t)7;                                            \
        for (; i < nfull; i += 8) {                                                        \
            unsigned s = 0, g = 0;                                                         \
            for (int j = 0; j < 8; j++) {                                                  \
                T v = x[i + j];                                                            \
                acc[j] += (double)v * (double)v;                                           \
                s |= (unsigned)(v > 0) << (7 - j);                                         \
                g |= (unsigned)((v > thr) | (v < -thr)) << (7 - j);                           \
            }                                                                              \
            if (signs) signs[i >> 3] = (uint8_t)s;                                         \
            if (sig) sig[i >> 3] = (uint8_t)g;                                             \
        }                                                                                  \
        if (i < n) {                                                                       \
            unsigned s = 0, g = 0;                                                         \
            for (int j = 0; i + j < n; j++) {                                              \
                T v = x[i + j];                                                            \
                acc[j] += (double)v * (double)v;                                           \
                s |= (unsigned)(v > 0) << (7 - j);                                         \
                g |= (unsigned)((v > thr) | (v < -thr)) << (7 - j);                           \
            }                                                                              \
            if (signs) signs[i >> 3] = (uint8_t)s;                                         \
            if (sig) sig[i >> 3] = (uint8_t)g;                                             \
        }                                                                                  \
        if (want_counts) {                                                                 \
            for (int k = 0; k < nb; k++) {                                                 \
                T b = (T)bounds[k];                                                        \
                int64_t c = 0;                                                             \
                for (int64_t e = 0; e < n; e++) c += x[e] <= b;                            \
                counts[k] = c;                                                             \
            }                                                                              \
            int64_t zeros = 0, nans = 0;                                                   \
            for (int64_t e = 0; e < n; e++) zeros += x[e] == 0;                            \
            for (int64_t e = 0; e < n; e++) nans += x[e] != x[e];                          \
            counts[nb] = zeros;                                                            \
            counts[nb + 1] = nans;                                                         \
        }                                                                                  \
        return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])); \
    }

PK_STATS(pk_stats_f32_c, float)
PK_STATS(pk_stats_f64, double)

/* ------------------------------------------------------------------ x86-64 AVX2 (float32) */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PK_HAVE_AVX2_CODE 1

__attribute__((target("avx2,fma")))
static int64_t minmax_f32_avx2(const float *x, int64_t n, double *out) {
    __m256 mx = _mm256_set1_ps(-INFINITY), mn = _mm256_set1_ps(INFINITY);
    __m256 am = _mm256_setzero_ps(), inf = _mm256_set1_ps(INFINITY);
    __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t nans = 0, i = 0, nv = n & ~(int64_t)7;
    for (; i < nv; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        mx = _mm256_max_ps(v, mx); /* a NaN in v gives the second operand: NaN is skipped */
        mn = _mm256_min_ps(v, mn);
        __m256 a = _mm256_and_ps(v, absmask);
        am = _mm256_max_ps(_mm256_and_ps(a, _mm256_cmp_ps(a, inf, _CMP_LT_OQ)), am);
        nans += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
    float fx[8], fn[8], fa[8];
    _mm256_storeu_ps(fx, mx); _mm256_storeu_ps(fn, mn); _mm256_storeu_ps(fa, am);
    double tail[3];
    nans += pk_minmax_f32_c(x + i, n - i, tail);
    float rx = (float)tail[0], rn = (float)tail[1], ra = (float)tail[2];
    for (int k = 0; k < 8; k++) {
        if (fx[k] > rx) rx = fx[k];
        if (fn[k] < rn) rn = fn[k];
        if (fa[k] > ra) ra = fa[k];
    }
    out[0] = rx; out[1] = rn; out[2] = ra;
    return nans;
}

__attribute__((target("avx2,fma")))
static double stats_f32_avx2(const float *x, int64_t n, double thr_d, uint8_t *signs,
                             uint8_t *sig, const double *bounds, int32_t nb, int64_t *counts,
                             int32_t want_counts) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 thr = _mm256_set1_ps((float)thr_d);
    const __m256i rev = _mm256_set_epi32(0, 1, 2, 3, 4, 5, 6, 7); /* movemask bit 0 = x[7] */
    __m256 vb[PK_MAXB];
    __m256i cnt[PK_MAXB + 2];
    int32_t nc = want_counts ? nb + 2 : 0;
    for (int k = 0; k < nb; k++) vb[k] = _mm256_set1_ps((float)bounds[k]);
    int64_t total[PK_MAXB + 2];
    for (int k = 0; k < nc; k++) { cnt[k] = _mm256_setzero_si256(); total[k] = 0; }
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t i = 0, nv = n & ~(int64_t)7;
    while (i < nv) {
        /* int32 lane counters: emptied at least every 2^28 vectors */
        int64_t stop = nv - i > ((int64_t)1 << 31) ? i + ((int64_t)1 << 31) : nv;
        for (; i < stop; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            a0 = _mm256_fmadd_pd(lo, lo, a0);
            a1 = _mm256_fmadd_pd(hi, hi, a1);
            if (signs || sig) {
                __m256 r = _mm256_permutevar8x32_ps(v, rev);
                if (signs)
                    signs[i >> 3] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(r, zero, _CMP_GT_OQ));
                if (sig)
                    sig[i >> 3] = (uint8_t)_mm256_movemask_ps(
                        _mm256_cmp_ps(_mm256_and_ps(r, absmask), thr, _CMP_GT_OQ));
            }
            if (want_counts) {
                for (int k = 0; k < nb; k++)
                    cnt[k] = _mm256_sub_epi32(cnt[k], _mm256_castps_si256(
                                                          _mm256_cmp_ps(v, vb[k], _CMP_LE_OQ)));
                cnt[nb] = _mm256_sub_epi32(cnt[nb], _mm256_castps_si256(
                                                        _mm256_cmp_ps(v, zero, _CMP_EQ_OQ)));
                cnt[nb + 1] = _mm256_sub_epi32(
                    cnt[nb + 1], _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
            }
        }
        for (int k = 0; k < nc; k++) {
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, cnt[k]);
            for (int l = 0; l < 8; l++) total[k] += (uint32_t)lanes[l];
            cnt[k] = _mm256_setzero_si256();
        }
    }
    double d0[4], d1[4];
    _mm256_storeu_pd(d0, a0); _mm256_storeu_pd(d1, a1);
    double sumsq = ((d0[0] + d1[0]) + (d0[1] + d1[1])) + ((d0[2] + d1[2]) + (d0[3] + d1[3]));
    if (i < n) { /* the last, partial byte */
        int64_t tail[PK_MAXB + 2];
        sumsq += pk_stats_f32_c(x + i, n - i, thr_d, signs ? signs + (i >> 3) : NULL,
                                sig ? sig + (i >> 3) : NULL, bounds, nb, tail, want_counts);
        for (int k = 0; k < nc; k++) total[k] += tail[k];
    }
    for (int k = 0; k < nc; k++) counts[k] = total[k];
    return sumsq;
}

__attribute__((target("avx512f")))
static int64_t minmax_f32_avx512(const float *x, int64_t n, double *out) {
    __m512 mx = _mm512_set1_ps(-INFINITY), mn = _mm512_set1_ps(INFINITY);
    __m512 am = _mm512_setzero_ps(), inf = _mm512_set1_ps(INFINITY);
    int64_t nans = 0, i = 0, nv = n & ~(int64_t)15;
    for (; i < nv; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __mmask16 ok = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
        mx = _mm512_mask_max_ps(mx, ok, v, mx);
        mn = _mm512_mask_min_ps(mn, ok, v, mn);
        __m512 a = _mm512_abs_ps(v);
        am = _mm512_mask_max_ps(am, _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ), a, am);
        nans += 16 - __builtin_popcount((unsigned)ok);
    }
    double tail[3];
    nans += pk_minmax_f32_c(x + i, n - i, tail);
    float rx = _mm512_reduce_max_ps(mx), rn = _mm512_reduce_min_ps(mn);
    float ra = _mm512_reduce_max_ps(am);
    if ((float)tail[0] > rx) rx = (float)tail[0];
    if ((float)tail[1] < rn) rn = (float)tail[1];
    if ((float)tail[2] > ra) ra = (float)tail[2];
    out[0] = rx; out[1] = rn; out[2] = ra;
    return nans;
}

__attribute__((target("avx512f")))
static double stats_f32_avx512(const float *x, int64_t n, double thr_d, uint8_t *signs,
                               uint8_t *sig, const double *bounds, int32_t nb, int64_t *counts,
                               int32_t want_counts) {
    const __m512 zero = _mm512_setzero_ps();
    const __m512 thr = _mm512_set1_ps((float)thr_d);
    const __m512i one = _mm512_set1_epi32(1);
    /* within each group of 8 elements, reversed: mask bit 0 = x[7], bit 8 = x[15] */
    const __m512i rev = _mm512_set_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 vb[PK_MAXB];
    __m512i cnt[PK_MAXB + 2];
    int32_t nc = want_counts ? nb + 2 : 0;
    for (int k = 0; k < nb; k++) vb[k] = _mm512_set1_ps((float)bounds[k]);
    int64_t total[PK_MAXB + 2];
    for (int k = 0; k < nc; k++) { cnt[k] = _mm512_setzero_si512(); total[k] = 0; }
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    int64_t i = 0, nv = n & ~(int64_t)15;
    while (i < nv) {
        int64_t stop = nv - i > ((int64_t)1 << 31) ? i + ((int64_t)1 << 31) : nv;
        for (; i < stop; i += 16) {
            __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
            __m512d hi = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
            a0 = _mm512_fmadd_pd(lo, lo, a0);
            a1 = _mm512_fmadd_pd(hi, hi, a1);
            __m512 v = _mm512_loadu_ps(x + i);
            if (signs || sig) {
                __m512 r = _mm512_permutexvar_ps(rev, v);
                if (signs) {
                    uint16_t m = (uint16_t)_mm512_cmp_ps_mask(r, zero, _CMP_GT_OQ);
                    memcpy(signs + (i >> 3), &m, 2);
                }
                if (sig) {
                    uint16_t m = (uint16_t)_mm512_cmp_ps_mask(_mm512_abs_ps(r), thr, _CMP_GT_OQ);
                    memcpy(sig + (i >> 3), &m, 2);
                }
            }
            if (want_counts) {
                for (int k = 0; k < nb; k++)
                    cnt[k] = _mm512_mask_add_epi32(cnt[k], _mm512_cmp_ps_mask(v, vb[k], _CMP_LE_OQ),
                                                   cnt[k], one);
                cnt[nb] = _mm512_mask_add_epi32(cnt[nb], _mm512_cmp_ps_mask(v, zero, _CMP_EQ_OQ),
                                                cnt[nb], one);
                cnt[nb + 1] = _mm512_mask_add_epi32(
                    cnt[nb + 1], _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), cnt[nb + 1], one);
            }
        }
        for (int k = 0; k < nc; k++) {
            int32_t lanes[16];
            _mm512_storeu_si512((void *)lanes, cnt[k]);
            for (int l = 0; l < 16; l++) total[k] += (uint32_t)lanes[l];
            cnt[k] = _mm512_setzero_si512();
        }
    }
    double sumsq = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
    if (i < n) { /* the last, partial 16 elements: the AVX2 path, then the portable one */
        int64_t tail[PK_MAXB + 2];
        sumsq += stats_f32_avx2(x + i, n - i, thr_d, signs ? signs + (i >> 3) : NULL,
                                sig ? sig + (i >> 3) : NULL, bounds, nb, tail, want_counts);
        for (int k = 0; k < nc; k++) total[k] += tail[k];
    }
    for (int k = 0; k < nc; k++) counts[k] = total[k];
    return sumsq;
}
#endif

/* ------------------------------------------------------------------ dispatch */

static int level = 0; /* 0 portable, 1 AVX2, 2 AVX-512 */

/* Asks for a path (0 portable, 1 AVX2, 2 AVX-512: granted up to what the CPU has); returns
 * the path in use. The module init asks for the best one; tests ask for each. */
int32_t pk_set_path(int32_t want) {
    level = 0;
#ifdef PK_HAVE_AVX2_CODE
    __builtin_cpu_init();
    if (want >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = 1;
    if (want >= 2 && level == 1 && __builtin_cpu_supports("avx512f")) level = 2;
#else
    (void)want;
#endif
    return level;
}

int64_t pk_minmax_f32(const float *x, int64_t n, double *out) {
#ifdef PK_HAVE_AVX2_CODE
    if (level == 2) return minmax_f32_avx512(x, n, out);
    if (level == 1) return minmax_f32_avx2(x, n, out);
#endif
    return pk_minmax_f32_c(x, n, out);
}

double pk_stats_f32(const float *x, int64_t n, double thr, uint8_t *signs, uint8_t *sig,
                    const double *bounds, int32_t nb, int64_t *counts, int32_t want_counts) {
#ifdef PK_HAVE_AVX2_CODE
    if (level == 2 && nb <= PK_MAXB)
        return stats_f32_avx512(x, n, thr, signs, sig, bounds, nb, counts, want_counts);
    if (level == 1 && nb <= PK_MAXB)
        return stats_f32_avx2(x, n, thr, signs, sig, bounds, nb, counts, want_counts);
#endif
    return pk_stats_f32_c(x, n, thr, signs, sig, bounds, nb, counts, want_counts);
}

int32_t pk_version(void) { return 1; }

static struct PyModuleDef pk_module = {PyModuleDef_HEAD_INIT, "_kernel",
                                       "probekit's fused gradient-statistics kernel (ctypes)",
                                       -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernel(void) {
    pk_set_path(2);
    return PyModule_Create(&pk_module);
}
