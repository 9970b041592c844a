/* llmc_gemv_q4_int16 and llmc_gemv_q8_int16, the 4-bit and int8 GEMVs on int16 activations, over a vector
 * ISA's kernels: a source includes this after defining quantise_row (one row of activations to int16 codes
 * per block of 64, in nibble order for the 4-bit GEMV, with its group sums), row_q4 and row_q8 (one weight
 * row's dot with M <= MAX_ROWS rows of them): gemv_int16.c on AVX-512 BW, gemv_avx2.c on AVX2. */
#ifndef LLMC_GEMV_INT16_H
#define LLMC_GEMV_INT16_H
#include "gemv_rows.h"

#define Q8_PREFETCH_ROWS 16

static int fits16(int64_t m, int64_t k, int64_t group) {
    return llmc_gemv_int16(-1) && rows_fit(m, k, group);
}

/* quantises m rows of x (`xs` floats apart) into one allocation; 0 where it cannot allocate */
static int quantise(const float *x, int64_t xs, int64_t m, int64_t k, int64_t group, int nibbles, struct act16 *a) {
    int64_t blocks = k / BLOCK, groups = nibbles ? k / group : 0;
    char *mem = malloc(m * (k * sizeof(int16_t) + (blocks + groups) * sizeof(float)));
    if (!mem) return 0;
    a->scale = (float *)mem;
    a->sums = nibbles ? a->scale + m * blocks : 0;
    a->codes = (int16_t *)(a->scale + m * (blocks + groups));
    for (int64_t r = 0; r < m; r++)
        quantise_row(x + r * xs, k, group, nibbles, a->codes + r * k, a->scale + r * blocks,
                     nibbles ? a->sums + r * groups : 0);
    return 1;
}

/* llmc_gemv_q4's and llmc_gemv_q8's work on int16 activations: 1 where done, 0 where the shapes do not fit
 * (K not a multiple of 64, groups neither 32 codes nor a multiple of 64) or it is turned off */
int64_t llmc_gemv_q4_int16(const float *x, int64_t x_stride, int64_t m, const uint8_t *q, const void *s,
                           const void *o, int64_t o_row, int64_t f16, int64_t zp, int64_t n, int64_t k, int64_t group,
                           float *y, int64_t threads) {
    struct act16 a;
    if (!fits16(m, k, group) || !quantise(x, x_stride, m, k, group, 1, &a))
        return 0;
#define Q4(M, G) row_q4(row, &a, k, M, p, po, zp, G, y + j, n)
#define Q4_CASE(M) case M: switch (group) { \
            case 32: Q4(M, 32); break; MORE_GROUPS(Q4, M) \
            default: Q4(M, group); } break;
    WEIGHT_ROWS(2 * (k / group) + 32, Q4_PARAMS(Q4_PREFETCH_ROWS), k / 2, Q4_PREFETCH_ROWS, BY_ROWS(Q4_CASE))
#undef Q4_CASE
#undef Q4
    free(a.scale);
    return 1;
}

int64_t llmc_gemv_q8_int16(const float *x, int64_t x_stride, int64_t m, const int8_t *q, const void *params,
                           int64_t f16, int64_t n, int64_t k, int64_t group, float *y, int64_t threads) {
    struct act16 a;
    if (!fits16(m < MAX_ROWS ? m : MAX_ROWS, k, group) || !quantise(x, x_stride, m, k, group, 0, &a))
        return 0;
    /* any number of rows m, as llmc_gemv_q4_int8 takes them: each weight row against MAX_ROWS at a time */
#define Q8(M, G) row_q8(row, &sub, k, M, p, G, y + r0 * n + j, n)
#define Q8_CASE(M) case M: switch (group) { \
            case 32: Q8(M, 32); break; MORE_GROUPS(Q8, M) default: Q8(M, group); } break;
#define CHUNKS \
    for (int64_t r0 = t0; r0 < t1; r0 += MAX_ROWS) { \
        struct act16 sub = a; \
        sub.codes += r0 * k; \
        sub.scale += r0 * (k / BLOCK); \
        switch (t1 - r0 < MAX_ROWS ? t1 - r0 : MAX_ROWS) { \
            Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) Q8_CASE(5) Q8_CASE(6) Q8_CASE(7) Q8_CASE(8) } \
    }
    for (int64_t t0 = 0, tile = row_tile(2 * k); t0 < m; t0 += tile) {   /* int16 codes: 2 bytes each */
        int64_t t1 = t0 + tile < m ? t0 + tile : m;
        WEIGHT_ROWS(k / group + 16, (p = params_f32(params, f16, j * (k / group), k / group, buf), po = 0), k,
                    Q8_PREFETCH_ROWS, CHUNKS)
    }
#undef CHUNKS
#undef Q8_CASE
#undef Q8
    free(a.scale);
    return 1;
}

#endif
