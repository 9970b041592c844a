/* llmc_gemv_q4_int8 and llmc_gemv_q4_int8_fits, the 4-bit GEMV on int8 activations, over a vector ISA's
 * kernels: a source includes this after defining quantise_row8 (one row of activations to int8 codes, block
 * scales and group sums, struct act8's layout) and row_q4_8 (one weight row's dot with M <= MAX_ROWS rows of
 * them, M and the group size G compile-time constants where the call passes them): gemv_int16.c on
 * AVX-512 BW, gemv_avx2.c on AVX2. */
#ifndef LLMC_GEMV_Q4_INT8_H
#define LLMC_GEMV_Q4_INT8_H
#include "gemv_rows.h"

static int quantise8(const float *x, int64_t xs, int64_t m, int64_t k, int64_t group, struct act8 *a) {
    int64_t kp = (k + 127) / 128 * 128, blocks = kp / BLOCK8, groups = k / group;
    char *mem = malloc(m * (kp + (blocks + groups) * sizeof(float)));
    if (!mem) return 0;
    a->kp = kp;
    a->scale = (float *)mem;
    a->sums = a->scale + m * blocks;
    a->codes = (int8_t *)(a->sums + m * groups);
    for (int64_t r = 0; r < m; r++)
        quantise_row8(x + r * xs, k, kp, group, a->codes + r * kp, a->scale + r * blocks, a->sums + r * groups);
    return 1;
}

/* whether the int8-activation GEMV takes weights of K `k` in groups of `group` (fits, and a pair of blocks
 * never straddles two groups of more than 64) */
static int fits8(int64_t m, int64_t k, int64_t group) {
    return llmc_gemv_int16(-1) && rows_fit(m < MAX_ROWS ? m : MAX_ROWS, k, group) && (group == 32 || group == 64 || group % 128 == 0);
}

/* llmc_gemv_q4's work on int8 activations where the shapes fit, for any number of rows m (each weight row
 * against MAX_ROWS of them at a time, so the weights are read once whatever m; a row's sums do not depend
 * on which others share its call): 1 where done, else 0. The weight rows
 * `ahead` on (0: none) are fetched into L2 as the int16 path fetches them: where the model's weights sit in
 * the last-level cache that hides its latency (SmolLM2 on the 2-core Xeon: 85-88 -> 100-103 decode steps/s),
 * where they stream from DRAM the loop is cheap enough for the hardware prefetcher alone, and extra
 * prefetches only take line fill buffers (Llama-3B: 7.7-8.0 -> 7.1-7.4). */
int64_t llmc_gemv_q4_int8(const float *x, int64_t x_stride, int64_t m, const uint8_t *q, const void *s,
                          const void *o, int64_t o_row, int64_t f16, int64_t zp, int64_t n, int64_t k, int64_t group,
                          float *y, int64_t threads, int64_t ahead) {
    struct act8 a;
    if (!fits8(m, k, group) || !quantise8(x, x_stride, m, k, group, &a))
        return 0;
#define Q4(M, G) row_q4_8(row, &sub, k, M, p, po, zp, G, y + r0 * n + j, n)
#define Q4_CASE(M) case M: switch (group) { \
            case 32: Q4(M, 32); break; MORE_GROUPS(Q4, M) \
            default: Q4(M, group); } break;
#define CHUNKS \
    for (int64_t r0 = t0; r0 < t1; r0 += MAX_ROWS) { \
        struct act8 sub = rows8(&a, r0, k, group); \
        int64_t rows = t1 - r0 < MAX_ROWS ? t1 - r0 : MAX_ROWS; \
        switch (rows) { Q4_CASE(1) Q4_CASE(2) Q4_CASE(3) Q4_CASE(4) Q4_CASE(5) Q4_CASE(6) Q4_CASE(7) Q4_CASE(8) } \
    }
#ifdef TILES_Q4_8
    /* where the ISA's source has a faster loop for several rows (the same sums) */
    if (m >= 2 && TILES_Q4_8(&a, m, q, s, o, o_row, f16, zp, n, k, group, y, threads)) {
        free(a.scale);
        return 1;
    }
#endif
    for (int64_t t0 = 0, tile = row_tile(a.kp); t0 < m; t0 += tile) {
        int64_t t1 = t0 + tile < m ? t0 + tile : m;
        WEIGHT_ROWS(2 * (k / group) + 32, Q4_PARAMS(ahead), k / 2, ahead, CHUNKS)
    }
#undef CHUNKS
#undef Q4_CASE
#undef Q4
    free(a.scale);
    return 1;
}

/* whether the 4-bit GEMV of these shapes runs on int8 activations when asked (1) or stays on int16 ones */
int64_t llmc_gemv_q4_int8_fits(int64_t k, int64_t group) {
    return fits8(1, k, group);
}

#endif
