/* A batch-invariant GEMM of fp32 activations against llmc's 4-bit weights on AMX-INT8 (TDPBSUD).
 *
 * y [m, n] = x [m, k] @ W.T, W [n, k] 4-bit codes q per group of `group` along k with fp16 or fp32 scales s
 * and offsets o (w = q * s + o, GGUF Q4_1) or zero points z (w = (q - z) * s).
 *
 * Activations round to int8 codes per row per block of 32 exactly as gemv_int16.c's quantise_row8 does
 * (scale top / 127, codes round-half-even(x * 127 / top) clamped to [-128, 127]; an inf or nan makes the
 * block's scale nan), with each group's sum of the rounded activations. One TDPBSUD per block of 32 gives
 * the exact int32 sums D[r, c, b] of 16 rows by 16 weight columns; then, per (row, column), one fixed fp32
 * sequence that no other row enters:
 *     acc = 0;  for b in blocks:  acc = fma((float)D[b], s[c, g(b)] * sx[r, b], acc)
 *               for g in groups:  acc = fma(o[c, g], sums[r, g], acc)      (o = -(s * z) for zero points)
 * so a row's y is the same bits whatever m is and wherever the row sits in the batch. Per 512 MACs a row
 * costs three zmm ops (convert, scale product, FMA) and one per group for the offsets, against about
 * twenty in the VNNI GEMV, whose lanes convert and scale partial sums of eight codes.
 *
 * Tiles of up to VNNI_ROWS rows compute the same D with vpdpbusd instead (see row_tile_vnni).
 *
 * The weights are repacked once (llmc_q4_repack) into 16-column tiles whose codes unpack with two zmm ops
 * per 128 codes into AMX B tiles; see the layout comment above llmc_q4_tiles_bytes. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <float.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "half_params.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define MAGIC 0x34714d41u   /* "AMq4" */
#define HEAD 64
/* A single row tile (m <= 16) unpacks its B tiles AHEAD blocks before their TDPBSUD into a RING of 16
 * (8 KiB) instead of all K/32 of them up front: with K = 1536 the unpacked 24 KiB and the A rows' 24 KiB
 * overflowed L1 (m = 16: 50 -> 38 ns per block of 16 columns), and a tile load that follows the stores of
 * its bytes too closely stalls (unpacking each block just before its load: 38 -> 53 ns). */
#define AHEAD 8
#define RING 16
#define SLOTS 4             /* C tiles in flight: a block's sums are read SLOTS - 1 blocks after its TDPBSUD */

static int amx_state = -1;

/* AMX's tile data is an XSAVE feature Linux hands out per process on request (since 5.16); without the
 * permission the first tile instruction faults. Asked once; 1 where granted. */
int64_t llmc_amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

/* The repacked weights: a 64-byte head (struct head), then one record of `tile` bytes per 16 columns
 * (columns past n padded with zero codes, scales and offsets), each:
 *     codes   [k / 32][256] bytes: block b's 16 x 32 codes. Byte t holds in its low nibble byte t of the
 *             block's B tile and in its high nibble byte t + 256, where the B tile (8 rows of 64 bytes,
 *             VNNI order) has at row i, bytes 4c..4c+3, column c's codes k = 32b + 4i .. 32b + 4i + 3. So
 *             byte t = 64i + 4c + e (i < 4) holds code 32b + 4i + e low and code 32b + 16 + 4i + e high.
 *     scales  [k / group][16] in the source's dtype (fp16 or fp32)
 *     other   [k / group][16] offsets or zero points, same dtype; absent where one row serves all
 * and where one row of offsets or zero points serves all columns, that row ([k / group], same dtype) after
 * the last record. Each record and the shared row start on 64 bytes. */
struct head { uint32_t magic, f16; int64_t n, k, group, zero_point, shared, tile; };

static int64_t tile_record(int64_t k, int64_t group, int64_t f16, int64_t shared) {
    int64_t groups = k / group, esz = f16 ? 2 : 4;
    return (k / 32 * 256 + groups * 16 * esz * (shared ? 1 : 2) + 63) / 64 * 64;
}

static int shapes_fit(int64_t n, int64_t k, int64_t group) {
    return n >= 1 && k >= 32 && group >= 32 && group % 32 == 0 && k % group == 0;
}

/* bytes llmc_q4_repack writes for these weights (other_row 0: one row of offsets or zero points for all);
 * 0 where the shapes do not fit (k and group multiples of 32, group dividing k) */
int64_t llmc_q4_tiles_bytes(int64_t n, int64_t k, int64_t group, int64_t f16, int64_t other_row) {
    if (!shapes_fit(n, k, group)) return 0;
    int64_t shared = other_row == 0, esz = f16 ? 2 : 4;
    return HEAD + (n + 15) / 16 * tile_record(k, group, f16, shared) + (shared ? (k / group * esz + 63) / 64 * 64 : 0);
}

/* one block (32 codes) of 16 weight rows into its 256 tile bytes: row c's 16 source bytes (codes 2j low,
 * 2j + 1 high) become codes 0..15 low and 16..31 high, then their four dwords go to t = 64i + 4c */
static void repack_block(const uint8_t *packed, int64_t rows, int64_t row_bytes, int64_t b, uint8_t *out) {
    const __m128i low = _mm_set1_epi8(15), high = _mm_set1_epi8((char)0xf0);
    for (int64_t c = 0; c < 16; c++) {
        uint32_t d[4] = {0, 0, 0, 0};
        if (c < rows) {
            __m128i s = _mm_loadu_si128((const __m128i *)(packed + c * row_bytes + 16 * b));
            __m128i a = s, h = _mm_srli_si128(s, 8);   /* codes 0..15, codes 16..31 */
            __m128i even = _mm_or_si128(_mm_and_si128(a, low), _mm_slli_epi16(_mm_and_si128(h, low), 4));
            __m128i odd = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low), _mm_and_si128(h, high));
            _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi8(even, odd));
        }
        for (int i = 0; i < 4; i++) memcpy(out + 64 * i + 4 * c, d + i, 4);
    }
}

/* 16 columns' values of one parameter array [rows, groups] (row stride `stride` elements) into [groups][16] */
static void repack_params(const uint8_t *src, int64_t esz, int64_t stride, int64_t rows, int64_t groups, uint8_t *out) {
    memset(out, 0, groups * 16 * esz);
    for (int64_t c = 0; c < rows; c++)
        for (int64_t g = 0; g < groups; g++)
            memcpy(out + (g * 16 + c) * esz, src + (c * stride + g) * esz, esz);
}

/* the stored weights (packed [n, k / 2], scales [n, k / group], other [n or 1, k / group] with rows
 * other_row values apart, 0 for one row serving all; f16: both fp16, else fp32) into `out`
 * (llmc_q4_tiles_bytes of them); returns the bytes written, 0 where the shapes do not fit */
int64_t llmc_q4_repack(const uint8_t *packed, const void *scales, const void *other, int64_t other_row, int64_t f16,
                       int64_t zero_point, int64_t n, int64_t k, int64_t group, uint8_t *out, int64_t threads) {
    if (!shapes_fit(n, k, group)) return 0;
    int64_t shared = other_row == 0, esz = f16 ? 2 : 4, groups = k / group, tiles = (n + 15) / 16;
    int64_t rec = tile_record(k, group, f16, shared), blocks = k / 32;
    struct head h = {MAGIC, (uint32_t)(f16 != 0), n, k, group, zero_point != 0, shared, rec};
    memset(out, 0, HEAD);
    memcpy(out, &h, sizeof h);
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t j = 0; j < tiles; j++) {
        uint8_t *t = out + HEAD + j * rec;
        int64_t rows = n - 16 * j < 16 ? n - 16 * j : 16;
        const uint8_t *src = packed + 16 * j * (k / 2);
        for (int64_t b = 0; b < blocks; b++) repack_block(src, rows, k / 2, b, t + 256 * b);
        uint8_t *p = t + 256 * blocks;
        repack_params((const uint8_t *)scales + 16 * j * groups * esz, esz, groups, rows, groups, p);
        if (!shared)
            repack_params((const uint8_t *)other + 16 * j * other_row * esz, esz, other_row, rows, groups,
                          p + groups * 16 * esz);
        memset(p + groups * 16 * esz * (shared ? 1 : 2), 0, rec - 256 * blocks - groups * 16 * esz * (shared ? 1 : 2));
    }
    if (shared) {
        uint8_t *s = out + HEAD + tiles * rec;
        int64_t bytes = (groups * esz + 63) / 64 * 64;
        memset(s, 0, bytes);
        memcpy(s, other, groups * esz);
    }
    return llmc_q4_tiles_bytes(n, k, group, f16, other_row);
}

/* ---- activations ---- */

/* a call's activations: row r's int8 codes at codes + r * k (natural order: the A tile's rows), its block
 * scales at sx[b * rows + r] (a block's scales side by side: one base pointer for a tile's broadcasts),
 * its groups' sums of rounded activations at sums[g * rows + r] */
struct act { int8_t *codes; float *sx, *sums; int64_t rows; };

/* quantise_row8's rounding for one row's group g (its blocks b0..b1 - 1): codes, block scales sx[b * step]
 * and *sum = fma(scale_b, sum of codes_b, *sum) over the blocks in order from 0 (the fma written out: a
 * contracted or not `+=` would leave it to the compiler). The call splits the work by groups, so that two
 * threads never write the same cache line of scales (a tile's 16 rows share one per block). */
static void quantise_group(const float *x, int64_t b0, int64_t b1, int8_t *codes, float *sx, float *sum,
                           int64_t step, int split) {
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    const __m512 finite = _mm512_set1_ps(FLT_MAX);
    *sum = 0.f;
    for (int64_t b = b0; b < b1; b++) {
        __m512 v[2] = {_mm512_loadu_ps(x + 32 * b), _mm512_loadu_ps(x + 32 * b + 16)};
        __m512 a0 = _mm512_abs_ps(v[0]), a1 = _mm512_abs_ps(v[1]);
        __mmask16 bad = _mm512_cmp_ps_mask(a0, finite, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, finite, _CMP_NLE_UQ);
        float top = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        float scale = bad ? NAN : top / 127.f;
        __m512 inv = _mm512_set1_ps(bad || top == 0.f ? 0.f : 127.f / top);
        int tiny = !bad && top > 0.f && top < 1e-30f;   /* near where 127 / top overflows: divide, as quantise_row8 */
        __m512i total = _mm512_setzero_si512(), q[2];
        for (int u = 0; u < 2; u++) {
            __m512 c = tiny ? _mm512_div_ps(v[u], _mm512_set1_ps(scale)) : _mm512_mul_ps(v[u], inv);
            q[u] = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(c), _mm512_set1_epi32(127)),
                                    _mm512_set1_epi32(-128));
            total = _mm512_add_epi32(total, q[u]);
        }
        if (split) {   /* the block's 16 even codes, then its 16 odd ones: the stored weights' nibble order */
            __m512i e = _mm512_permutex2var_epi32(q[0], evens, q[1]), o = _mm512_permutex2var_epi32(q[0], odds, q[1]);
            q[0] = e;
            q[1] = o;
        }
        for (int u = 0; u < 2; u++) _mm_storeu_si128((__m128i *)(codes + 32 * b + 16 * u), _mm512_cvtepi32_epi8(q[u]));
        sx[b * step] = scale;
        *sum = fmaf(scale, (float)_mm512_reduce_add_epi32(total), *sum);
    }
}

/* a call's activations in one allocation (act's fields point into it, rows m); NULL where memory runs out */
static char *act_alloc(struct act *x, int64_t m, int64_t k, int64_t group) {
    int64_t blocks = k / 32, groups = k / group;
    char *mem = aligned_alloc(64, (m * k + m * (blocks + groups) * 4 + 63) / 64 * 64);
    if (!mem) return NULL;
    x->codes = (int8_t *)mem;
    x->sx = (float *)(mem + m * k);   /* k is a multiple of 32: aligned */
    x->sums = x->sx + m * blocks;
    x->rows = m;
    return mem;
}

/* every row's groups quantised (`split`: quantise_group's order for the stored codes), the groups shared
 * out among the threads of the enclosing parallel region */
static void quantise_rows(const float *x_rows, int64_t x_stride, const struct act *x, int64_t k, int64_t group,
                          int split) {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < k / group; g++)
        for (int64_t r = 0; r < x->rows; r++)
            quantise_group(x_rows + r * x_stride, g * (group / 32), (g + 1) * (group / 32), x->codes + r * k,
                           x->sx + r, x->sums + g * x->rows + r, x->rows, split);
}

/* ---- the GEMM ---- */

struct tilecfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

/* tiles 0-3: C (rows x 16 int32), 4-5: A (rows x 32 int8 activations), 6-7: B (8 x 64 bytes of codes) */
static void configure(int rows) {
    struct tilecfg cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t >= 6 ? 8 : rows;
        cfg.colsb[t] = t >= 4 && t < 6 ? 32 : 64;
    }
    _tile_loadconfig(&cfg);
}

/* block b's codes for 16 columns into its 512-byte B tile: low nibbles are rows 0-3, high ones rows 4-7 */
static inline void unpack_block(const uint8_t *t, uint8_t *out) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int q = 0; q < 4; q++) {
        __m512i v = _mm512_loadu_si512(t + 64 * q);
        _mm512_store_si512(out + 64 * q, _mm512_and_si512(v, low));
#ifdef __GFNI__
        /* one affine op per byte: bit i of the result = bit i + 4 of the byte, bits 4-7 zero */
        __m512i hi = _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#endif
        _mm512_store_si512(out + 256 + 64 * q, hi);
    }
}

static inline __m512 half16(const void *p, int64_t f16, int64_t i) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
               : _mm512_loadu_ps((const float *)p + i);
}

static inline float one_param(const void *p, int64_t f16, int64_t i) {
    return f16 ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* a record's scales per block sw [blocks][16] (no division in the loops) and offsets per group
 * ow [groups][16] as fp32: for zero points o = -(s * z) */
static void column_params(const struct head *h, const uint8_t *t, const uint8_t *shared_other, float *sw, float *ow) {
    int64_t groups = h->k / h->group, esz = h->f16 ? 2 : 4;
    const uint8_t *sc = t + h->k / 32 * 256, *ot = sc + groups * 16 * esz;
    for (int64_t g = 0; g < groups; g++) {
        __m512 s = half16(sc, h->f16, 16 * g);
        __m512 o = h->shared ? _mm512_set1_ps(one_param(shared_other, h->f16, g)) : half16(ot, h->f16, 16 * g);
        if (h->zero_point) o = _mm512_xor_ps(_mm512_mul_ps(s, o), _mm512_set1_ps(-0.f));   /* -(s * z), exactly */
        for (int64_t b = g * h->group / 32; b < (g + 1) * h->group / 32; b++) _mm512_store_ps(sw + 16 * b, s);
        _mm512_store_ps(ow + 16 * g, o);
    }
}

/* TDPBSUD of block b (A: rows of activation codes, B: the unpacked codes) into C tile `slot`, stored at cb */
#define AMX_BLOCK(C, A, B) do { \
        _tile_loadd(A, a + 32 * b, k); _tile_loadd(B, ub + 512 * (b & mask), 64); \
        _tile_zero(C); _tile_dpbsud(C, A, B); _tile_stored(C, cb, 64); } while (0)

/* the offsets' terms in group order (the end of every row's fixed sequence), then the R rows' 16 columns
 * stored (those of them below n: `n` is also the rows' stride) */
static inline __attribute__((always_inline)) void finish_rows(const int R, __m512 *acc, const float *ow,
                                                              const float *sums, int64_t rows, int64_t groups,
                                                              float *y, int64_t n, int64_t col) {
    for (int64_t g = 0; g < groups; g++) {
        __m512 o = _mm512_load_ps(ow + 16 * g);
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(sums[g * rows + r]), acc[r]);
    }
    __mmask16 live = n - col >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - col)) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * n, live, acc[r]);
}

static inline void amx_block(int64_t b, const int8_t *a, int64_t k, const uint8_t *ub, int64_t mask, int32_t *cb) {
    switch (b % SLOTS) {
    case 0: AMX_BLOCK(0, 4, 6); break;
    case 1: AMX_BLOCK(1, 5, 7); break;
    case 2: AMX_BLOCK(2, 4, 6); break;
    default: AMX_BLOCK(3, 5, 7); break;
    }
}

/* R (a constant: the accumulators stay in registers) rows r0.. against one record's 16 columns col.. */
static inline __attribute__((always_inline)) void row_tile(const int R, const struct act *x, int64_t r0, int64_t k,
                                                           int64_t group, const uint8_t *t, uint8_t *ub, int ring, const float *sw,
                                                           const float *ow, int32_t *cbuf, float *y, int64_t n,
                                                           int64_t col) {
    int64_t blocks = k / 32, groups = k / group;
    const int8_t *a = x->codes + r0 * k;
    const float *sx = x->sx + r0, *sums = x->sums + r0;
    __m512 acc[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    int64_t mask = ring ? RING - 1 : -1;
    for (int64_t b = 0; ring && b < SLOTS - 1 + AHEAD && b < blocks; b++) unpack_block(t + 256 * b, ub + 512 * b);
    for (int64_t b = 0; b < SLOTS - 1 && b < blocks; b++) amx_block(b, a, k, ub, mask, cbuf + 256 * (b % SLOTS));
    for (int64_t b = 0; b < blocks; b++) {
        if (b + SLOTS - 1 < blocks)
            amx_block(b + SLOTS - 1, a, k, ub, mask, cbuf + 256 * ((b + SLOTS - 1) % SLOTS));
        if (ring && b + SLOTS - 1 + AHEAD < blocks)
            unpack_block(t + 256 * (b + SLOTS - 1 + AHEAD), ub + 512 * ((b + SLOTS - 1 + AHEAD) & mask));
        const int32_t *d = cbuf + 256 * (b % SLOTS);
        __m512 s = _mm512_load_ps(sw + 16 * b);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(d + 16 * r)),
                                     _mm512_mul_ps(s, _mm512_set1_ps(sx[b * x->rows + r])), acc[r]);
    }
    finish_rows(R, acc, ow, sums, x->rows, groups, y + r0 * n + col, n, col);
}

/* The same D and the same fp32 sequence from VNNI where a tile has few rows (VNNI_ROWS or fewer): each of
 * the B tile's 8 rows of codes (4 low-nibble, 4 high-nibble vectors, straight from the record) meets a
 * broadcast dword of 4 activation codes in one vpdpbusd (lane c: column c's 4 codes): 12 zmm ops per row
 * and block, against the AMX path's tile loads and stores, which on the 2-core Xeon cost about as much as
 * the post-processing of 16 rows and do not overlap it (3072 x 576, one thread, per block of 16 columns:
 * 1 row 7.4 ns against 16.3 on AMX, 5 rows 17.3 against 20.6, 8 rows even). D is exact either way, so
 * the bits agree with the AMX path's. */
#define VNNI_ROWS 6

/* A few rows' tiles are fetched into L2 this many tiles ahead: a decode step's GEMVs are bound by reading
 * the weights, and where they sit in the last-level cache its latency, not DRAM's bandwidth, is the limit */
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 2
#endif

/* block b's D for R rows (codes a, k apart) from its B tile's rows w (low nibbles w[0..3], high w[4..7]),
 * into each row's fixed sequence */
static inline __attribute__((always_inline)) void vnni_block(const int R, const __m512i *w, __m512 s, const int8_t *a,
                                                             int64_t k, int64_t b, const float *sx, int64_t rows,
                                                             __m512 *acc) {
    for (int r = 0; r < R; r++) {
        const int32_t *xa = (const int32_t *)(a + r * k + 32 * b);
        __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xa[0]));
        __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], _mm512_set1_epi32(xa[4]));
        for (int i = 1; i < 4; i++) {
            d0 = _mm512_dpbusd_epi32(d0, w[i], _mm512_set1_epi32(xa[i]));
            d1 = _mm512_dpbusd_epi32(d1, w[i + 4], _mm512_set1_epi32(xa[i + 4]));
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)),
                                 _mm512_mul_ps(s, _mm512_set1_ps(sx[b * rows + r])), acc[r]);
    }
}

static inline __attribute__((always_inline)) void row_tile_vnni(const int R, const struct act *x, int64_t r0,
                                                                int64_t k, int64_t group, const uint8_t *t,
                                                                const float *sw, const float *ow, float *y,
                                                                int64_t n, int64_t col, const int stored) {
    const __m512i low = _mm512_set1_epi8(15);
    int64_t blocks = k / 32, groups = k / group;
    const int8_t *a = x->codes + r0 * k;
    const float *sx = x->sx + r0, *sums = x->sums + r0;
    __m512 acc[VNNI_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i w[8];
        for (int q = 0; stored && q < 8; q++) w[q] = _mm512_load_si512(t + 512 * b + 64 * q);   /* unpacked */
        for (int q = 0; !stored && q < 4; q++) {
            __m512i v = _mm512_loadu_si512(t + 256 * b + 64 * q);
            w[q] = _mm512_and_si512(v, low);
#ifdef __GFNI__
            w[q + 4] = _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
            w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#endif
        }
        vnni_block(R, w, _mm512_load_ps(sw + 16 * b), a, k, b, sx, x->rows, acc);
    }
    finish_rows(R, acc, ow, sums, x->rows, groups, y + r0 * n + col, n, col);
}

#define VNNI_CASE(R) case R: row_tile_vnni(R, x, r0, k, group, stored ? ub : t, sw, ow, y, n, col, stored); break;
#define ROWS_CASE(R) case R: row_tile(R, x, r0, k, group, t, ub, !stored && m <= 16, sw, ow, cbuf, y, n, col); break;

/* a call's m rows against one record's 16 columns col..: 16 rows a tile on AMX, the last 1-6 (all rows,
 * VNNI_ROWS at a time, where `amx` is 0) on VNNI. `stored`: the codes are ub's unpacked B tiles
 * (llmc_gemm_q4_stored), else the record t's; *rows: the row count the tiles are configured for */
static inline __attribute__((always_inline)) void tile_rows(const struct act *x, int64_t m, int64_t k, int64_t group,
                                                            const uint8_t *t, uint8_t *ub, const int stored, int amx,
                                                            const float *sw, const float *ow, int32_t *cbuf,
                                                            float *y, int64_t n, int64_t col, int *rows) {
    for (int64_t r0 = 0, R; r0 < m; r0 += R) {
        R = m - r0 < 16 ? m - r0 : 16;
        if (R <= VNNI_ROWS || !amx) {
            if (R > VNNI_ROWS) R = VNNI_ROWS;
            switch (R) { VNNI_CASE(1) VNNI_CASE(2) VNNI_CASE(3) VNNI_CASE(4) VNNI_CASE(5) VNNI_CASE(6) }
            continue;
        }
        if (R != *rows) configure(*rows = (int)R);
        switch (R) {
            ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
            ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15) ROWS_CASE(16)
        }
    }
}

/* y [m, n] (rows n apart) = x [m, k] (rows x_stride floats apart) @ W.T from llmc_q4_repack's tiles;
 * 1 where done, 0 where AMX is not usable, the shapes disagree with the tiles' or memory runs out */
int64_t llmc_gemm_q4_amx(const float *x_rows, int64_t x_stride, int64_t m, const uint8_t *tiles, int64_t n,
                         int64_t k, int64_t group, int64_t zero_point, float *y, int64_t threads) {
    const struct head *h = (const struct head *)tiles;
    if (!llmc_amx_ready() || m < 1 || h->magic != MAGIC || h->n != n || h->k != k || h->group != group ||
        h->zero_point != (zero_point != 0))
        return 0;
    int64_t blocks = k / 32, groups = k / group, ntiles = (n + 15) / 16;
    struct act x;
    char *mem = act_alloc(&x, m, k, group);
    if (!mem) return 0;
    const uint8_t *shared_other = tiles + HEAD + ntiles * h->tile;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        quantise_rows(x_rows, x_stride, &x, k, group, 0);
        uint8_t *ub = aligned_alloc(64, blocks * 512 + (blocks + groups) * 64 + SLOTS * 1024);
        if (!ub) {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        } else {
            float *sw = (float *)(ub + blocks * 512), *ow = sw + 16 * blocks;
            int32_t *cbuf = (int32_t *)(ow + 16 * groups);
            int rows = 0;
#pragma omp for schedule(static) nowait
            for (int64_t j = 0; j < ntiles; j++) {
                const uint8_t *t = tiles + HEAD + j * h->tile;
                if (PREFETCH_TILES && m <= VNNI_ROWS && j + PREFETCH_TILES < ntiles)
                    for (int64_t c = 0; c < h->tile; c += 64) __builtin_prefetch(t + PREFETCH_TILES * h->tile + c, 0, 2);
                for (int64_t b = 0; m > 16 && b < blocks; b++) unpack_block(t + 256 * b, ub + 512 * b);
                column_params(h, t, shared_other, sw, ow);
                tile_rows(&x, m, k, group, t, ub, 0, 1, sw, ow, cbuf, y, n, 16 * j, &rows);
            }
            if (rows) _tile_release();
            free(ub);
        }
    }
    free(mem);
    return !failed;
}

/* ---- the same GEMM on the weights as stored ----
 *
 * llmc_gemm_q4_stored reads the codes as the artifact stores them ([n, k / 2], two a byte, the even k in
 * the low nibble) with their group params ([n, groups] fp32, fp16 or K-quant packed: half_params.h): no
 * repacked copy, so a model beyond the last-level cache keeps one copy of its weights. Per 16 columns,
 * each 4 blocks' 16 x 64 code bytes are transposed in registers (16 x 16 dwords) into the blocks' B tiles,
 * whose low nibbles pair with each block's even activations and high nibbles with its odd ones
 * (quantise_group's split order); the params are transposed likewise; then the rows run as from tiles.
 * D is exact and the fp32 sequence is llmc_gemm_q4_amx's: a row's outputs are the same bits from the
 * stored weights as from tiles, at any row count.
 *
 * It serves many rows (a prefill outside batch-invariant mode: cpu_native.gemm_q4_stored). A decode step
 * stays on gemv_int16.c's GEMV, whose rows round differently: the same transposes for one row (4 blocks'
 * tiles at a time, in registers, the next tile fetched into L2) decoded Llama-3B's shapes from its artifact
 * 8-18% slower (6.1-6.9 against 6.6-8.3 steps/s, Q4_K and Q4_1, 2-core Xeon): 16 rows read side by side
 * from 4 KiB pages of the file mapping, where the GEMV streams one. */

static inline __m512i high_nibbles(__m512i v) {
#ifdef __GFNI__
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
#endif
}

/* r[i]'s dword j to r[j]'s dword i: unpacks within 128-bit lanes, then a 4 x 4 transpose of the lanes */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {   /* r[4i + j]'s lane L: rows 4i..4i + 3, dword 4L + j */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
        __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), v3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
        t[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        t[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* blocks b0..b0 + nb - 1 (nb <= 4) of 16 columns (cols[c]: column c's code bytes) as unpacked B tiles at
 * out + 512 * (b - b0): rows 0-3 the low nibbles (codes 8i, 8i + 2, 8i + 4, 8i + 6 of each column), rows
 * 4-7 the high ones, as unpack_block lays out a record's */
static inline void stored_tiles(const uint8_t *const *cols, int64_t b0, int64_t nb, uint8_t *out) {
    __m512i r[16];
    __mmask64 live = nb >= 4 ? ~0ull : (1ull << (16 * nb)) - 1;
    for (int c = 0; c < 16; c++) r[c] = _mm512_maskz_loadu_epi8(live, cols[c] + 16 * b0);
    transpose16(r);
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < 4; i++) {
            _mm512_store_si512(out + 512 * b + 64 * i, _mm512_and_si512(r[4 * b + i], _mm512_set1_epi8(15)));
            _mm512_store_si512(out + 512 * b + 256 + 64 * i, high_nibbles(r[4 * b + i]));
        }
}

/* column_params' sw [blocks][16] and ow [groups][16] for columns c0.. (`live` of them; the lanes past them
 * repeat the last, whose outputs are never stored) from the stored params; buf: 2 * 16 * gp floats, gp
 * the groups rounded up to 16 */
static void stored_params(const void *s, const void *o, int64_t o_rows, int64_t fmt, int64_t zp, int64_t c0,
                          int64_t live, int64_t k, int64_t group, float *buf, float *sw, float *ow) {
    int64_t groups = k / group, per = group / 32, gp = (groups + 15) / 16 * 16;
    float *bs = buf, *bo = buf + 16 * gp;
    for (int c = 0; c < 16; c++) {
        int64_t row = c0 + (c < live ? c : live - 1);
        const float *sc = params_f32(s, fmt, row * groups, groups, bs + c * gp);
        const float *ot = params_f32(o, fmt, (o_rows ? row : 0) * groups, groups, bo + c * gp);
        if (sc != bs + c * gp) memcpy(bs + c * gp, sc, groups * sizeof(float));   /* fp32: where they are */
        if (ot != bo + c * gp) memcpy(bo + c * gp, ot, groups * sizeof(float));
    }
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        __m512i rs[16], ro[16];
        for (int c = 0; c < 16; c++) {
            rs[c] = _mm512_castps_si512(_mm512_loadu_ps(bs + c * gp + g0));
            ro[c] = _mm512_castps_si512(_mm512_loadu_ps(bo + c * gp + g0));
        }
        transpose16(rs);
        transpose16(ro);
        for (int64_t g = g0; g < groups && g < g0 + 16; g++) {
            __m512 sv = _mm512_castsi512_ps(rs[g - g0]), ov = _mm512_castsi512_ps(ro[g - g0]);
            if (zp) ov = _mm512_xor_ps(_mm512_mul_ps(sv, ov), _mm512_set1_ps(-0.f));   /* as column_params */
            for (int64_t b = g * per; b < (g + 1) * per; b++) _mm512_store_ps(sw + 16 * b, sv);
            _mm512_store_ps(ow + 16 * g, ov);
        }
    }
}


/* y [m, n] (rows n apart) = x [m, k] (rows x_stride floats apart) @ W.T from the stored weights: codes
 * [n, k / 2], scales s and offsets or zero points o [n or 1 (o_rows 0), k / group] in param format `fmt`
 * (0 fp32, 1 fp16, else K-quant packed with fmt groups a super-block); 1 where done, 0 where the shapes do
 * not fit (k and group multiples of 32, group dividing k) or memory runs out. Without AMX's permission
 * every row takes the VNNI path: the same bits, slower. */
int64_t llmc_gemm_q4_stored(const float *x_rows, int64_t x_stride, int64_t m, const uint8_t *packed, const void *s,
                            const void *o, int64_t o_rows, int64_t fmt, int64_t zp, int64_t n, int64_t k,
                            int64_t group, float *y, int64_t threads) {
    if (m < 1 || !shapes_fit(n, k, group)) return 0;
    int64_t blocks = k / 32, groups = k / group, ntiles = (n + 15) / 16, gp = (groups + 15) / 16 * 16;
    int amx = llmc_amx_ready();
    struct act x;
    char *mem = act_alloc(&x, m, k, group);
    if (!mem) return 0;
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        quantise_rows(x_rows, x_stride, &x, k, group, 1);
        int64_t unpacked = blocks * 512;
        uint8_t *ub = aligned_alloc(64, unpacked + (blocks + groups) * 64 + SLOTS * 1024 + 2 * 16 * gp * 4);
        if (!ub) {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        } else {
            float *sw = (float *)(ub + unpacked), *ow = sw + 16 * blocks;
            int32_t *cbuf = (int32_t *)(ow + 16 * groups);
            float *buf = (float *)(cbuf + SLOTS * 256);
            int rows = 0;
#pragma omp for schedule(static) nowait
            for (int64_t j = 0; j < ntiles; j++) {
                int64_t c0 = 16 * j, live = n - c0 < 16 ? n - c0 : 16;
                const uint8_t *cols[16];
                for (int c = 0; c < 16; c++) cols[c] = packed + (c0 + (c < live ? c : live - 1)) * (k / 2);
                stored_params(s, o, o_rows, fmt, zp, c0, live, k, group, buf, sw, ow);
                for (int64_t b0 = 0; b0 < blocks; b0 += 4)
                    stored_tiles(cols, b0, blocks - b0 < 4 ? blocks - b0 : 4, ub + 512 * b0);
                tile_rows(&x, m, k, group, NULL, ub, 1, amx, sw, ow, cbuf, y, n, c0, &rows);
            }
            if (rows) _tile_release();
            free(ub);
        }
    }
    free(mem);
    return !failed;
}

#else   /* no AMX-INT8 in this build: nothing runs here */

int64_t llmc_amx_ready(void) { return 0; }
int64_t llmc_q4_tiles_bytes(int64_t n, int64_t k, int64_t group, int64_t f16, int64_t other_row) { return 0; }
int64_t llmc_q4_repack(const uint8_t *packed, const void *scales, const void *other, int64_t other_row, int64_t f16,
                       int64_t zero_point, int64_t n, int64_t k, int64_t group, uint8_t *out, int64_t threads) {
    return 0;
}
int64_t llmc_gemm_q4_amx(const float *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int64_t n, int64_t k,
                         int64_t group, int64_t zero_point, float *y, int64_t threads) {
    return 0;
}
int64_t llmc_gemm_q4_stored(const float *x_rows, int64_t x_stride, int64_t m, const uint8_t *packed, const void *s,
                            const void *o, int64_t o_rows, int64_t fmt, int64_t zp, int64_t n, int64_t k,
                            int64_t group, float *y, int64_t threads) {
    return 0;
}

#endif
