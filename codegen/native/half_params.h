/* fp16 weight parameters (a GGUF's block scales and minimums) to fp32, shared by decode_kernels.c's
 * row_params and gemv_int16.c's params_f32: 16 at a time with masked loads, so a row's last few need
 * no scalar tail. */
#ifndef LLMC_HALF_PARAMS_H
#define LLMC_HALF_PARAMS_H
#if defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>

static inline void halves_to_floats(const uint16_t *h, int64_t count, float *out) {
    for (int64_t g = 0; g < count; g += 16) {
        __mmask16 live = count - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count - g)) - 1);
        _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, h + g)));
    }
}
#endif
#endif
