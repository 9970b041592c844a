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

static inline void halves_to_floats(const uint16_t *h, int64_t count, float *out) {
    for (int64_t g = 0; g < count; g += 16) {
        __mmask16 live = count - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - g)) - 1);
        _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, h + g)));
    }
}

/* a packed row's `groups` values as floats into out, 16 at a time (masked: nothing written past groups):
 * up to 16 super-blocks' factors in one register (vcvtph2ps), which a lane index (its group / subs)
 * picks for each group's integer; converting the factors one by one cost more than the row's codes */
static inline void k_params_to_floats(const uint8_t *row, int64_t groups, int64_t subs, float *out) {
    int64_t supers = groups / subs;
    const int8_t *ints = (const int8_t *)(row + 2 * supers);
    const __m512i step = _mm512_set1_epi32((int)(16 / subs));
    for (int64_t s0 = 0; s0 < supers; s0 += 16) {
        int64_t count = supers - s0 < 16 ? supers - s0 : 16;
        __m512 f = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << count) - 1),
                                                            (const uint16_t *)row + s0));
        __m512i pick = subs == 8 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                 : _mm512_setzero_si512();
        for (int64_t g = s0 * subs; g < (s0 + count) * subs; g += 16) {
            __mmask16 live = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
            __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(live, ints + g)));
            _mm512_mask_storeu_ps(out + g, live, _mm512_mul_ps(c, _mm512_permutexvar_ps(pick, f)));
            pick = _mm512_add_epi32(pick, step);
        }
    }
}
#else
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline void halves_to_floats(const uint16_t *h, int64_t count, float *out) {
    int64_t g = 0;
#if defined(__F16C__)
    for (; g + 8 <= count; g += 8) _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
    for (; g < count; g++) out[g] = _cvtsh_ss(h[g]);
#endif
    for (; g < count; g++) out[g] = half_bits_to_float(h[g]);
}

static inline void k_params_to_floats(const uint8_t *row, int64_t groups, int64_t subs, float *out) {
    for (int64_t g = 0; g < groups; g++) out[g] = k_param(row, groups, subs, g);
}
#endif

/* a row's `count` params starting at element s0 (a packed row: at row s0 / count) as floats: where they
 * are (fp32), else converted into buf */
static inline const float *params_f32(const void *p, int64_t f16, int64_t s0, int64_t count, float *buf) {
    if (!f16) return (const float *)p + s0;
    if (f16 == 1) halves_to_floats((const uint16_t *)p + s0, count, buf);
    else k_params_to_floats((const uint8_t *)p + s0 / count * param_row_bytes(f16, count), count, f16, buf);
    return buf;
}
#endif
