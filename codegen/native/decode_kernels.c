/* llmc's native CPU kernels for decode-sized work: a few rows of fp32 each, where torch's eager
 * operators cost more in dispatch (2-5 us an operator) than in arithmetic. Built on the user's machine
 * at first use (codegen/native/cpu_native.py: cc -O3 -march=native) and called through ctypes with raw
 * pointers; the Python side checks shapes, dtypes and contiguity before every call. Norms are
 * single-threaded: a decode row's is microseconds of work, less than waking a thread pool. Attention
 * (it reads a layer's cache) and the int8 GEMV (it streams megabytes) split over OpenMP threads: built with
 * -fopenmp it needs libgomp.so.1, which resolves to the copy torch has already loaded, so it shares
 * torch's thread pool rather than adding a second one.
 * Dot products sum in vector lanes, so they round differently from torch's; the tests hold them to
 * float64 and to the torch kernels within fp32 rounding. Norms run here only where a quantised GEMM
 * reads them next (its bf16 activations round far coarser than the sum order); elsewhere they stay in
 * torch, which the fp32 target needs bitwise F.rms_norm's. */

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half_params.h"

#define MAX_ROWS 8   /* cpu_native.MAX_ROWS */

/* gemv_int16.c: the same GEMVs on int16 activations, where the CPU and the shapes allow (1 where done) */
int64_t llmc_gemv_q8_int16(const float *x, int64_t x_stride, int64_t m, const int8_t *q, const void *scales,
                           int64_t f16, int64_t n, int64_t k, int64_t group, float *y, int64_t threads);
int64_t llmc_gemv_q4_int16(const float *x, int64_t x_stride, int64_t m, const uint8_t *q, const void *s,
                           const void *o, int64_t o_row, int64_t f16, int64_t zp, int64_t n, int64_t k, int64_t group,
                           float *y, int64_t threads);
/* and the 4-bit one on int8 activations (llama.cpp's rounding), where the artifact asks for them */
int64_t llmc_gemv_q4_int8(const float *x, int64_t x_stride, int64_t m, const uint8_t *q, const void *s,
                          const void *o, int64_t o_row, int64_t f16, int64_t zp, int64_t n, int64_t k, int64_t group,
                          float *y, int64_t threads, int64_t ahead);

/* rotate-half rotary of one head: y = x * cos + [-x2, x1] * sin */
static void rotate_head(const float *x, const float *cos, const float *sin, float *y, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) y[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int64_t i = half; i < hd; i++) y[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* VL floats in one vector register, loaded and stored unaligned: 16 with AVX-512, 8 with AVX (wider
 * vector types than the machine has compile to memory round trips, 4-5x slower), else 4 */
#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
typedef float vec __attribute__((vector_size(VL * 4), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

/* the sum of a vector's lanes as a tree of halves: a chain of VL scalar adds cost 3x the dot itself */
static inline float hsum(vec x) {
#if VL == 16
    typedef float v8 __attribute__((vector_size(32), aligned(4)));
    v8 h = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 f = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#elif VL == 8
    v4 f = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
#else
    v4 f = x;
#endif
    return (f[0] + f[2]) + (f[1] + f[3]);
}

/* scores[g * stride + i] = scale * q_g . key_i for `n` keys `row` values apart, each key's nv = hd / VL
 * vectors loaded (widened to floats) once by LOAD (nv a constant where inlined, so a key's vectors stay
 * in registers across its query heads); defined for fp32 and bf16 keys */
#define DEFINE_SCORE_KEYS(NAME, T, LOAD)                                                              \
    static inline __attribute__((always_inline)) void NAME(                                           \
            const float *qh, int64_t group, const T *key, int64_t row, int64_t n, float scale,        \
            float *scores, int64_t stride, const int nv) {                                            \
        for (int64_t i = 0; i < n; i++, key += row) {                                                 \
            vec kv[128 / VL];                                                                         \
            for (int c = 0; c < nv; c++) kv[c] = LOAD(key + VL * c);                                  \
            for (int64_t g = 0; g < group; g++) {                                                     \
                const float *qg = qh + g * VL * nv;                                                   \
                vec acc = kv[0] * *(const vec *)qg;                                                   \
                for (int c = 1; c < nv; c++) acc += kv[c] * *(const vec *)(qg + VL * c);              \
                scores[g * stride + i] = hsum(acc) * scale;                                           \
            }                                                                                         \
        }                                                                                             \
    }

/* o_g (nv vectors each) += sum_i p[g * stride + i] * value_i, accumulated in registers (a value loaded
 * once per query head: cheaper than a memory round trip of the accumulators); fp32 and bf16 values */
#define DEFINE_WEIGH_VALUES(NAME, T, LOAD)                                                            \
    static inline __attribute__((always_inline)) void NAME(                                           \
            float *o, int64_t group, const T *value, int64_t row, int64_t n, const float *p,          \
            int64_t stride, const int nv) {                                                           \
        for (int64_t g = 0; g < group; g++) {                                                         \
            vec acc[128 / VL];                                                                        \
            for (int c = 0; c < nv; c++) acc[c] = *(vec *)(o + g * VL * nv + VL * c);                 \
            const T *val = value;                                                                     \
            const float *pg = p + g * stride;                                                         \
            for (int64_t i = 0; i < n; i++, val += row)                                               \
                for (int c = 0; c < nv; c++) acc[c] += pg[i] * LOAD(val + VL * c);                    \
            for (int c = 0; c < nv; c++) *(vec *)(o + g * VL * nv + VL * c) = acc[c];                 \
        }                                                                                             \
    }

static inline vec load_f32(const float *p) { return *(const vec *)p; }
DEFINE_SCORE_KEYS(score_keys, float, load_f32)
DEFINE_WEIGH_VALUES(weigh_values, float, load_f32)

/* e^x for x <= 0 in every lane (softmax's scores less their maximum), within 1.5 ulp on [-87, 0]:
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf polynomial, 2^n built in the exponent bits.
 * Below -87 (where e^x leaves fp32's normal range) lanes give e^-87, ~1e-38: nothing next to the
 * maximum's 1. glibc's expf is scalar without -ffast-math; at SmolLM2's 9 heads and 133 keys it was
 * ~6 of a decode attention call's ~20 us. */
static inline vec exp_nonpositive(vec x) {
    typedef int32_t vint __attribute__((vector_size(VL * 4)));
    const vec lo = x - x - 87.0f;
    vint below = x < lo;   /* lanes all ones where true (C has no vector ?:) */
    x = (vec)(((vint)x & ~below) | ((vint)lo & below));
    vec n = x * 1.44269504088896341f + 12582912.0f;   /* round to nearest: 1.5 * 2^23 */
    n -= 12582912.0f;
    vec r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* ln2 in two parts, the first exact */
    vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
    return p * (vec)bits;
}

/* sg[i] = e^(sg[i] - top) for n scores; returns their sum */
static float exp_shifted(float *sg, int64_t n, float top) {
    vec acc = {0};
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vec e = exp_nonpositive(*(vec *)(sg + i) - top);
        *(vec *)(sg + i) = e;
        acc += e;
    }
    float total = hsum(acc);
    for (; i < n; i++) total += sg[i] = expf(sg[i] - top);
    return total;
}

/* softmax in place over each of `rows` rows of n scores */
static void softmax_rows(float *scores, int64_t rows, int64_t n, float *stats) {
    for (int64_t g = 0; g < rows; g++) {
        float *sg = scores + g * n, top = -INFINITY;
        for (int64_t i = 0; i < n; i++) top = sg[i] > top ? sg[i] : top;
        float total = exp_shifted(sg, n, top), inv = 1.0f / total;
        for (int64_t i = 0; i < n; i++) sg[i] *= inv;
        if (stats) stats[2 * g] = top, stats[2 * g + 1] = total;
    }
}

/* keys from position t that lie together in t's cache block, up to position len - 1 */
static inline int64_t block_run(int64_t t, int64_t len, int64_t block) {
    int64_t left = block - t % block;
    return left < len - t ? left : len - t;
}

/* the cache slot of position t through a sequence's block table */
static inline int64_t slot_of(const int64_t *table, int64_t t, int64_t block) {
    return table[t / block] * block + t % block;
}

/* the first key a decode at position len - 1 sees: 0, or len - window with a sliding window (window > 0) */
static inline int64_t first_key(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* the most keys any of b sequences sees */
static int64_t longest_len(const int32_t *lens, int64_t b) {
    int64_t longest = 0;
    for (int64_t s = 0; s < b; s++) longest = lens[s] > longest ? lens[s] : longest;
    return longest;
}

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* score_keys / weigh_values for head sizes other than 32, 64, 96 and 128 */
static void score_keys_any(const float *qh, int64_t group, const float *key, int64_t row, int64_t n, int64_t hd,
                           float scale, float *scores, int64_t stride) {
    for (int64_t i = 0; i < n; i++, key += row)
        for (int64_t g = 0; g < group; g++) scores[g * stride + i] = dot(qh + g * hd, key, hd) * scale;
}

static void weigh_values_any(float *o, int64_t group, const float *value, int64_t row, int64_t n, int64_t hd,
                             const float *p, int64_t stride) {
    for (int64_t i = 0; i < n; i++, value += row)
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < hd; d++) o[g * hd + d] += p[g * stride + i] * value[d];
}

#define BY_HEAD_SIZE(hd, fast, any)                                                   \
    switch (hd) {                                                                     \
    case 32: fast(32 / VL); break;                                                    \
    case 64: fast(64 / VL); break;                                                    \
    case 96: fast(96 / VL); break;                                                    \
    case 128: fast(128 / VL); break;                                                  \
    default: any;                                                                     \
    }

/* One (sequence, KV head) pair of a decode attention: the group of query heads qh (fp32) scores keys
 * first .. len - 1 of the sequence's blocks (position t at slot table[t / block] * block + t % block),
 * softmax, then o (fp32, group * hd) = the scores' weighing of the values; scores holds group rows of
 * len - first. PREFETCH_NEXT(t) runs before each block's keys are scored. Defined for fp32 and bf16
 * caches; SCORE / WEIGH name one-argument macros of the head-size-specialised kernels (BY_HEAD_SIZE). */
#define DEFINE_ATTEND_KV_HEAD(NAME, T, SCORE, SCORE_ANY, WEIGH, WEIGH_ANY, PREFETCH_NEXT)                       \
    static void NAME(const float *qh, const T *k_cache, const T *v_cache, const int64_t *table, int64_t first,  \
                     int64_t len, int64_t block, int64_t row, int64_t h, int64_t hd, int64_t group,            \
                     float scale, float *scores, float *o, float *stats) {                                     \
        int64_t n = len - first;                                                                               \
        for (int64_t t = first; t < len;) {                                                                    \
            int64_t run = block_run(t, len, block);                                                            \
            const T *key = k_cache + slot_of(table, t, block) * row + h * hd;                                  \
            PREFETCH_NEXT(t);                                                                                  \
            float *at = scores + t - first;                                                                    \
            BY_HEAD_SIZE(hd, SCORE, SCORE_ANY(qh, group, key, row, run, hd, scale, at, n))                     \
            t += run;                                                                                          \
        }                                                                                                      \
        softmax_rows(scores, group, n, stats);                                                                 \
        memset(o, 0, group * hd * sizeof(float));                                                              \
        for (int64_t t = first; t < len;) {                                                                    \
            int64_t run = block_run(t, len, block);                                                            \
            const T *value = v_cache + slot_of(table, t, block) * row + h * hd;                                \
            const float *p = scores + t - first;                                                               \
            BY_HEAD_SIZE(hd, WEIGH, WEIGH_ANY(o, group, value, row, run, hd, p, n))                            \
            t += run;                                                                                          \
        }                                                                                                      \
    }
#define SCORE(nv) score_keys(qh, group, key, row, run, scale, at, n, nv)
#define WEIGH(nv) weigh_values(o, group, value, row, run, p, n, nv)

/* each of `n` rows (`row` floats apart) of a head's `hd` values fetched into L2 */
static inline void prefetch_rows_f32(const float *at, int64_t n, int64_t row, int64_t hd) {
    for (int64_t i = 0; i < n; i++, at += row)
        for (int64_t c = 0; c < hd * (int64_t)sizeof(float); c += 64) __builtin_prefetch((const char *)at + c, 0, 2);
}

/* the next block of this sequence's keys and values into L2 while this one is scored: a sequence's cache
 * blocks lie anywhere, so the hardware prefetcher stops at each block's end */
#define PREFETCH_NEXT_BLOCK_F32(t)                                                                      \
    if ((t) / block + 1 <= (len - 1) / block) {                                                         \
        prefetch_rows_f32(k_cache + table[(t) / block + 1] * block * row + h * hd, block, row, hd);   \
        prefetch_rows_f32(v_cache + table[(t) / block + 1] * block * row + h * hd, block, row, hd);   \
    }
DEFINE_ATTEND_KV_HEAD(attend_kv_head, float, SCORE, score_keys_any, WEIGH, weigh_values_any, PREFETCH_NEXT_BLOCK_F32)

/* Into how many parts of their context the (sequence, KV head) pairs are split, so that `threads` threads
 * get equal shares (flash-decoding): 1 where the pairs divide evenly, else enough parts that they do, each
 * of at least 64 keys, at most 16. SmolLM2 at batch 1 has 3 KV heads for 2 threads: one thread did two
 * heads' work while the other did one. */
static int64_t context_parts(int64_t pairs, int64_t threads, int64_t longest) {
    if (threads <= 1 || pairs % threads == 0) return 1;
    if (longest < 0) {   /* batch-invariant: as for one sequence at any length (its own kv_heads as `pairs`) */
        int64_t a = pairs, c = threads;
        while (c) { int64_t r = a % c; a = c; c = r; }
        return threads / a < 16 ? threads / a : 16;
    }
    int64_t a = pairs, c = threads;
    while (c) { int64_t r = a % c; a = c; c = r; }   /* a = gcd(pairs, threads) */
    int64_t parts = threads / a, most = longest / 64;
    parts = parts < 16 ? parts : 16;
    return parts < most ? parts : (most > 1 ? most : 1);
}

/* out = each pair's query heads' outputs from their parts: part outputs o_p (softmax-normalised over the
 * part's keys) with the part's score maximum m_p and exp sum l_p, weighed by l_p e^(m_p - max m) */
static void merge_parts(const float *partial, int64_t pairs, int64_t parts, int64_t group, int64_t hd, float *out) {
    int64_t part = group * (hd + 2);   /* a part's floats: group outputs of hd, then (max, sum) per head */
    for (int64_t u = 0; u < pairs; u++)
        for (int64_t g = 0; g < group; g++) {
            const float *base = partial + u * parts * part;
            float top = -INFINITY, total = 0.f, w[parts];
            for (int64_t p = 0; p < parts; p++) {
                float m = base[p * part + group * hd + 2 * g];
                top = m > top ? m : top;
            }
            for (int64_t p = 0; p < parts; p++) {
                const float *st = base + p * part + group * hd + 2 * g;
                w[p] = st[1] > 0.f ? st[1] * expf(st[0] - top) : 0.f;
                total += w[p];
            }
            float *o = out + (u * group + g) * hd;
            for (int64_t i = 0; i < hd; i++) o[i] = 0.f;
            for (int64_t p = 0; p < parts; p++) {
                if (w[p] == 0.f) continue;   /* an empty part: its outputs were never written */
                const float *op = base + p * part + g * hd;
                float wp = w[p] / total;
                for (int64_t i = 0; i < hd; i++) o[i] += wp * op[i];
            }
        }
}

/* One decode step of attention for `b` sequences, one new token each, over a paged KV cache of one
 * layer (rows [slots, kv_heads * hd]). Per sequence s: its q/k/v rows (rotated by cos/sin[s] when
 * cos is not NULL), the new key and value stored at cache slot slots[s], then each query head attends
 * to the keys at positions first .. lens[s] - 1 (first = lens[s] - window with a sliding window),
 * position t at slot tables[s][t / block] * block + t % block. Query head j reads KV head
 * j / (heads / kv_heads); a KV head's query heads are scored together, so each key is read once.
 * Every sequence's new key and value are stored first; then the (sequence, KV head) pairs are split
 * over `threads` OpenMP threads (a sequence reads only its own blocks, and blocks shared between
 * sequences hold earlier tokens, which no step writes), each pair's context in parts where the pairs
 * alone would not split evenly (context_parts). One thread reads a layer's cache from L3 at about 10 GB/s
 * on an AVX-512 Xeon, so even batch 1 splits its KV heads: SmolLM2's 3 KV heads over 2 threads, 50 -> 31
 * us a layer with the cache out of L2. With `invariant`, the parts are those one sequence alone would
 * take at any length (context_parts of kv_heads, not of b * kv_heads and the longest context), so a row's
 * output is the same bits whatever else is in the call (batch invariance; the rows may be several
 * queries of one sequence, each with its own length, slot and the sequence's table).
 * scratch holds b * heads * (hd + max(lens)) floats. */
void llmc_decode_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                           const float *v, int64_t v_stride, const float *cos, const float *sin,
                           float *k_cache, float *v_cache, const int64_t *slots, const int64_t *tables,
                           int64_t table_width, const int32_t *lens, int64_t block, int64_t window,
                           int64_t b, int64_t heads, int64_t kv_heads, int64_t hd, float scale,
                           float *out, float *scratch, int64_t threads, int64_t invariant) {
    int64_t row = kv_heads * hd, group = heads / kv_heads, longest = longest_len(lens, b);
    float *rotated = scratch, *all_scores = scratch + b * heads * hd;
    for (int64_t s = 0; s < b; s++) {
        const float *qs = q + s * q_stride, *ks = k + s * k_stride, *vs = v + s * v_stride;
        float *kc = k_cache + slots[s] * row, *vc = v_cache + slots[s] * row, *qr = rotated + s * heads * hd;
        for (int64_t h = 0; h < kv_heads; h++) {
            if (cos) rotate_head(ks + h * hd, cos + s * hd, sin + s * hd, kc + h * hd, hd);
            else memcpy(kc + h * hd, ks + h * hd, hd * sizeof(float));
        }
        memcpy(vc, vs, row * sizeof(float));
        for (int64_t j = 0; j < heads; j++) {
            if (cos) rotate_head(qs + j * hd, cos + s * hd, sin + s * hd, qr + j * hd, hd);
            else memcpy(qr + j * hd, qs + j * hd, hd * sizeof(float));
        }
    }
    int64_t parts = invariant ? context_parts(kv_heads, threads, -1) : context_parts(b * kv_heads, threads, longest);
    /* each part's outputs, then max and sum; on the heap: a call may bring hundreds of rows (a prefill's) */
    float *partial = parts > 1 ? malloc(b * heads * parts * (hd + 2) * sizeof(float)) : NULL;
    if (parts > 1 && !partial) abort();   /* another order of sums would break batch invariance unseen */
#pragma omp parallel for collapse(3) schedule(static) num_threads(threads) if (threads > 1 && b * kv_heads * parts > 1)
    for (int64_t s = 0; s < b; s++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            for (int64_t p = 0; p < parts; p++) {
                int64_t len = lens[s], first = first_key(len, window), n = len - first;
                int64_t t0 = first + n * p / parts, t1 = first + n * (p + 1) / parts;
                const int64_t *table = tables + s * table_width;
                const float *qh = rotated + s * heads * hd + h * group * hd;
                float *scores = all_scores + (s * heads + h * group) * longest + group * (t0 - first);
                float *o = parts > 1 ? partial + ((s * kv_heads + h) * parts + p) * group * (hd + 2)
                                     : out + s * heads * hd + h * group * hd;
                float *stats = parts > 1 ? o + group * hd : NULL;
                if (t1 > t0)
                    attend_kv_head(qh, k_cache, v_cache, table, t0, t1, block, row, h, hd, group, scale, scores, o,
                                   stats);
                else
                    for (int64_t g = 0; g < group; g++) stats[2 * g] = -INFINITY, stats[2 * g + 1] = 0.f;
            }
        }
    }
    if (parts > 1) merge_parts(partial, b * kv_heads, parts, group, hd, out);
    free(partial);
}

/* ---- decode attention over a bf16 cache (the cpu-bf16 target's batched decode) ---- */
typedef uint16_t bf16;

/* VL bf16 values to floats, exactly (a bf16 is a float's upper half) */
static inline vec load_bf16(const bf16 *p) {
#if VL == 16
    return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif VL == 8 && defined(__AVX2__)
    return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    typedef uint16_t vu16 __attribute__((vector_size(VL * 2), aligned(2)));
    typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));
    return (vec)(__builtin_convertvector(*(const vu16 *)p, vu32) << 16);
#endif
}

static inline float bf16_to_float(bf16 h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* a float rounded to the nearest bf16, ties to even (as torch's .to(torch.bfloat16)); NaN stays NaN */
static inline bf16 float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffff) > 0x7f800000) return (bf16)((bits >> 16) | 0x40);
    return (bf16)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* each of `n` rows (`row` values apart) of a head's `hd` bf16 values fetched into L2: a sequence's cache
 * blocks lie anywhere, so the hardware prefetcher stops at each block's end */
static inline void prefetch_rows(const bf16 *at, int64_t n, int64_t row, int64_t hd) {
    for (int64_t i = 0; i < n; i++, at += row)
        for (int64_t c = 0; c < hd * (int64_t)sizeof(bf16); c += 64) __builtin_prefetch((const char *)at + c, 0, 2);
}

DEFINE_SCORE_KEYS(score_keys_bf16, bf16, load_bf16)
DEFINE_WEIGH_VALUES(weigh_values_bf16, bf16, load_bf16)

static void score_keys_bf16_any(const float *qh, int64_t group, const bf16 *key, int64_t row, int64_t n, int64_t hd,
                                float scale, float *scores, int64_t stride) {
    for (int64_t i = 0; i < n; i++, key += row)
        for (int64_t g = 0; g < group; g++) {
            float acc = 0.f;
            for (int64_t d = 0; d < hd; d++) acc += qh[g * hd + d] * bf16_to_float(key[d]);
            scores[g * stride + i] = acc * scale;
        }
}

static void weigh_values_bf16_any(float *o, int64_t group, const bf16 *value, int64_t row, int64_t n, int64_t hd,
                                  const float *p, int64_t stride) {
    for (int64_t i = 0; i < n; i++, value += row)
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < hd; d++) o[g * hd + d] += p[g * stride + i] * bf16_to_float(value[d]);
}

/* the next block of this sequence's keys and values into L2 while this one is scored */
#define PREFETCH_NEXT_BLOCK(t)                                                                          \
    if ((t) / block + 1 <= (len - 1) / block) {                                                         \
        prefetch_rows(k_cache + table[(t) / block + 1] * block * row + h * hd, block, row, hd);       \
        prefetch_rows(v_cache + table[(t) / block + 1] * block * row + h * hd, block, row, hd);       \
    }
#define SCORE_BF16(nv) score_keys_bf16(qh, group, key, row, run, scale, at, n, nv)
#define WEIGH_BF16(nv) weigh_values_bf16(o, group, value, row, run, p, n, nv)
DEFINE_ATTEND_KV_HEAD(attend_kv_head_bf16, bf16, SCORE_BF16, score_keys_bf16_any, WEIGH_BF16, weigh_values_bf16_any,
                      PREFETCH_NEXT_BLOCK)

/* Decode attention for `b` sequences over one layer of a bf16 paged cache (rows [slots, kv_heads * hd])
 * that already holds each sequence's new key and value: query head j of q [b, heads * hd] (bf16, rows
 * q_stride apart) attends to keys first .. lens[s] - 1 of its sequence (position t at slot
 * tables[s][t / block] * block + t % block; first as in llmc_decode_attention) of KV head
 * j / (heads / kv_heads). Reads the keys and values where they lie (no gathered copy), each once per KV
 * head group, and per head (no block-diagonal waste); scores, softmax and sums in fp32, out [b, heads * hd]
 * rounded to bf16 once. (Sequence, KV head) pairs split over `threads` threads.
 * scratch holds b * heads * (hd + max(lens)) floats. */
void llmc_decode_attention_bf16(const bf16 *q, int64_t q_stride, const bf16 *k_cache, const bf16 *v_cache,
                                const int64_t *tables, int64_t table_width, const int32_t *lens, int64_t block,
                                int64_t window, int64_t b, int64_t heads, int64_t kv_heads, int64_t hd, float scale,
                                bf16 *out, float *scratch, int64_t threads) {
    int64_t row = kv_heads * hd, group = heads / kv_heads, longest = longest_len(lens, b);
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1 && b * kv_heads > 1)
    for (int64_t s = 0; s < b; s++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t len = lens[s], first = first_key(len, window);
            const int64_t *table = tables + s * table_width;
            float *o = scratch + (s * heads + h * group) * hd;
            float *scores = scratch + b * heads * hd + (s * heads + h * group) * longest;
            float qh[group * hd];
            for (int64_t i = 0; i < group * hd; i++) qh[i] = bf16_to_float(q[s * q_stride + h * group * hd + i]);
            attend_kv_head_bf16(qh, k_cache, v_cache, table, first, len, block, row, h, hd, group, scale, scores, o,
                                NULL);
            bf16 *os = out + s * heads * hd + h * group * hd;
            for (int64_t i = 0; i < group * hd; i++) os[i] = float_to_bf16(o[i]);
        }
    }
}

/* rms_norm over `rows` rows of n floats: out = x * rsqrt(mean(x^2) + eps) * weight, normalising in
 * fp32 as F.rms_norm does. With `residual` (not NULL), x + residual is normalised and also stored to
 * `summed` (the residual stream's next value). Rows are `stride` floats apart in x, residual and out. */
void llmc_add_rms_norm(const float *x, const float *residual, const float *weight, float *out, float *summed,
                       int64_t rows, int64_t n, int64_t x_stride, int64_t r_stride, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * n;
        if (residual) {
            float *sr = summed + r * n;
            const float *rr = residual + r * r_stride;
            for (int64_t i = 0; i < n; i++) sr[i] = xr[i] + rr[i];
            xr = sr;
        }
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < n; i++) total += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(total / (float)n + eps);
        for (int64_t i = 0; i < n; i++) o[i] = (xr[i] * inv) * weight[i];
    }
}

/* ---- int8 weight-only GEMV on fp32 activations ---- */
typedef uint8_t vbyte __attribute__((vector_size(VL), aligned(1)));
typedef int32_t vint32 __attribute__((vector_size(VL * 4)));
/* VL int8 codes to floats, exactly. With AVX-512 or AVX2 one sign-extending widen (vpmovsxbd) and a
 * convert; elsewhere read unsigned with the sign bit flipped (q + 128), widened, converted, the 128
 * taken off as floats, since GCC 12 widens unsigned bytes in vector registers but signed ones lane by
 * lane (and converts bytes straight to floats lane by lane too). The flip costs two more vector ops
 * per VL codes: on an AVX-512 Xeon the GEMV measured 9-11 GB/s a thread with it, 21 without. */
#if VL == 16
#define Q8(p) ((vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))))
#elif VL == 8 && defined(__AVX2__)
#define Q8(p) ((vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))))
#else
#define Q8(p) (__builtin_convertvector(__builtin_convertvector(*(const vbyte *)(p) ^ 0x80, vint32), vec) - 128.f)
#endif
#define LOAD(p) (*(const vec *)(p))

/* sum_i w_i x_i over len elements of w (loaded as floats by W) in four vector chains, as far as whole
 * vectors go (*end: where they stopped): one accumulator would wait on each FMA's latency (a row of 576
 * int8 codes measured 1.5x slower) */
#define DEFINE_DOT_CHAINS(NAME, T, W)                                                   \
    static inline vec NAME(const T *w, const float *x, int64_t len, int64_t *end) {     \
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                     \
        int64_t i = 0;                                                                  \
        for (; i + 4 * VL <= len; i += 4 * VL) {                                        \
            a0 += W(w + i) * LOAD(x + i);                                               \
            a1 += W(w + i + VL) * LOAD(x + i + VL);                                     \
            a2 += W(w + i + 2 * VL) * LOAD(x + i + 2 * VL);                             \
            a3 += W(w + i + 3 * VL) * LOAD(x + i + 3 * VL);                             \
        }                                                                               \
        for (; i + 2 * VL <= len; i += 2 * VL) {                                        \
            a0 += W(w + i) * LOAD(x + i);                                               \
            a1 += W(w + i + VL) * LOAD(x + i + VL);                                     \
        }                                                                               \
        for (; i + VL <= len; i += VL) a2 += W(w + i) * LOAD(x + i);                    \
        *end = i;                                                                       \
        return (a0 + a1) + (a2 + a3);                                                   \
    }
DEFINE_DOT_CHAINS(chains_q8, uint8_t, Q8)
DEFINE_DOT_CHAINS(chains_f32, float, LOAD)

/* sum_i q_i x_i over `len` codes, a multiple of VL */
static inline vec group_q8(const uint8_t *q, const float *x, int64_t len) {
    int64_t end;
    return chains_q8(q, x, len, &end);
}

/* sum_i q_i x_i over `len` codes, a multiple of VL, in one chain */
static inline vec small_group_q8(const uint8_t *q, const float *x, int64_t len) {
    vec p = Q8(q) * LOAD(x);
    for (int64_t i = VL; i < len; i += VL) p += Q8(q + i) * LOAD(x + i);
    return p;
}

/* sum_g s_g * sum_{i in g} q_i x_i for one weight row. Groups of 4 vectors or more run in four chains and
 * alternate between two scaled sums; smaller ones (GGUF's Q8_0: 32 codes) are one chain each, four groups
 * a trip into four scaled sums, as four chains' zeros and their sum would cost more than the group's own
 * FMAs (rows of 576 codes in groups of 32, one thread, in cache on an AVX-512 Xeon: 9.6 -> 6.1 cycles per
 * 32 codes, fp16 scales converted a row at a time included). */
static inline float dot_q8(const uint8_t *q, const float *x, const float *sc, int64_t groups, int64_t group) {
    vec t0 = {0}, t1 = {0}, t2 = {0}, t3 = {0};
    int64_t g = 0;
    if (group < 4 * VL) {
        for (; g + 4 <= groups; g += 4) {
            t0 += small_group_q8(q + g * group, x + g * group, group) * sc[g];
            t1 += small_group_q8(q + (g + 1) * group, x + (g + 1) * group, group) * sc[g + 1];
            t2 += small_group_q8(q + (g + 2) * group, x + (g + 2) * group, group) * sc[g + 2];
            t3 += small_group_q8(q + (g + 3) * group, x + (g + 3) * group, group) * sc[g + 3];
        }
        for (; g < groups; g++) t0 += small_group_q8(q + g * group, x + g * group, group) * sc[g];
        return hsum((t0 + t1) + (t2 + t3));
    }
    for (; g + 2 <= groups; g += 2) {
        t0 += group_q8(q + g * group, x + g * group, group) * sc[g];
        t1 += group_q8(q + (g + 1) * group, x + (g + 1) * group, group) * sc[g + 1];
    }
    if (g < groups) t0 += group_q8(q + g * group, x + g * group, group) * sc[g];
    return hsum(t0 + t1);
}

/* Weight rows are fetched into L2 this many rows ahead. Converting a byte to a float costs more than
 * reading it, so the out-of-order window holds too few rows' loads to keep memory busy and the hardware
 * prefetcher alone does not run far enough ahead: SmolLM2's int8 weights from DRAM, 2 threads on an
 * AVX-512 Xeon, 15 -> 24 GB/s (groups of 64) and 11 -> 18 GB/s (of 32); 4 to 64 rows all helped, into L1
 * (prefetcht0) less, non-temporal (prefetchnta) hurt. */
#define PREFETCH_ROWS 16

/* y[r, j] = sum_g s[j, g] * sum_{i in g} q[j, i] x[r, i] for the m rows of x (`x_stride` floats apart):
 * int8 codes q [n, k], scales s [n, k / group] (fp16 when f16, else fp32), group a multiple of VL
 * dividing k; y [m, n] contiguous. The weight rows are split over `threads` threads; each row's codes
 * are read once for all m rows of x (they stay in L1 between them). */
void llmc_gemv_q8(const float *x, int64_t x_stride, int64_t m, const int8_t *q, const void *scales, int64_t f16,
                  int64_t n, int64_t k, int64_t group, float *y, int64_t threads) {
    if (llmc_gemv_q8_int16(x, x_stride, m, q, scales, f16, n, k, group, y, threads)) return;
    if (m > MAX_ROWS) {   /* only the int16 path takes more rows (cpu_native.gemm asks it so): never a wrong sum */
        for (int64_t i = 0; i < m * n; i++) y[i] = NAN;
        return;
    }
    int64_t groups = k / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) {
        float buf[groups + VL];
        const float *sc = params_f32(scales, f16, j * groups, groups, buf);
        if (j + PREFETCH_ROWS < n)
            for (int64_t c = 0; c < k; c += 64) __builtin_prefetch((const char *)q + (j + PREFETCH_ROWS) * k + c, 0, 2);
        for (int64_t r = 0; r < m; r++)
            y[r * n + j] = dot_q8((const uint8_t *)q + j * k, x + r * x_stride, sc, groups, group);
    }
}

/* ---- 4-bit weight-only GEMV on fp32 activations (int4 with zero points, GGUF's Q4_0 / Q4_1) ---- */

/* Codes lie as stored: byte j of a row holds code 2j in its low nibble and 2j + 1 in its high one, so one
 * widen of VL bytes gives VL even and VL odd codes; the activations are laid out to match, per 32 codes
 * their 16 even ones then their 16 odd ones (deinterleave, once a call). Each group's 16
 * possible weights are made once, exactly as the reference dequantises them: (q - z) * s with a zero
 * point, q * s + m (one rounding: q * s is exact for GGUF's scales) with an offset. With AVX-512 they
 * are a register that vpermps indexes by each lane's low 4 bits, so a code costs no convert. */
#if VL == 16
static const float IOTA_[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#define IOTA (*(const vec *)IOTA_)
typedef __m512i wide_codes;
#define Q4WIDE(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define Q4LO(b, t) ((vec)_mm512_permutexvar_ps(b, (__m512)(t)))
#define Q4HI(b, t) ((vec)_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), (__m512)(t)))
#define Q4TABLE(s, zm, zp) ((zp) ? (IOTA - (zm)) * (s) : IOTA * (s) + (zm))
#else
typedef vint32 wide_codes;
#define Q4WIDE(p) __builtin_convertvector(*(const vbyte *)(p), vint32)
#define Q4W(c, t) ((t).zp ? (__builtin_convertvector(c, vec) - (t).zm) * (t).s : __builtin_convertvector(c, vec) * (t).s + (t).zm)
#define Q4LO(b, t) Q4W((b) & 15, t)
#define Q4HI(b, t) Q4W((b) >> 4, t)
#define Q4TABLE(s_, zm_, zp_) ((struct q4_table){(s_), (zm_), (zp_)})
struct q4_table { float s, zm; int64_t zp; };
#endif

/* acc[r] += sum over one group's codes of w_i x_r[i], for M rows of x; q and x at the group's start.
 * (Pointers step through the chunks: an index halved as a signed number costs three more scalar ops a
 * chunk, which compete with the vector ones for ports.) */
static inline __attribute__((always_inline)) void group_q4(const uint8_t *q, const float *x, int64_t xs,
                                                           const int64_t M, int64_t group,
                                                           __typeof__(Q4TABLE(0.f, 0.f, 0)) t, vec *lo, vec *hi) {
    for (const uint8_t *end = q + group / 2; q < end; q += 16, x += 32)
        for (int64_t u = 0; u < 16; u += VL) {
            wide_codes b = Q4WIDE(q + u);
            vec wl = Q4LO(b, t), wh = Q4HI(b, t);
            for (int64_t r = 0; r < M; r++) {
                lo[r] += wl * LOAD(x + r * xs + u);
                hi[r] += wh * LOAD(x + r * xs + 16 + u);
            }
        }
}

/* group_q4 for two consecutive groups in one loop (their own tables), into two pairs of chains: with
 * few rows one group's chains alone wait on the FMA latency, and a GGUF group (32 codes) is one trip */
static inline __attribute__((always_inline)) void group_pair_q4(const uint8_t *q, const float *x, int64_t xs,
                                                                const int64_t M, int64_t group,
                                                                __typeof__(Q4TABLE(0.f, 0.f, 0)) t0,
                                                                __typeof__(Q4TABLE(0.f, 0.f, 0)) t1,
                                                                vec *lo0, vec *hi0, vec *lo1, vec *hi1) {
    for (const uint8_t *end = q + group / 2; q < end; q += 16, x += 32)
        for (int64_t u = 0; u < 16; u += VL) {
            wide_codes b0 = Q4WIDE(q + u), b1 = Q4WIDE(q + group / 2 + u);
            vec wl0 = Q4LO(b0, t0), wh0 = Q4HI(b0, t0), wl1 = Q4LO(b1, t1), wh1 = Q4HI(b1, t1);
            for (int64_t r = 0; r < M; r++) {
                const float *xr = x + r * xs + u;
                lo0[r] += wl0 * LOAD(xr);
                hi0[r] += wh0 * LOAD(xr + 16);
                lo1[r] += wl1 * LOAD(xr + group);
                hi1[r] += wh1 * LOAD(xr + group + 16);
            }
        }
}

/* y[r * n] = one weight row's dot with M rows of x; groups alternate between two pairs of chains, for up
 * to 4 rows two groups in one loop (one row, in cache, on an AVX-512 Xeon: 8.7 -> 6.6 cycles per 32 codes
 * with GGUF's groups of 32, 5.75 -> 5.4 with groups of 64) */
static inline __attribute__((always_inline)) void dot_q4(const uint8_t *q, const float *x, int64_t xs, const int64_t M,
                                                         const float *sc, const float *zo, int64_t zp, int64_t groups,
                                                         int64_t group, float *y, int64_t n) {
    vec a[MAX_ROWS], b[MAX_ROWS], c[MAX_ROWS], d[MAX_ROWS];
    for (int64_t r = 0; r < M; r++) a[r] = b[r] = c[r] = d[r] = (vec){0};
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        if (M <= 4) {
            group_pair_q4(q + g * group / 2, x + g * group, xs, M, group, Q4TABLE(sc[g], zo[g], zp),
                          Q4TABLE(sc[g + 1], zo[g + 1], zp), a, b, c, d);
        } else {
            group_q4(q + g * group / 2, x + g * group, xs, M, group, Q4TABLE(sc[g], zo[g], zp), a, b);
            group_q4(q + (g + 1) * group / 2, x + (g + 1) * group, xs, M, group, Q4TABLE(sc[g + 1], zo[g + 1], zp),
                     c, d);
        }
    }
    if (g < groups)
        group_q4(q + g * group / 2, x + g * group, xs, M, group, Q4TABLE(sc[g], zo[g], zp), a, b);
    for (int64_t r = 0; r < M; r++) y[r * n] = hsum((a[r] + b[r]) + (c[r] + d[r]));
}

#define Q4_PREFETCH_ROWS 32

/* x's m rows (`x_stride` floats apart) into out [m, k], each 32 floats' 16 even ones, then their 16 odd ones */
static void deinterleave(const float *x, int64_t x_stride, int64_t m, int64_t k, float *out) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < k; c += 32)
            for (int64_t i = 0; i < 16; i++) {
                out[r * k + c + i] = x[r * x_stride + c + 2 * i];
                out[r * k + c + 16 + i] = x[r * x_stride + c + 2 * i + 1];
            }
}

/* y[r, j] = sum_i w[j, i] x[r, i] for the m <= MAX_ROWS rows of x (`x_stride` floats apart), w from 4-bit
 * codes q [n, k / 2] as stored (two a byte, the even one low) and per group of `group` codes (a multiple
 * of 32 dividing k) a scale s [n, k / group] and a zero point (zp: w = (q - z) * s) or offset (w = q * s +
 * m) o, `o_row` values a row apart (0: one row for all), both fp16 when f16, else fp32; y [m, n]
 * contiguous. Weight rows split over `threads` as llmc_gemv_q8's. `flags` Q4_INT8: on activations rounded to
 * int8 codes per block of 32 where the shapes allow (llmc_gemv_q4_int8; with Q4_CACHED, the weights sit in
 * the last-level cache: fetch rows ahead), else on int16 codes per 64 (or fp32). */
#define Q4_INT8 1
#define Q4_CACHED 2
void llmc_gemv_q4(const float *x_, int64_t x_stride, int64_t m, const uint8_t *q, const void *s, const void *o,
                  int64_t o_row, int64_t f16, int64_t zp, int64_t n, int64_t k, int64_t group, float *y,
                  int64_t threads, int64_t flags) {
    if ((flags & Q4_INT8) && llmc_gemv_q4_int8(x_, x_stride, m, q, s, o, o_row, f16, zp, n, k, group, y, threads,
                                               flags & Q4_CACHED ? Q4_PREFETCH_ROWS : 0))
        return;
    if (llmc_gemv_q4_int16(x_, x_stride, m, q, s, o, o_row, f16, zp, n, k, group, y, threads)) return;
    if (m > MAX_ROWS) {   /* only the int8 path takes more rows (cpu_native.gemm asks it so): never a wrong sum */
        for (int64_t i = 0; i < m * n; i++) y[i] = NAN;
        return;
    }
    float *x = malloc(m * k * sizeof(float));
    if (!x) {   /* out of memory for a few rows of activations: nan outputs, never stale ones */
        for (int64_t i = 0; i < m * n; i++) y[i] = NAN;
        return;
    }
    deinterleave(x_, x_stride, m, k, x);
    x_stride = k;
    int64_t groups = k / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) {
        float buf[2 * groups + 2 * VL];
        const float *sc = params_f32(s, f16, j * groups, groups, buf);
        const float *zo = params_f32(o, f16, j * o_row, groups, buf + groups + VL);
        if (j + Q4_PREFETCH_ROWS < n)
            for (int64_t c = 0; c < k / 2; c += 64) __builtin_prefetch(q + (j + Q4_PREFETCH_ROWS) * (k / 2) + c, 0, 2);
        const uint8_t *row = q + j * (k / 2);
        /* A constant row count keeps each row's sums in registers; for one or two rows a constant group
         * size also unrolls each group's chunks (one row in cache on an AVX-512 Xeon, cycles per 32 codes:
         * groups of 64 5.35 -> 4.95, of 32 6.2 -> 5.8) */
#define DOT(M, G) dot_q4(row, x, x_stride, M, sc, zo, zp, groups, G, y + j, n)
#define FEW(M) case M: switch (group) { \
            case 32: DOT(M, 32); break; case 64: DOT(M, 64); break; case 128: DOT(M, 128); break; \
            default: DOT(M, group); } break;
#define ROWS(M) case M: DOT(M, group); break;
        switch (m) {
            FEW(1) FEW(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
        }
#undef ROWS
#undef FEW
#undef DOT
    }    free(x);
}

/* ---- fp32 GEMV and SwiGLU, for the native decode program (decode_program.c) ---- */

/* sum_i w_i x_i over k floats, the tail (k not a multiple of VL) lane by lane */
static inline float dot_f32(const float *w, const float *x, int64_t k) {
    int64_t i;
    float total = hsum(chains_f32(w, x, k, &i));
    for (; i < k; i++) total += w[i] * x[i];
    return total;
}

/* Rows of an fp32 weight fetched ahead into L2: fp32 weights are 4 bytes a weight to int8's 1, so the
 * hardware prefetcher keeps up better, but the rows are the same distance ahead in time. */
#define F32_PREFETCH_ROWS 4

/* y[r, j] = sum_i w[j, i] x[r, i] (+ bias[j] when bias is not NULL) for the m rows of x (`x_stride` floats
 * apart), w [n, k] contiguous fp32, y [m, n] contiguous; weight rows split over `threads` threads, each
 * read once for all m rows. */
void llmc_gemv_f32(const float *x, int64_t x_stride, int64_t m, const float *w, const float *bias, int64_t n,
                   int64_t k, float *y, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) {
        if (j + F32_PREFETCH_ROWS < n)
            for (int64_t c = 0; c < k; c += 16) __builtin_prefetch(w + (j + F32_PREFETCH_ROWS) * k + c, 0, 2);
        for (int64_t r = 0; r < m; r++) y[r * n + j] = dot_f32(w + j * k, x + r * x_stride, k) + (bias ? bias[j] : 0.f);
    }
}

/* out[r, i] = silu(g) * u, g = x[r, i], u = x[r, inter + i], for m rows (`x_stride` floats apart) into
 * out [m, inter]: silu(g) = g * sigmoid(g), sigmoid from e^-|g| (never overflowing), as 1 / (1 + e) for
 * g >= 0 and e / (1 + e) below. */
void llmc_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t inter, float *out) {
    typedef int32_t vint __attribute__((vector_size(VL * 4)));
    for (int64_t r = 0; r < m; r++) {
        const float *g = x + r * x_stride, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + VL <= inter; i += VL) {
            vec gv = LOAD(g + i), e = exp_nonpositive((vec)((vint)gv | INT32_MIN));   /* -|g| */
            vec rcp = 1.0f / (1.0f + e);
            vint positive = gv >= 0;
            vec sig = (vec)(((vint)rcp & positive) | ((vint)(e * rcp) & ~positive));
            *(vec *)(o + i) = gv * sig * LOAD(u + i);
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* whether this build splits the GEMV over threads (1) or runs it on one (0: built without OpenMP) */
int64_t llmc_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
