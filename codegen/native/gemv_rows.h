/* What llmc's integer-activation GEMVs share, whatever the vector ISA (gemv_int16.c on AVX-512 BW,
 * gemv_avx2.c on AVX2): the blocking constants, the split of weight rows over threads, the tiling
 * of a call's activation rows, and the int8 activations' layout. */
#ifndef LLMC_GEMV_ROWS_H
#define LLMC_GEMV_ROWS_H
#include <stdint.h>
#include <stdlib.h>

#include "half_params.h"

#define BLOCK 64    /* int16 activation codes: one scale per block of 64 */
#define BLOCK8 32   /* int8 ones: per block of 32, as llama.cpp's Q8 activations */
#define MAX_ROWS 8  /* cpu_native.MAX_ROWS */
#define Q4_PREFETCH_ROWS 32   /* as decode_kernels.c's */

/* whether integer activations are on (gemv_int16.c); -1 only asks */
int64_t llmc_gemv_int16(int64_t on);

/* whether a call's shapes fit: K in whole blocks, each block within one group or halved by two */
static inline int rows_fit(int64_t m, int64_t k, int64_t group) {
    return k % BLOCK == 0 && (group == 32 || group % BLOCK == 0) && m >= 1 && m <= MAX_ROWS;
}

/* Rows of activations (of `row_bytes` codes each) a pass over the weights takes: as many as stay in L1 (32 KiB of
 * codes), whole chunks of MAX_ROWS. One pass for all of a 512-row prefill chunk read its codes from L2 for
 * every weight row: SmolLM2's 64 x (128 + 128) reached first tokens 39% later than at 8 rows a call. */
static inline int64_t row_tile(int64_t row_bytes) {
    int64_t rows = (32 << 10) / row_bytes / MAX_ROWS * MAX_ROWS;
    return rows > MAX_ROWS ? rows : MAX_ROWS;
}

/* The weight rows j < n split over the threads: each row's parameters as fp32 (PARAMS: scales into p,
 * zero points or offsets into po, through buf [PER_ROW]), its codes (ROW_BYTES a row) at `row`, the rows
 * AHEAD on fetched into L2, then DISPATCH. A macro, not a function taking the GEMV's kind, so that each
 * GEMV's loop is compiled with its own constants: one loop for both, branching per row, measured 5% slower
 * per code in cache. */
#define WEIGHT_ROWS(PER_ROW, PARAMS, ROW_BYTES, AHEAD, DISPATCH) \
    _Pragma("omp parallel for schedule(static) num_threads(threads)") \
    for (int64_t j = 0; j < n; j++) { \
        float buf[PER_ROW]; \
        const float *p, *po; \
        PARAMS; \
        (void)po; \
        if ((AHEAD) && j + (AHEAD) < n) \
            for (int64_t c = 0; c < (ROW_BYTES); c += 64) __builtin_prefetch(q + (j + (AHEAD)) * (ROW_BYTES) + c, 0, 2); \
        const void *row = q + j * (ROW_BYTES); \
        DISPATCH \
    }

/* a 4-bit weight row j's scales (p) and zero points or offsets (po) as fp32, converted where fp16; both
 * arrays the artifact's own, two streams beside the codes', fetched AHEAD rows ahead with them */
#define Q4_PARAMS(AHEAD) \
    do { \
        int64_t groups_ = k / group, bytes_ = param_row_bytes(f16, groups_); \
        for (int64_t c = 0; (AHEAD) && c < bytes_; c += 64) { \
            __builtin_prefetch((const char *)s + (j + (AHEAD)) * bytes_ + c, 0, 2); \
            __builtin_prefetch((const char *)o + (j + (AHEAD)) * (o_row ? bytes_ : 0) + c, 0, 2); \
        } \
        p = params_f32(s, f16, j * groups_, groups_, buf); \
        po = params_f32(o, f16, j * o_row, groups_, buf + groups_ + 16); \
    } while (0)

/* constant row counts keep each row's sums in registers, constant group sizes index scales by shifts:
 * groups of 32 (GGUF's Q4_0/Q4_1/Q8_0) always, 64 and 128 too unless the source defines FEW_GROUP_CASES
 * (gemv_avx2.c, whose halves doubled the code: 64 and 128 then take the general loop, the same arithmetic) */
#ifdef FEW_GROUP_CASES
#define MORE_GROUPS(KERNEL, M)
#else
#define MORE_GROUPS(KERNEL, M) case 64: KERNEL(M, 64); break; case 128: KERNEL(M, 128); break;
#endif
#define BY_ROWS(CASE) switch (m) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }

/* a call's activations: row r's int8 codes at codes + r * kp (kp: K rounded up to 128, the tail zero), in
 * the order a 64-byte load of weights unpacks them (per 128 codes: the 64 even ones, partners of the low
 * nibbles, then the 64 odd ones); block scales at scale + r * (kp / 32) (the tail's 0); group sums (of the
 * rounded activations) at sums[r * groups + g] */
struct act8 { int8_t *codes; float *scale; float *sums; int64_t kp; };

/* rows r0.. of a call's activations */
static inline struct act8 rows8(const struct act8 *a, int64_t r0, int64_t k, int64_t group) {
    struct act8 sub = {a->codes + r0 * a->kp, a->scale + r0 * (a->kp / BLOCK8), a->sums + r0 * (k / group), a->kp};
    return sub;
}

/* A call's activations: row r's int16 codes at codes + r * k, its block scales at scale + r * (k / 64),
 * and (for the 4-bit GEMV) its group sums at sums[r * groups + g]. */
struct act16 { int16_t *codes; float *scale; float *sums; };

/* each group's sum of the unrounded activations, in order (the 4-bit GEMVs' offset terms on int16 codes) */
static inline void group_sums(const float *x, int64_t k, int64_t group, float *sums) {
    for (int64_t g = 0; g < k / group; g++) {
        float s = 0;
        for (int64_t i = 0; i < group; i++) s += x[g * group + i];
        sums[g] = s;
    }
}

#endif
