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

#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

#if defined(__AVX512BW__)

static inline void halves_to_floats(const uint16_t *h, int64_t count, float *out) {
    for (int64_t g = 0; g < count; g += 16) {
        __mmask16 live = count - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - g)) - 1);
        _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, h + g)));
    }
}
#endif

/* Row j's (scale, zero point or offset) pairs of a 4-bit weight, interleaved into buf [2 * groups] as
 * fp32: scales s [n, groups], zero points or offsets o (`o_row` values a row apart: 0 where every row
 * shares one, a constant zero point), both fp16 where f16, else fp32. The GEMVs read the artifact's own
 * arrays in place (mapped from its file, never copied at load), and a row's pairs made here cost a few
 * instructions per 16 groups against the row's k / 2 bytes of codes. */
static inline void q4_row_pairs(const void *s, const void *o, int64_t o_row, int64_t f16, int64_t j,
                                int64_t groups, float *buf) {
    int64_t g = 0;
#if defined(__AVX512BW__)
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (; g < groups; g += 16) {
        int64_t left = groups - g;
        __mmask16 live = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 a, b;
        if (f16) {
            a = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, (const uint16_t *)s + j * groups + g));
            b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, (const uint16_t *)o + j * o_row + g));
        } else {
            a = _mm512_maskz_loadu_ps(live, (const float *)s + j * groups + g);
            b = _mm512_maskz_loadu_ps(live, (const float *)o + j * o_row + g);
        }
        __mmask16 lo = left >= 8 ? (__mmask16)0xffff : (__mmask16)((1u << (2 * left)) - 1);
        __mmask16 hi = left >= 16 ? (__mmask16)0xffff : left <= 8 ? 0 : (__mmask16)((1u << (2 * (left - 8))) - 1);
        _mm512_mask_storeu_ps(buf + 2 * g, lo, _mm512_permutex2var_ps(a, first, b));
        _mm512_mask_storeu_ps(buf + 2 * g + 16, hi, _mm512_permutex2var_ps(a, second, b));
    }
#elif defined(__AVX2__) && defined(__F16C__)
    for (; g + 8 <= groups; g += 8) {
        __m256 a, b;
        if (f16) {
            a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + j * groups + g)));
            b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)o + j * o_row + g)));
        } else {
            a = _mm256_loadu_ps((const float *)s + j * groups + g);
            b = _mm256_loadu_ps((const float *)o + j * o_row + g);
        }
        __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
        _mm256_storeu_ps(buf + 2 * g, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(buf + 2 * g + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
#endif
    for (; g < groups; g++) {
        buf[2 * g] = f16 ? half_bits_to_float(((const uint16_t *)s)[j * groups + g]) : ((const float *)s)[j * groups + g];
        buf[2 * g + 1] = f16 ? half_bits_to_float(((const uint16_t *)o)[j * o_row + g]) : ((const float *)o)[j * o_row + g];
    }
}
#endif
