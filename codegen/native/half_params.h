/* fp16 values to fp32: weight parameters (a GGUF's block scales and minimums) for decode_kernels.c's
 * row_params and gemv_int16.c's params_f32, 16 at a time with masked loads so a row's last few need no
 * scalar tail; one at a time from their bits, exactly, on any compiler (no _Float16 needed) for the
 * int4 KV cache's scales (decode_int4.c) and where the vector types are missing. */
#ifndef LLMC_HALF_PARAMS_H
#define LLMC_HALF_PARAMS_H
#include <stdint.h>
#include <string.h>

static inline float half_bits_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000 | (man << 13);   /* inf, nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {   /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A weight row's group parameters come in one of these formats (cpu_native.param_format): 0 fp32, 1 fp16,
 * or K-quant packed with `fmt` groups a super-block (8 or 16): per row, the super-blocks' fp16 factors d,
 * then one int8 c per group, the group's value d * c (exact in fp32: compiler/quant.py's pack_k_params). */
static inline int64_t param_row_bytes(int64_t fmt, int64_t groups) {
    return fmt == 0 ? 4 * groups : fmt == 1 ? 2 * groups : groups + 2 * (groups / fmt);
}

static inline float k_param(const uint8_t *row, int64_t groups, int64_t subs, int64_t g) {
    uint16_t bits;
    memcpy(&bits, row + 2 * (g / subs), sizeof bits);
    return half_bits_to_float(bits) * (float)((const int8_t *)row)[2 * (groups / subs) + g];
}

#if defined(__AVX512BW__)
#include <immintrin.h>

/* a packed row's `groups` values as floats into out, 16 at a time (masked: nothing written past groups);
 * lanes 0-7 and 8-15 each lie within one super-block (8 or 16 groups a super-block) */
static inline void k_params_to_floats(const uint8_t *row, int64_t groups, int64_t subs, float *out) {
    const uint8_t *ints = row + 2 * (groups / subs);
    for (int64_t g = 0; g < groups; g += 16) {
        __mmask16 live = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
        __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(live, ints + g)));
        int64_t upper = g + 8 < groups ? g + 8 : g;
        uint16_t d0, d1;
        memcpy(&d0, row + 2 * (g / subs), sizeof d0);
        memcpy(&d1, row + 2 * (upper / subs), sizeof d1);
        __m512 d = _mm512_insertf32x8(_mm512_set1_ps(half_bits_to_float(d0)),
                                      _mm256_set1_ps(half_bits_to_float(d1)), 1);
        _mm512_mask_storeu_ps(out + g, live, _mm512_mul_ps(c, d));
    }
}
#else
static inline void k_params_to_floats(const uint8_t *row, int64_t groups, int64_t subs, float *out) {
    for (int64_t g = 0; g < groups; g++) out[g] = k_param(row, groups, subs, g);
}
#endif

#if defined(__AVX512BW__)

static inline void halves_to_floats(const uint16_t *h, int64_t count, float *out) {
    for (int64_t g = 0; g < count; g += 16) {
        __mmask16 live = count - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - g)) - 1);
        _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, h + g)));
    }
}
#endif
#endif
