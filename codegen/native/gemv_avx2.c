/* llmc's integer-activation GEMVs (gemv_int16.c's, on AVX-512 BW) for CPUs with AVX2 but not AVX-512 BW
 * (AMD Zen 1-3, Intel's client cores), where without them every 4-bit and int8 GEMV multiplied fp32
 * activations: a widen, a conversion and an FMA per code, or a table lookup and an FMA. Here the 4-bit
 * GEMV on int8 activations (llama.cpp's rounding) costs, per 32 bytes of weights (64 codes), a mask, a
 * shift, two vpmaddubsw and a vpmaddwd, one conversion and one FMA a row; the GEMVs on int16 ones a widen
 * and vpmaddwd per 16 codes. On a 2-core Zen 3, Llama-3B Q4_1 decoded 3.3x faster than on fp32 ones.
 *
 * The same bits as the AVX-512 kernels: the activation codes, block scales and group sums are computed the
 * same way; AVX-512's 16 lanes are two halves of 8 here, each lane summing the same products in integers
 * and taking the same fp32 operations in the same order; the final sum follows _mm512_reduce_add_ps's tree
 * (GCC's avx512fintrin.h). So an artifact's outputs do not depend on which of the two CPUs serves it: the
 * int8 GEMV is held to one float32 model of the lanes on both (tests/codegen/test_cpu_native.py), the int16
 * ones by construction. */

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BW__)
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif

#define FEW_GROUP_CASES   /* gemv_rows.h: groups of 64 and 128 through the general loop */
#include "gemv_rows.h"

/* the largest of 8 floats */
static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(m, _mm_shuffle_ps(m, m, 1)));
}

/* gemv_int16.c's quantise_row8: per block of 32, codes round(x * 127 / max|x|) (vcvtps2dq, then clamped to
 * -128..127 as AVX-512's saturating store keeps them: nan is -128, its scale nan); block b of 64 goes,
 * within its pair of blocks' 128 codes, evens to the first 64 (at (b % 2) * 32 + i / 2), odds to the last
 * 64; the group sums add each block's scale times its codes' integer sum, half by half as there */
static void quantise_row8(const float *x, int64_t k, int64_t kp, int64_t group, int8_t *codes, float *scale,
                          float *sums) {
    const __m256 sign = _mm256_set1_ps(-0.f), finite = _mm256_set1_ps(FLT_MAX);
    const __m256i lowest = _mm256_set1_epi32(-128), highest = _mm256_set1_epi32(127);
    memset(codes + k, 0, kp - k);
    for (int64_t i = k / BLOCK8; i < kp / BLOCK8; i++) scale[i] = 0.f;
    for (int64_t g = 0; g < k / group; g++) sums[g] = 0.f;
    for (int64_t b = 0; b < k / BLOCK; b++) {
        int8_t *pair = codes + (b / 2) * 128 + (b % 2) * 32;
        for (int h = 0; h < 2; h++) {
            __m256 v[4], top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
            for (int u = 0; u < 4; u++) {
                v[u] = _mm256_loadu_ps(x + b * BLOCK + h * BLOCK8 + 8 * u);
                __m256 a = _mm256_andnot_ps(sign, v[u]);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, finite, _CMP_NLE_UQ));
                top = _mm256_max_ps(top, a);
            }
            int nonfinite = _mm256_movemask_ps(bad) != 0;
            float t = max8(top), s = nonfinite ? NAN : t / 127.f;
            __m256 inv = _mm256_set1_ps(nonfinite || t == 0.f ? 0.f : 127.f / t), s8 = _mm256_set1_ps(s);
            int tiny = !nonfinite && t > 0.f && t < 1e-30f;   /* near where 127 / t overflows: divide */
            int32_t c[BLOCK8], total = 0;
            for (int u = 0; u < 4; u++) {
                __m256 f = tiny ? _mm256_div_ps(v[u], s8) : _mm256_mul_ps(v[u], inv);
                _mm256_storeu_si256((__m256i *)(c + 8 * u),
                                    _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(f), highest), lowest));
            }
            for (int i = 0; i < BLOCK8; i++) {
                int at = h * BLOCK8 + i;
                pair[(at % 2) * 64 + at / 2] = (int8_t)c[i];
                total += c[i];
            }
            scale[2 * b + h] = s;
            float *sum = sums + (b * BLOCK + h * BLOCK8) / group;
            *sum = fmaf(s, (float)total, *sum);   /* as gemv_int16.c: one rounding */
        }
    }
}

/* lanes 2c + (l / 4), l = 0..7, of a 4-float vector held twice (v: [x, x]): the quads that half c of
 * AVX-512's 16 lanes takes. (A 128-bit vector cast up to 256 bits cost a store and a wider reload that
 * missed store forwarding: GCC 12 spills the undefined upper half.) */
static inline __m256 quads(__m256 v, const int c) {
    return _mm256_permutevar8x32_ps(v, c ? _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)
                                         : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* 4 floats at p, twice */
static inline __m256 twice(const float *p) {
    return _mm256_broadcast_ps((const __m128 *)p);
}

/* Half c of 128 codes (64 bytes: blocks 2p and 2p + 1; `half`: block 2p alone, the row's last 64 codes)
 * against M rows, as gemv_int16.c's pair_q4 computes AVX-512's lanes 8c..8c + 7: lane l sums bytes
 * 4l..4l + 3, codes 8l..8l + 7, of activation block 4p + l / 4. vpmaddubsw's pairs of products of a 4-bit
 * and an int8 code are at most 2 * 15 * 128 in magnitude, two of them inside int16: nothing saturates, and
 * the int32 sums are vpdpbusd's. (A half at a time keeps M rows' sums in 16 registers, where AVX-512 has 32.) */
static inline __attribute__((always_inline)) void pair_q4(const uint8_t *q, const struct act8 *a, const int64_t M,
                                                          const float *sc, const int64_t G, int64_t p, int half,
                                                          const int c, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    /* the weights' scales as AVX-512 loads them, lanes past a half pair's zero */
    __m256 s4 = _mm256_setzero_ps(), s = _mm256_setzero_ps();
    if (G == 32 && half) {
        __m128 ab = _mm_castpd_ps(_mm_load_sd((const double *)(sc + 4 * p)));   /* [a, b, 0, 0] */
        s4 = _mm256_set_m128(ab, ab);
    } else if (G == 32)
        s4 = twice(sc + 4 * p);
    else
        s = _mm256_set1_ps(G != 64 ? sc[p * 128 / G] : half && c ? 0.f : sc[2 * p + c]);
    __m256i w = half && c ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(q + 64 * p + 32 * c));
    __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
    for (int64_t r = 0; r < M; r++) {
        const int8_t *x = a->codes + r * a->kp + 128 * p + 32 * c;
        __m256i d = _mm256_madd_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                             _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 64)))),
            ones);
        __m256 x4 = twice(a->scale + r * (a->kp / BLOCK8) + 4 * p);
        __m256 both = G == 32 ? quads(_mm256_mul_ps(s4, x4), c) : _mm256_mul_ps(s, quads(x4, c));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), both, acc[r]);
    }
}

/* up to 8 floats from p (count of them; the rest 0) */
static inline __m256 load_live(const float *p, int64_t count) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(count < 0 ? 0 : count)), lane));
}

/* lanes of half c summing to row r's sum_g o_g * sum_{i in g} x_i, as gemv_int16.c's offsets */
static inline __m256 offsets(const float *sc, const float *zo, const float *sums, int64_t r, int64_t k, int64_t G,
                             int64_t zp, int c) {
    int64_t groups = k / G;
    __m256 t = _mm256_setzero_ps();
    for (int64_t i = 0; i < groups; i += 16) {
        int64_t at = i + 8 * c, live = groups - at;
        __m256 p = load_live(zo + at, live);
        if (zp) p = _mm256_mul_ps(p, load_live(sc + at, live));   /* s * z */
        t = _mm256_fmadd_ps(p, load_live(sums + r * groups + at, live), t);
    }
    return t;
}

/* _mm512_reduce_add_ps of the 16 lanes lo, hi: the upper 8 plus the lower, then 4 + 4, then [2, 3] + [0, 1],
 * then lane 0 + lane 1 */
static inline float reduce16(__m256 lo, __m256 hi) {
    __m256 t3 = _mm256_add_ps(hi, lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

/* half c of AVX-512's lanes of M rows' dots, from the two chains f and h: plus (offsets) or minus (zero
 * points) each row's offsets term, as gemv_int16.c's finish_q4 before its final sum */
static inline __attribute__((always_inline)) void finish_half(const __m256 *f, const __m256 *h, const int64_t M,
                                                              const float *sc, const float *zo, const float *sums,
                                                              int64_t k, const int64_t G, int64_t zp, const int c,
                                                              __m256 *out) {
    for (int64_t r = 0; r < M; r++) {
        __m256 total = _mm256_add_ps(f[r], h[r]), t = offsets(sc, zo, sums, r, k, G, zp, c);
        out[r] = zp ? _mm256_sub_ps(total, t) : _mm256_add_ps(total, t);
    }
}

/* y[r * n] = the sum of row r's 16 lanes (lo: 0-7, hi: 8-15) */
static inline __attribute__((always_inline)) void reduce_rows(const __m256 *lo, const __m256 *hi, const int64_t M,
                                                              float *y, int64_t n) {
    for (int64_t r = 0; r < M; r++) y[r * n] = reduce16(lo[r], hi[r]);
}

/* for c in 0, 1: the two halves of AVX-512's lanes, one after the other, each compiled with its constant c
 * (one copy of the loop for both, c a variable, measured 1.2x slower in cache and from DRAM) */
#define HALVES(c) _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++)

/* NAME: one 4-bit weight row's dot with M rows of ACT activations, AVX-512's lanes 0-7 then 8-15 (HALF),
 * summed */
#define DEFINE_ROW_Q4(NAME, ACT, HALF)                                                                       \
    static inline __attribute__((always_inline)) void NAME(const uint8_t *q, const ACT *a, int64_t k,         \
                                                           const int64_t M, const float *sc, const float *zo, \
                                                           int64_t zp, const int64_t G, float *y, int64_t n) { \
        __m256 halves[2][MAX_ROWS];                                                                           \
        HALVES(c) HALF(q, a, k, M, sc, zo, zp, G, c, halves[c]);                                              \
        reduce_rows(halves[0], halves[1], M, y, n);                                                           \
    }

/* half c of AVX-512's lanes of one weight row's dot with M rows, before the final sum: blocks alternate
 * between two chains as there, then each row adds (or, zero points, takes off) its offsets term */
static inline __attribute__((always_inline)) void half_q4(const uint8_t *q, const struct act8 *a, int64_t k,
                                                          const int64_t M, const float *sc, const float *zo,
                                                          int64_t zp, const int64_t G, const int c, __m256 *out) {
    __m256 f[MAX_ROWS], h[MAX_ROWS];
    for (int64_t r = 0; r < M; r++) f[r] = h[r] = _mm256_setzero_ps();
    int64_t pairs = k / 128, p = 0;
    for (; p + 2 <= pairs; p += 2) {
        pair_q4(q, a, M, sc, G, p, 0, c, f);
        pair_q4(q, a, M, sc, G, p + 1, 0, c, h);
    }
    if (p < pairs) pair_q4(q, a, M, sc, G, p++, 0, c, f);
    if (k % 128) pair_q4(q, a, M, sc, G, p, 1, c, h);
    finish_half(f, h, M, sc, zo, a->sums, k, G, zp, c, out);
}

DEFINE_ROW_Q4(row_q4_8, struct act8, half_q4)

/* ---- several rows (prefill, batched decode): one weight row against TILE_ROWS activation rows ---- */

/* Where a call has many rows, row_q4_8's loop (one weight row against 8 rows, two chains of sums each: 16
 * accumulators in AVX2's 16 registers) spilled its sums, and rebuilt each row's scale lanes (a broadcast
 * and a permute) for every weight row. Here each activation row's scale lanes are laid out once per call,
 * and each chain of sums runs to its end before the other starts (the chains are independent sums, added
 * only at the end), so TILE_ROWS sums stay in registers. Every output takes the same integer sums and the
 * same fp32 operations in the same order as in row_q4_8, so a row's bits do not depend on which loop served
 * it (tests/codegen/test_cpu_native.py). */
#define TILE_ROWS 4

/* the weights' scale lanes of half c of pair p (`half`: its first block alone), as pair_q4 multiplies them
 * by the activations' (quads(s4 * x4) is quads(s4) * quads(x4), lane by lane the same products) */
static inline __m256 pair_scales(const float *sc, const int64_t G, int64_t p, int half, const int c) {
    if (G == 32 && half) {
        __m128 ab = _mm_castpd_ps(_mm_load_sd((const double *)(sc + 4 * p)));   /* [a, b, 0, 0] */
        return quads(_mm256_set_m128(ab, ab), c);
    }
    if (G == 32) return quads(twice(sc + 4 * p), c);
    return _mm256_set1_ps(G != 64 ? sc[p * 128 / G] : half && c ? 0.f : sc[2 * p + c]);
}

/* pair_q4's step, pair p (`half`: its first block alone) of half c, against A rows (codes a->codes, scale
 * lanes x, `steps` of them a row) */
static inline __attribute__((always_inline)) void step_q4(const uint8_t *q, const float *sc, const struct act8 *a,
                                                          const __m256 *x, int64_t steps, const int64_t A,
                                                          const int64_t G, int64_t p, int half, const int c,
                                                          __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256i v = half && c ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(q + 64 * p + 32 * c));
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    __m256 s = pair_scales(sc, G, p, half, c);
    const int8_t *codes = a->codes + 128 * p + 32 * c;
    for (int64_t r = 0; r < A; r++) {
        const int8_t *xr = codes + r * a->kp;
        __m256i d = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)),
                                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 64)))),
                                      ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s, x[r * steps + 2 * p + c]), acc[r]);
    }
}

/* one chain of half c of a weight row's sums against A rows: pairs p0, p0 + 2, .. below `end`, then (`last`)
 * the half pair `end` */
static inline __attribute__((always_inline)) void chain_q4(const uint8_t *q, const float *sc, const struct act8 *a,
                                                           const __m256 *x, const int64_t A, const int64_t G,
                                                           int64_t p0, int64_t end, int last, const int c,
                                                           __m256 *out) {
    const int64_t steps = a->kp / 128 * 2;
    __m256 acc[TILE_ROWS];
    for (int64_t r = 0; r < A; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t p = p0; p < end; p += 2) step_q4(q, sc, a, x, steps, A, G, p, 0, c, acc);
    if (last) step_q4(q, sc, a, x, steps, A, G, end, 1, c, acc);
    for (int64_t r = 0; r < A; r++) out[r] = acc[r];
}

/* offsets' lanes for A rows at once: each group's weight term formed once for all of them, the rows' sums
 * independent chains (one row's chain at a time waited on the FMA's latency), each row's the same
 * operations in the same order as offsets' */
static inline __attribute__((always_inline)) void offsets_rows(const float *sc, const float *zo, const float *sums,
                                                               const int64_t A, int64_t k, const int64_t G, int64_t zp,
                                                               const int c, __m256 *t) {
    int64_t groups = k / G;
    for (int64_t r = 0; r < A; r++) t[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < groups; i += 16) {
        int64_t at = i + 8 * c, live = groups - at;
        if (live >= 8) {
            __m256 p = _mm256_loadu_ps(zo + at);
            if (zp) p = _mm256_mul_ps(p, _mm256_loadu_ps(sc + at));
            for (int64_t r = 0; r < A; r++) t[r] = _mm256_fmadd_ps(p, _mm256_loadu_ps(sums + r * groups + at), t[r]);
        } else {
            __m256 p = load_live(zo + at, live);
            if (zp) p = _mm256_mul_ps(p, load_live(sc + at, live));
            for (int64_t r = 0; r < A; r++) t[r] = _mm256_fmadd_ps(p, load_live(sums + r * groups + at, live), t[r]);
        }
    }
}

/* y[r * n] for one weight row against A rows: row_q4_8's sums, chain by chain */
static inline __attribute__((always_inline)) void tile_q4_8(const uint8_t *q, const struct act8 *a, const __m256 *x,
                                                            int64_t k, const int64_t A, const float *sc,
                                                            const float *zo, int64_t zp, const int64_t G, float *y,
                                                            int64_t n) {
    __m256 f[TILE_ROWS], h[TILE_ROWS], halves[2][TILE_ROWS];
    int64_t pairs = k / 128;
    HALVES(c) {
        __m256 t[TILE_ROWS];
        chain_q4(q, sc, a, x, A, G, 0, pairs, 0, c, f);
        chain_q4(q, sc, a, x, A, G, 1, pairs, k % 128 != 0, c, h);
        offsets_rows(sc, zo, a->sums, A, k, G, zp, c, t);
        for (int64_t r = 0; r < A; r++) {
            __m256 total = _mm256_add_ps(f[r], h[r]);
            halves[c][r] = zp ? _mm256_sub_ps(total, t[r]) : _mm256_add_ps(total, t[r]);
        }
    }
    reduce_rows(halves[0], halves[1], A, y, n);
}

/* Activation rows a tile holds: as many as keep their codes within 16 KiB (their scale lanes another 8), so
 * that with the weight row they stay in L1 for every weight row; whole TILE_ROWS where more than one. At
 * 32 KiB of codes the loop read them from L2 and ran no faster than row_q4_8 (2-core Zen 3, Llama-3B's
 * 3072 x 8192: 256 rows 1.47x row_q4_8's rate at 16 KiB; 8192 x 3072 1.13x) */
static inline int64_t tile_rows(int64_t kp) {
    int64_t rows = (16 << 10) / kp;
    return rows > TILE_ROWS ? rows / TILE_ROWS * TILE_ROWS : rows > 1 ? rows : 1;
}

/* weight rows a thread takes through every tile before the next ones: they stay in L2 (96 KiB of Llama-3B's
 * 3072-wide rows), so each is read from memory once however many rows the call has, while each tile's
 * activations come from L3 once a block */
#define WEIGHT_BLOCK 64

/* gemv_q4_int8.h's loop for m >= 2 activation rows: one parallel region (a region per tile spent 12% of a
 * prefill in OpenMP's barriers), weight rows in blocks, each block through every tile of rows */
#define TILES_Q4_8 tiles_q4_8
static int tiles_q4_8(const struct act8 *a, int64_t m, const uint8_t *q, const void *s, const void *o, int64_t o_row,
                      int64_t f16, int64_t zp, int64_t n, int64_t k, int64_t group, float *y, int64_t threads) {
    const int64_t groups = k / group, steps = a->kp / 128 * 2, tile = tile_rows(a->kp), per_row = 2 * groups + 32;
    __m256 *lanes = aligned_alloc(32, m * steps * sizeof(__m256));
    float *params = malloc(threads * WEIGHT_BLOCK * per_row * sizeof(float));
    if (!lanes || !params) {
        free(lanes);
        free(params);
        return 0;
    }
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < steps; i++)
            lanes[r * steps + i] = quads(twice(a->scale + r * (a->kp / BLOCK8) + 4 * (i / 2)), (int)(i % 2));
    /* blocks of at most WEIGHT_BLOCK rows, as many as a multiple of the threads: SmolLM2's 576 rows in 9 blocks
     * of 64 left one of 2 threads idle a ninth of each call (14% of a batched decode in OpenMP's waits) */
    const int64_t count = (n + threads * WEIGHT_BLOCK - 1) / (threads * WEIGHT_BLOCK) * threads,
                  block = (n + count - 1) / count;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j0 = 0; j0 < n; j0 += block) {
        int64_t j1 = j0 + block < n ? j0 + block : n;
        float *buf = params + omp_get_thread_num() * WEIGHT_BLOCK * per_row;
        const float *sc[WEIGHT_BLOCK], *zo[WEIGHT_BLOCK];
        for (int64_t j = j0; j < j1; j++) {
            sc[j - j0] = params_f32(s, f16, j * groups, groups, buf + (j - j0) * per_row);
            zo[j - j0] = params_f32(o, f16, j * o_row, groups, buf + (j - j0) * per_row + groups + 16);
        }
        for (int64_t t0 = 0; t0 < m; t0 += tile) {
            int64_t t1 = t0 + tile < m ? t0 + tile : m;
            for (int64_t j = j0; j < j1; j++) {
                const uint8_t *row = q + j * (k / 2);
                if (t0 == 0 && j + 1 < n)   /* the next row from memory while this one runs: chains skip lines */
                    for (int64_t c = 0; c < k / 2; c += 64) __builtin_prefetch(row + k / 2 + c, 0, 3);
                for (int64_t r0 = t0; r0 < t1; r0 += TILE_ROWS) {
                    struct act8 sub = rows8(a, r0, k, group);
                    const __m256 *x = lanes + r0 * steps;
                    int64_t rows = t1 - r0 < TILE_ROWS ? t1 - r0 : TILE_ROWS;
                    const float *p = sc[j - j0], *po = zo[j - j0];
#define TILE(M, G) tile_q4_8(row, &sub, x, k, M, p, po, zp, G, y + r0 * n + j, n)
#define TILE_CASE(M) case M: if (group == 32) TILE(M, 32); else TILE(M, group); break;
                    switch (rows) { TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) }   /* TILE_ROWS */
#undef TILE_CASE
#undef TILE
                }
            }
        }
    }
    free(lanes);
    free(params);
    return 1;
}

/* ---- int16 activations: per block of 64, codes round(x * 32767 / max|x|) (gemv_int16.c's quantise_row) ---- */

/* one row's int16 codes (vcvtps2dq, then saturated to int16 as AVX-512's vpmovsdw: nan is -32768, its scale
 * nan), in nibble order for the 4-bit GEMV (a block's 32 even codes, then its 32 odd ones), block scales
 * and (sums not NULL) the group sums of the unrounded activations */
static void quantise_row(const float *x, int64_t k, int64_t group, int nibbles, int16_t *codes, float *scale,
                         float *sums) {
    const __m256 sign = _mm256_set1_ps(-0.f), finite = _mm256_set1_ps(FLT_MAX);
    const __m256i lowest = _mm256_set1_epi32(-32768), highest = _mm256_set1_epi32(32767);
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m256 v[8], top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int u = 0; u < 8; u++) {
            v[u] = _mm256_loadu_ps(x + b * BLOCK + 8 * u);
            __m256 a = _mm256_andnot_ps(sign, v[u]);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, finite, _CMP_NLE_UQ));
            top = _mm256_max_ps(top, a);
        }
        int nonfinite = _mm256_movemask_ps(bad) != 0;
        float amax = max8(top);
        scale[b] = nonfinite ? NAN : amax / 32767.f;
        __m256 inv = _mm256_set1_ps(nonfinite || amax == 0.f ? 0.f : 32767.f / amax), s8 = _mm256_set1_ps(scale[b]);
        int tiny = !nonfinite && amax > 0.f && amax < 1e-30f;   /* near where 32767 / amax overflows: divide */
        int32_t c[BLOCK];
        for (int u = 0; u < 8; u++) {
            __m256 f = tiny ? _mm256_div_ps(v[u], s8) : _mm256_mul_ps(v[u], inv);
            _mm256_storeu_si256((__m256i *)(c + 8 * u),
                                _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(f), highest), lowest));
        }
        int16_t *block = codes + b * BLOCK;
        for (int i = 0; i < BLOCK; i++) block[nibbles ? (i % 2) * 32 + i / 2 : i] = (int16_t)c[i];
    }
    if (sums) group_sums(x, k, group, sums);
}

/* f and h [M], two chains of sums (one would wait on the FMA latency): the blocks of 64 along K alternate
 * between them, an odd last one to f, as gemv_int16.c's row_q4 and row_q8 take them; CALL(b, acc) adds
 * block b's products to acc */
#define BLOCK_CHAINS(CALL)                                                   \
    __m256 f[MAX_ROWS], h[MAX_ROWS];                                         \
    for (int64_t r = 0; r < M; r++) f[r] = h[r] = _mm256_setzero_ps();       \
    int64_t blocks = k / BLOCK, b = 0;                                       \
    for (; b + 2 <= blocks; b += 2) {                                        \
        CALL(b, f);                                                          \
        CALL(b + 1, h);                                                      \
    }                                                                        \
    if (b < blocks) CALL(b, f);

/* half c of one block of 64 4-bit codes (32 bytes) against M rows, as gemv_int16.c's block_q4 computes
 * AVX-512's lanes 8c..8c + 7: lane l sums bytes 2l and 2l + 1, codes 4l..4l + 3; for groups of 32 the
 * block's lanes 0-7 take its first group's scale, 8-15 its second's */
static inline __attribute__((always_inline)) void block_q4(const uint8_t *q, const struct act16 *a, int64_t k,
                                                           const int64_t M, const float *sc, const int64_t G,
                                                           int64_t b, const int c, __m256 *acc) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 32 * b + 16 * c)));
    __m256i lo = _mm256_and_si256(w, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(w, 4);
    __m256 s = _mm256_set1_ps(G == 32 ? sc[2 * b + c] : sc[b * BLOCK / G]);
    for (int64_t r = 0; r < M; r++) {
        const int16_t *x = a->codes + r * k + BLOCK * b + 16 * c;
        __m256i d = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                                     _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))));
        __m256 both = _mm256_mul_ps(s, _mm256_set1_ps(a->scale[r * (k / BLOCK) + b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), both, acc[r]);
    }
}

static inline __attribute__((always_inline)) void half_q4_16(const uint8_t *q, const struct act16 *a, int64_t k,
                                                             const int64_t M, const float *sc, const float *zo,
                                                             int64_t zp, const int64_t G, const int c, __m256 *out) {
#define Q4_BLOCK(b, acc) block_q4(q, a, k, M, sc, G, b, c, acc)
    BLOCK_CHAINS(Q4_BLOCK)
#undef Q4_BLOCK
    finish_half(f, h, M, sc, zo, a->sums, k, G, zp, c, out);
}

DEFINE_ROW_Q4(row_q4, struct act16, half_q4_16)

/* half c of one block of 64 int8 codes against M rows, as gemv_int16.c's block_q8: lane l sums codes 2l,
 * 2l + 1 and (one sum for larger groups) 32 + 2l, 33 + 2l; for groups of 32 each half scaled by its own
 * group's scale before the block's activation scale */
static inline __attribute__((always_inline)) void block_q8(const int8_t *q, const struct act16 *a, int64_t k,
                                                           const int64_t M, const float *sc, const int64_t G,
                                                           int64_t b, const int c, __m256 *acc) {
    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + BLOCK * b + 16 * c)));
    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + BLOCK * b + 32 + 16 * c)));
    for (int64_t r = 0; r < M; r++) {
        const int16_t *x = a->codes + r * k + BLOCK * b + 16 * c;
        __m256i d0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x));
        __m256i d1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 32)));
        __m256 s = _mm256_set1_ps(a->scale[r * (k / BLOCK) + b]);
        if (G == 32) {
            __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(sc[2 * b]));
            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(sc[2 * b + 1]), t);
            acc[r] = _mm256_fmadd_ps(t, s, acc[r]);
        } else {
            __m256i d = _mm256_add_epi32(d0, d1);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s, _mm256_set1_ps(sc[b * BLOCK / G])),
                                     acc[r]);
        }
    }
}

static inline __attribute__((always_inline)) void half_q8(const int8_t *q, const struct act16 *a, int64_t k,
                                                          const int64_t M, const float *sc, const int64_t G,
                                                          const int c, __m256 *out) {
#define Q8_BLOCK(b, acc) block_q8(q, a, k, M, sc, G, b, c, acc)
    BLOCK_CHAINS(Q8_BLOCK)
#undef Q8_BLOCK
    for (int64_t r = 0; r < M; r++) out[r] = _mm256_add_ps(f[r], h[r]);
}

static inline __attribute__((always_inline)) void row_q8(const int8_t *q, const struct act16 *a, int64_t k,
                                                         const int64_t M, const float *sc, const int64_t G,
                                                         float *y, int64_t n) {
    __m256 halves[2][MAX_ROWS];
    HALVES(c) half_q8(q, a, k, M, sc, G, c, halves[c]);
    reduce_rows(halves[0], halves[1], M, y, n);
}

#include "gemv_int16.h"
#include "gemv_q4_int8.h"

#endif
