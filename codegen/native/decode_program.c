/* llmc's native decode program: a decode step's run of plan steps (the GEMVs, norms, SwiGLU and
 * attention of every layer) as one call. runtime/native_decode.py encodes each step as an op of
 * OP_FIELDS int64s (kind, then pointers into a fixed arena, weights, sizes, floats as their bits) once
 * at load; per step only the row count, rotary tables, cache metadata and scratch change (`step`). Each
 * op runs the kernel of decode_kernels.c the plan walk's own launch would (the same arithmetic), so
 * what this saves is the walk's Python: ~4-8 us a launch, 8-9 launches a layer. */

#include <stdint.h>
#include <string.h>
#include <time.h>

void llmc_gemv_q8(const float *x, int64_t x_stride, int64_t m, const int8_t *q, const void *scales, int64_t f16,
                  int64_t n, int64_t k, int64_t group, float *y, int64_t threads);
void llmc_gemv_q4(const float *x, int64_t x_stride, int64_t m, const uint8_t *q, const void *s, const void *o,
                  int64_t o_row, int64_t f16, int64_t zp, int64_t n, int64_t k, int64_t group, float *y,
                  int64_t threads, int64_t flags);
int64_t llmc_gemm_q4_amx(const float *x, int64_t x_stride, int64_t m, const uint8_t *tiles, int64_t n, int64_t k,
                         int64_t group, int64_t zero_point, float *y, int64_t threads);
int64_t llmc_gemv_q4_int8_fits(int64_t k, int64_t group);
#define Q4_TILES 4   /* cpu_native.q4_flags */
void llmc_gemv_f32(const float *x, int64_t x_stride, int64_t m, const float *w, const float *bias, int64_t n,
                   int64_t k, float *y, int64_t threads);
void llmc_decode_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                           const float *v, int64_t v_stride, const float *cos, const float *sin,
                           float *k_cache, float *v_cache, const int64_t *slots, const int64_t *tables,
                           int64_t table_width, const int32_t *lens, int64_t block, int64_t window,
                           int64_t b, int64_t heads, int64_t kv_heads, int64_t hd, float scale,
                           float *out, float *scratch, int64_t threads, int64_t invariant);
void llmc_add_rms_norm(const float *x, const float *residual, const float *weight, float *out, float *summed,
                       int64_t rows, int64_t n, int64_t x_stride, int64_t r_stride, float eps);
void llmc_swiglu(const float *x, int64_t x_stride, int64_t m, int64_t inter, float *out);

#define OP_FIELDS 16
enum { OP_GEMV_Q8 = 1, OP_GEMV_F32 = 2, OP_ATTENTION = 3, OP_ADD_RMS_NORM = 4, OP_SWIGLU = 5, OP_GEMV_Q4 = 6, OP_SCALE = 7 };
/* the step's fields, in the order NativeDecode.run (runtime/native_decode.py) writes them */
enum { S_ROWS, S_COS, S_SIN, S_SLOTS, S_TABLES, S_WIDTH, S_LENS, S_BLOCK, S_SCRATCH, S_CACHES, S_THREADS, S_SECONDS };
#define OP_KINDS 8   /* native_decode.OP_KINDS */

#define P(i, T) ((T)(intptr_t)op[i])

static float bits_float(int64_t bits) {
    uint32_t b = (uint32_t)bits;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static void add_bias(float *y, const float *bias, int64_t m, int64_t n) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++) y[r * n + j] += bias[j];
}

/* out[r, i] = x[r, i] * w[i] (AWQ's inverse scales on a GEMV's input) */
static void scale_columns(const float *x, int64_t x_stride, const float *w, float *out, int64_t m, int64_t n) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < n; i++) out[r * n + i] = x[r * x_stride + i] * w[i];
}

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* run n_ops ops of `ops` for the step `step`; where its S_SECONDS is not NULL, each op's wall time is added
 * to that double [OP_KINDS] at its kind (bench/decode_step.py --by-kernel) */
void llmc_decode_program(const int64_t *ops, int64_t n_ops, const int64_t *step) {
    int64_t m = step[S_ROWS], threads = step[S_THREADS];
    const int64_t *caches = (const int64_t *)(intptr_t)step[S_CACHES];
    double *seconds = (double *)(intptr_t)step[S_SECONDS], t0 = 0;
    for (int64_t i = 0; i < n_ops; i++) {
        const int64_t *op = ops + i * OP_FIELDS;
        if (seconds) t0 = seconds_now();
        switch (op[0]) {
        case OP_GEMV_Q8:
            llmc_gemv_q8(P(1, const float *), op[2], m, P(3, const int8_t *), P(4, const void *), op[5], op[6],
                         op[7], op[8], P(9, float *), threads);
            if (op[10]) add_bias(P(9, float *), P(10, const float *), m, op[6]);
            break;
        case OP_GEMV_Q4:
            /* Q4_TILES: op[3] is the weights' AMX tiles (gemm_amx.c), while int8 activations are on */
            if (!(op[14] & Q4_TILES) || !llmc_gemv_q4_int8_fits(op[7], op[8]) ||
                !llmc_gemm_q4_amx(P(1, const float *), op[2], m, P(3, const uint8_t *), op[6], op[7], op[8], op[11],
                                  P(9, float *), threads))
                llmc_gemv_q4(P(1, const float *), op[2], m, P(15, const uint8_t *), P(4, const void *),
                             P(12, const void *), op[13], op[5], op[11], op[6], op[7], op[8], P(9, float *), threads,
                             op[14] & ~Q4_TILES);
            if (op[10]) add_bias(P(9, float *), P(10, const float *), m, op[6]);
            break;
        case OP_GEMV_F32:
            llmc_gemv_f32(P(1, const float *), op[2], m, P(3, const float *), P(7, const float *), op[4], op[5],
                          P(6, float *), threads);
            break;
        case OP_ATTENTION: {
            const int64_t *cache = caches + 2 * op[7];
            llmc_decode_attention(P(1, const float *), op[2], P(3, const float *), op[4], P(5, const float *), op[6],
                                  op[14] ? (const float *)(intptr_t)step[S_COS] : 0,
                                  op[14] ? (const float *)(intptr_t)step[S_SIN] : 0,
                                  (float *)(intptr_t)cache[0], (float *)(intptr_t)cache[1],
                                  (const int64_t *)(intptr_t)step[S_SLOTS], (const int64_t *)(intptr_t)step[S_TABLES],
                                  step[S_WIDTH], (const int32_t *)(intptr_t)step[S_LENS], step[S_BLOCK], op[8], m,
                                  op[9], op[10], op[11], bits_float(op[12]), P(13, float *),
                                  (float *)(intptr_t)step[S_SCRATCH], threads, op[15]);
            break;
        }
        case OP_ADD_RMS_NORM:
            llmc_add_rms_norm(P(1, const float *), P(3, const float *), P(5, const float *), P(6, float *),
                              P(7, float *), m, op[8], op[2], op[4], bits_float(op[9]));
            break;
        case OP_SCALE:
            scale_columns(P(1, const float *), op[2], P(3, const float *), P(4, float *), m, op[5]);
            break;
        case OP_SWIGLU:
            llmc_swiglu(P(1, const float *), op[2], m, op[4], P(3, float *));
            break;
        }
        if (seconds) seconds[op[0]] += seconds_now() - t0;
    }
}
