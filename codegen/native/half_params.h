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

#if defined(__AVX512BW__)
#include <immintrin.h>

static inline void halves_to_floats(const uint16_t *h, int64_t count, float *out) {
    for (int64_t g = 0; g < count; g += 16) {
        __mmask16 live = count - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - g)) - 1);
        _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, h + g)));
    }
}
#endif
#endif
