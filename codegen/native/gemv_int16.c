/* llmc's 4-bit and int8 GEMVs on int16 activations (AVX-512 BW; VNNI's vpdpwssd where the CPU has it),
 * which llmc_gemv_q4 and llmc_gemv_q8 (decode_kernels.c) hand their work to where the shapes allow.
 *
 * Each call quantises its few rows of activations once, per block of 64 along K, to int16 codes
 * round(x * 32767 / max|x|): an error of at most 2^-16 of the block's largest magnitude (the bf16 that
 * torch's own int8 GEMV rounds activations to errs by up to 2^-9 of each value; llama.cpp's 8-bit
 * activation codes by 2^-8 of a block's largest). The weight codes then multiply in integer lanes: a
 * block of 64 4-bit codes costs a widen, a mask, a shift and two multiply-adds (vpmaddwd, vpdpwssd)
 * instead of four table lookups and four FMAs on floats, which left the fp32-activation loop
 * compute-bound (4.8 cycles per 32 codes in cache on an AVX-512 Xeon, over twice what its bytes cost
 * from memory). Each block's integer sums are converted once and scaled by the weight group's scale
 * times the block's activation scale; a group's zero point or offset enters as o_g * sum_{i in g} x_i,
 * with the sums taken over the unrounded activations. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int64_t enabled = 1;

/* whether the GEMVs take integer activations (int16 codes, or int8 where a 4-bit GEMV is asked for them) where
 * they can (1, the default) or stay on fp32 ones (0); -1 only asks. Returns the setting before (the tests
 * and bench/decode_step.py compare the two). */
int64_t llmc_gemv_int16(int64_t on) {
    int64_t was = enabled;
    if (on >= 0) enabled = on;
    return was;
}

/* whether this build has them (AVX-512 BW here, or AVX2 in gemv_avx2.c) */
int64_t llmc_gemv_int16_built(void) {
#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BW__)
#include <immintrin.h>

#include "gemv_rows.h"

#ifdef __AVX512VNNI__
#define DPWSSD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DPWSSD(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

/* The even and the odd lanes of two vectors of 16 (a, b): lanes 0-7 from a, 8-15 from b. The 4-bit codes
 * lie as stored (byte j: codes 2j low, 2j + 1 high), so one widen of weight bytes unpacks the even codes
 * (low nibbles) and the odd ones (high): the activations they multiply are laid out evens, then odds. */
static inline __m512 evens(__m512 a, __m512 b) {
    return _mm512_permutex2var_ps(a, _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), b);
}
static inline __m512 odds(__m512 a, __m512 b) {
    return _mm512_permutex2var_ps(a, _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1), b);
}

/* a block's 64 activations in the order its weights unpack: in order for the int8 GEMV; for the 4-bit
 * one its 32 even codes, then its 32 odd ones (the low and high nibbles of the block's 32 weight bytes) */
static inline void nibble_order(__m512 v[4]) {
    __m512 e0 = evens(v[0], v[1]), e1 = evens(v[2], v[3]), o0 = odds(v[0], v[1]), o1 = odds(v[2], v[3]);
    v[0] = e0, v[1] = e1, v[2] = o0, v[3] = o1;
}

/* a block of 64 activations loaded into v, its largest magnitude returned; *bad flags inf or nan lanes */
static inline float block_top(const float *x, __m512 v[4], __mmask16 *bad) {
    const __m512 finite = _mm512_set1_ps(FLT_MAX);
    __m512 top = _mm512_setzero_ps();
    *bad = 0;
    for (int u = 0; u < 4; u++) {
        v[u] = _mm512_loadu_ps(x + 16 * u);
        __m512 a = _mm512_abs_ps(v[u]);
        *bad |= _mm512_cmp_ps_mask(a, finite, _CMP_NLE_UQ);
        top = _mm512_max_ps(top, a);
    }
    return _mm512_reduce_max_ps(top);
}

static void quantise_row(const float *x, int64_t k, int64_t group, int nibbles, int16_t *codes, float *scale,
                         float *sums) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m512 v[4];
        __mmask16 bad;
        float amax = block_top(x + b * BLOCK, v, &bad);
        scale[b] = bad ? NAN : amax / 32767.f;   /* a non-finite activation makes every output nan */
        __m512 inv = _mm512_set1_ps(bad || amax == 0.f ? 0.f : 32767.f / amax);
        int tiny = !bad && amax > 0.f && amax < 1e-30f;   /* near where 32767 / amax overflows: divide */
        if (nibbles) nibble_order(v);
        for (int u = 0; u < 4; u++) {
            __m512 c = tiny ? _mm512_div_ps(v[u], _mm512_set1_ps(scale[b])) : _mm512_mul_ps(v[u], inv);
            _mm256_storeu_si256((__m256i *)(codes + b * BLOCK + 16 * u),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(c)));
        }
    }
    if (sums) group_sums(x, k, group, sums);
}

static inline __m512 block_scale(const struct act16 *a, int64_t r, int64_t blocks, int64_t b, __m512 s) {
    return _mm512_mul_ps(s, _mm512_set1_ps(a->scale[r * blocks + b]));
}

/* one block of 64 4-bit codes (32 bytes) against M rows' codes: acc[r] += its scaled dot. Lane l sums
 * bytes 2l and 2l + 1, codes 4l..4l + 3. The groups' scales come from sc: for groups of 32 the block's
 * lanes 0-7 are its first group's and 8-15 its second's, so each half takes its own. */
static inline __attribute__((always_inline)) void block_q4(const uint8_t *q, const struct act16 *a, int64_t k,
                                                           const int64_t M, const float *sc, const int64_t G,
                                                           int64_t b, __m512 *acc) {
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * b)));
    __m512i lo = _mm512_and_si512(w, _mm512_set1_epi16(15)), hi = _mm512_srli_epi16(w, 4);
    __m512 s = G == 32 ? _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(
                             _mm_castpd_ps(_mm_load_sd((const double *)(sc + 2 * b)))))
                       : _mm512_set1_ps(sc[b * BLOCK / G]);
    for (int64_t r = 0; r < M; r++) {
        const int16_t *x = a->codes + r * k + BLOCK * b;
        __m512i d = DPWSSD(_mm512_madd_epi16(lo, _mm512_loadu_si512(x)), hi, _mm512_loadu_si512(x + 32));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), block_scale(a, r, k / BLOCK, b, s), acc[r]);
    }
}

/* lanes summing to row r's sum_g o_g * sum_{i in g} x_i (o_g = s_g * z_g where zp, else the offset m_g),
 * from the weights' scales sc and zero points or offsets zo and the activations' group sums */
static inline __m512 offsets(const float *sc, const float *zo, const float *sums, int64_t r, int64_t k, int64_t G,
                             int64_t zp) {
    int64_t groups = k / G;
    __m512 t = _mm512_setzero_ps();
    for (int64_t i = 0; i < groups; i += 16) {
        __mmask16 live = groups - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - i)) - 1);
        __m512 p = _mm512_maskz_loadu_ps(live, zo + i);
        if (zp) p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(live, sc + i));   /* s * z */
        t = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(live, sums + r * groups + i), t);
    }
    return t;
}

/* y[r * n] = row r's two chains of block sums, plus (offsets) or minus (zero points) its offsets term */
static inline __attribute__((always_inline)) void finish_q4(const __m512 *f, const __m512 *h, const int64_t M,
                                                            const float *sc, const float *zo, const float *sums,
                                                            int64_t k, const int64_t G, int64_t zp, float *y,
                                                            int64_t n) {
    for (int64_t r = 0; r < M; r++) {
        __m512 total = _mm512_add_ps(f[r], h[r]), t = offsets(sc, zo, sums, r, k, G, zp);
        y[r * n] = _mm512_reduce_add_ps(zp ? _mm512_sub_ps(total, t) : _mm512_add_ps(total, t));
    }
}

/* y[r * n] = one weight row's dot with M rows: blocks alternate between two chains (one waits on the FMA
 * latency), then each row adds sum_g o_g * sum_{i in g} x_i, o_g = -s_g * z_g or the offset m_g */
static inline __attribute__((always_inline)) void row_q4(const uint8_t *q, const struct act16 *a, int64_t k,
                                                         const int64_t M, const float *sc, const float *zo,
                                                         int64_t zp, const int64_t G, float *y, int64_t n) {
    __m512 f[MAX_ROWS], h[MAX_ROWS];
    for (int64_t r = 0; r < M; r++) f[r] = h[r] = _mm512_setzero_ps();
    int64_t blocks = k / BLOCK, b = 0;
    for (; b + 2 <= blocks; b += 2) {
        block_q4(q, a, k, M, sc, G, b, f);
        block_q4(q, a, k, M, sc, G, b + 1, h);
    }
    if (b < blocks) block_q4(q, a, k, M, sc, G, b, f);
    finish_q4(f, h, M, sc, zo, a->sums, k, G, zp, y, n);
}

/* one block of 64 int8 codes against M rows' codes: for groups of 32 each half scaled by its own group's
 * scale before the block's activation scale, else one sum and the group's scale */
static inline __attribute__((always_inline)) void block_q8(const int8_t *q, const struct act16 *a, int64_t k,
                                                           const int64_t M, const float *sc, const int64_t G,
                                                           int64_t b, __m512 *acc) {
    __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + BLOCK * b)));
    __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + BLOCK * b + 32)));
    for (int64_t r = 0; r < M; r++) {
        const int16_t *x = a->codes + r * k + BLOCK * b;
        __m512i d0 = _mm512_madd_epi16(w0, _mm512_loadu_si512(x));
        __m512 s = _mm512_set1_ps(a->scale[r * (k / BLOCK) + b]);
        if (G == 32) {
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(d0), _mm512_set1_ps(sc[2 * b]));
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w1, _mm512_loadu_si512(x + 32))),
                                _mm512_set1_ps(sc[2 * b + 1]), t);
            acc[r] = _mm512_fmadd_ps(t, s, acc[r]);
        } else {
            __m512i d = DPWSSD(d0, w1, _mm512_loadu_si512(x + 32));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_set1_ps(sc[b * BLOCK / G])), acc[r]);
        }
    }
}

static inline __attribute__((always_inline)) void row_q8(const int8_t *q, const struct act16 *a, int64_t k,
                                                         const int64_t M, const float *sc, const int64_t G,
                                                         float *y, int64_t n) {
    __m512 f[MAX_ROWS], h[MAX_ROWS];
    for (int64_t r = 0; r < M; r++) f[r] = h[r] = _mm512_setzero_ps();
    int64_t blocks = k / BLOCK, b = 0;
    for (; b + 2 <= blocks; b += 2) {
        block_q8(q, a, k, M, sc, G, b, f);
        block_q8(q, a, k, M, sc, G, b + 1, h);
    }
    if (b < blocks) block_q8(q, a, k, M, sc, G, b, f);
    for (int64_t r = 0; r < M; r++) y[r * n] = _mm512_reduce_add_ps(_mm512_add_ps(f[r], h[r]));
}

/* ---- the 4-bit GEMV on int8 activations, llama.cpp's rounding (its Q8 activation blocks of 32) ----
 *
 * Activations round to int8 codes round(x * 127 / max|x|) per block of 32 (an error of up to 2^-8 of the
 * block's largest magnitude, as llama.cpp's Q8_0/Q8_1 activations, whose scales are fp16 where these are
 * fp32; the int16 path's is 2^-16 of a block of 64; a group's offset term takes the rounded activations'
 * sum, as Q8_1's, see quantise_row8), so that the unsigned 4-bit codes multiply them four
 * at a time into int32 lanes: 64 weight bytes (128 codes) cost a mask, a shift and two vpdpbusd, one
 * conversion and one FMA per row, against twice that per 32 bytes on int16 codes. On the 2-core Xeon that
 * took the GEMV over weights in DRAM (0.88 GB on huge pages) from 13.5 to 18.2 GB/s against torch.mv's 22
 * (the software prefetch off where the weights are in DRAM: see llmc_gemv_q4_int8), and a Llama-3B prefill
 * of 512 tokens 1.5x. Without VNNI the
 * same integer sums come from vpmaddubsw + vpmaddwd: a pair of products of a 4-bit and an int8 code is at
 * most 2 * 15 * 127, inside int16, so nothing saturates and the results are the same bits. */

#ifdef __AVX512VNNI__
#define DPBUSD(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#else
#define DPBUSD(acc, u, s) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#endif

/* the largest magnitudes of a block of 64's two halves (v loaded as block_top loads it); bad[h] flags inf
 * or nan lanes in half h */
static inline void half_tops(const float *x, __m512 v[4], float top[2], __mmask16 bad[2]) {
    const __m512 finite = _mm512_set1_ps(FLT_MAX);
    for (int h = 0; h < 2; h++) {
        v[2 * h] = _mm512_loadu_ps(x + 32 * h);
        v[2 * h + 1] = _mm512_loadu_ps(x + 32 * h + 16);
        __m512 a = _mm512_abs_ps(v[2 * h]), b = _mm512_abs_ps(v[2 * h + 1]);
        bad[h] = _mm512_cmp_ps_mask(a, finite, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(b, finite, _CMP_NLE_UQ);
        top[h] = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
    }
}

/* row x's int8 codes and block scales, and its group sums: of the rounded activations (each block's scale
 * times its codes' sum), as llama.cpp's Q8_1 keeps them. With 4-bit codes q in 0..15 the weights are
 * w = q * s + o, o near -8 s; the rounding errors e then enter as sum w e when the sums are the rounded
 * ones, against s * sum q e (uncentred q) with the unrounded ones: 2.5x the error on SmolLM2's projections. */
static void quantise_row8(const float *x, int64_t k, int64_t kp, int64_t group, int8_t *codes, float *scale,
                          float *sums) {
    memset(codes + k, 0, kp - k);
    for (int64_t i = k / BLOCK8; i < kp / BLOCK8; i++) scale[i] = 0.f;
    for (int64_t g = 0; g < k / group; g++) sums[g] = 0.f;
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m512 v[4];
        __mmask16 bad[2];
        float top[2];
        half_tops(x + b * BLOCK, v, top, bad);
        __m512 inv[2];
        int tiny[2];
        for (int h = 0; h < 2; h++) {
            scale[2 * b + h] = bad[h] ? NAN : top[h] / 127.f;   /* a non-finite activation makes every output nan */
            inv[h] = _mm512_set1_ps(bad[h] || top[h] == 0.f ? 0.f : 127.f / top[h]);
            tiny[h] = !bad[h] && top[h] > 0.f && top[h] < 1e-30f;   /* near where 127 / top overflows: divide */
        }
        /* after nibble_order: v[0], v[2] the first half's evens and odds, v[1], v[3] the second's. Block b's
         * evens go to its pair's evens (the first or second 32 of them), its odds to the odds. */
        nibble_order(v);
        int8_t *pair = codes + (b / 2) * 128 + (b % 2) * 32;
        __m512i total[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int u = 0; u < 4; u++) {
            int h = u % 2;
            __m512 c = tiny[h] ? _mm512_div_ps(v[u], _mm512_set1_ps(scale[2 * b + h])) : _mm512_mul_ps(v[u], inv[h]);
            __m512i q = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(c), _mm512_set1_epi32(127)),
                                         _mm512_set1_epi32(-128));   /* what the saturating store keeps */
            total[h] = _mm512_add_epi32(total[h], q);
            _mm_storeu_si128((__m128i *)(pair + (u / 2) * 64 + h * 16), _mm512_cvtepi32_epi8(q));
        }
        for (int h = 0; h < 2; h++) {   /* fmaf: one rounding, whether or not the compiler contracts */
            float *sum = sums + (b * BLOCK + h * BLOCK8) / group;
            *sum = fmaf(scale[2 * b + h], (float)_mm512_reduce_add_epi32(total[h]), *sum);
        }
    }
}

/* 128 codes (64 bytes: blocks 2p and 2p + 1; `half`: block 2p alone, the row's last 64 codes) against M
 * rows: dpbusd lane l sums bytes 4l..4l+3, codes 8l..8l + 7, of activation block 4p + l / 4; so the
 * activations' scales, and groups of 32's, take lanes in fours, groups of 64 in eights */
static inline __attribute__((always_inline)) void pair_q4(const uint8_t *q, const struct act8 *a, const int64_t M,
                                                          const float *sc, const int64_t G, int64_t p, int half,
                                                          __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i quads = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512i w = half ? _mm512_maskz_loadu_epi8(0xffffffffull, q + 64 * p) : _mm512_loadu_si512(q + 64 * p);
    __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
    __m128 s4 = _mm_setzero_ps();
    __m512 s = _mm512_setzero_ps();
    if (G == 32)
        s4 = half ? _mm_maskz_loadu_ps(3, sc + 4 * p) : _mm_loadu_ps(sc + 4 * p);
    else if (G == 64)
        s = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                  _mm512_castps128_ps512(half ? _mm_maskz_loadu_ps(1, sc + 2 * p)
                                                              : _mm_castpd_ps(_mm_load_sd((const double *)(sc + 2 * p)))));
    else
        s = _mm512_set1_ps(sc[p * 128 / G]);
    for (int64_t r = 0; r < M; r++) {
        const int8_t *x = a->codes + r * a->kp + 128 * p;
        __m512i d = DPBUSD(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
        d = DPBUSD(d, hi, _mm512_loadu_si512(x + 64));
        __m128 x4 = _mm_loadu_ps(a->scale + r * (a->kp / BLOCK8) + 4 * p);
        __m512 both = G == 32 ? _mm512_permutexvar_ps(quads, _mm512_castps128_ps512(_mm_mul_ps(s4, x4)))
                              : _mm512_mul_ps(s, _mm512_permutexvar_ps(quads, _mm512_castps128_ps512(x4)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), both, acc[r]);
    }
}

static inline __attribute__((always_inline)) void row_q4_8(const uint8_t *q, const struct act8 *a, int64_t k,
                                                           const int64_t M, const float *sc, const float *zo,
                                                           int64_t zp, const int64_t G, float *y, int64_t n) {
    __m512 f[MAX_ROWS], h[MAX_ROWS];
    for (int64_t r = 0; r < M; r++) f[r] = h[r] = _mm512_setzero_ps();
    int64_t pairs = k / 128, p = 0;
    for (; p + 2 <= pairs; p += 2) {
        pair_q4(q, a, M, sc, G, p, 0, f);
        pair_q4(q, a, M, sc, G, p + 1, 0, h);
    }
    if (p < pairs) pair_q4(q, a, M, sc, G, p++, 0, f);
    if (k % 128) pair_q4(q, a, M, sc, G, p, 1, h);
    finish_q4(f, h, M, sc, zo, a->sums, k, G, zp, y, n);
}

#include "gemv_int16.h"   /* llmc_gemv_q4_int16 and llmc_gemv_q8_int16 over quantise_row, row_q4 and row_q8 */
#include "gemv_q4_int8.h"   /* llmc_gemv_q4_int8 over quantise_row8 and row_q4_8 above */

#elif !(defined(__AVX2__) && defined(__FMA__))   /* neither AVX-512 BW nor AVX2 (gemv_avx2.c): the fp32-activation
                                                  * loops of decode_kernels.c do all the work */

int64_t llmc_gemv_q4_int8_fits(int64_t k, int64_t group) {
    return 0;
}

int64_t llmc_gemv_q4_int8(const float *x, int64_t x_stride, int64_t m, const uint8_t *q, const void *s,
                          const void *o, int64_t o_row, int64_t f16, int64_t zp, int64_t n, int64_t k, int64_t group,
                          float *y, int64_t threads, int64_t ahead) {
    return 0;
}

int64_t llmc_gemv_q4_int16(const float *x, int64_t x_stride, int64_t m, const uint8_t *q, const void *s,
                           const void *o, int64_t o_row, int64_t f16, int64_t zp, int64_t n, int64_t k, int64_t group,
                           float *y, int64_t threads) {
    return 0;
}

int64_t llmc_gemv_q8_int16(const float *x, int64_t x_stride, int64_t m, const int8_t *q, const void *scales,
                           int64_t f16, int64_t n, int64_t k, int64_t group, float *y, int64_t threads) {
    return 0;
}

#endif
