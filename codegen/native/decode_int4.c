/* Decode attention over an int4 KV cache (--kv-cache int4). Each cache slot holds, per KV head, head_dim / 2
 * bytes of 4-bit codes (code + 8; the low nibble is the even channel), then one fp16 scale per `group` channels:
 * runtime/kv_quant.py's quantize_kv_int4 writes them. Each (sequence, KV head) walks its keys once: a key and its
 * value are unpacked into two small fp32 rows, scored by the GQA group's query heads, and folded into their
 * outputs by an online softmax (running maximum and sum, rescaled when the maximum grows), so the context is
 * read as stored, 4.5 bits a value, and never gathered or dequantised whole as torch's path must. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half_params.h"

/* one KV head's packed row -> hd floats: exactly code * scale, as dequantize_kv_int4 (small integer times an
 * fp16 value is exact in fp32) */
static void unpack_head(const uint8_t *packed, int64_t hd, int64_t group, float *x) {
    const uint8_t *scale_bytes = packed + hd / 2;
    for (int64_t g = 0; g < hd / group; g++) {
        uint16_t bits;
        memcpy(&bits, scale_bytes + 2 * g, sizeof bits);
        float s = half_bits_to_float(bits);   /* not _Float16: compilers before GCC 12 lack it */
        for (int64_t c = g * group; c < (g + 1) * group; c += 2) {
            uint8_t two = packed[c / 2];
            x[c] = (float)((int)(two & 15) - 8) * s;
            x[c + 1] = (float)((int)(two >> 4) - 8) * s;
        }
    }
}

/* fold key t (score `score`, value `value`) into one query head's running output o, maximum *top, sum *total */
static void fold_key(float *o, float *top, float *total, float score, const float *value, int64_t hd) {
    if (score > *top) {
        float shrink = expf(*top - score);   /* exp(-inf) = 0 on the first key */
        for (int64_t d = 0; d < hd; d++) o[d] *= shrink;
        *total *= shrink;
        *top = score;
    }
    float p = expf(score - *top);
    *total += p;
    for (int64_t d = 0; d < hd; d++) o[d] += p * value[d];
}

/* q [b, heads * hd] fp32 (row stride q_stride), caches [slots, kv_heads * head bytes]; sequence s sees keys
 * first .. lens[s] - 1 through its block table (tables + s * table_width), first = lens[s] - window with a
 * sliding window (window > 0), else 0. out [b, heads * hd]; scratch 2 * hd floats per (sequence, KV head). */
void llmc_decode_attention_int4(const float *q, int64_t q_stride, const uint8_t *k_cache, const uint8_t *v_cache,
                                const int64_t *tables, int64_t table_width, const int32_t *lens, int64_t block,
                                int64_t window, int64_t b, int64_t heads, int64_t kv_heads, int64_t hd, int64_t group,
                                float scale, float *out, float *scratch, int64_t threads) {
    int64_t head_bytes = hd / 2 + 2 * (hd / group), row = kv_heads * head_bytes, per_kv = heads / kv_heads;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1 && b * kv_heads > 1)
    for (int64_t s = 0; s < b; s++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            float *key = scratch + (s * kv_heads + h) * 2 * hd, *value = key + hd;
            float *o = out + s * heads * hd + h * per_kv * hd, top[per_kv], total[per_kv];
            const float *qh = q + s * q_stride + h * per_kv * hd;
            const int64_t *table = tables + s * table_width;
            int64_t len = lens[s], first = window > 0 && len > window ? len - window : 0;
            memset(o, 0, per_kv * hd * sizeof(float));
            for (int64_t g = 0; g < per_kv; g++) top[g] = -INFINITY, total[g] = 0.f;
            for (int64_t t = first; t < len; t++) {
                int64_t at = (table[t / block] * block + t % block) * row + h * head_bytes;
                unpack_head(k_cache + at, hd, group, key);
                unpack_head(v_cache + at, hd, group, value);
                for (int64_t g = 0; g < per_kv; g++) {
                    float score = 0.f;
                    for (int64_t d = 0; d < hd; d++) score += qh[g * hd + d] * key[d];
                    fold_key(o + g * hd, &top[g], &total[g], score * scale, value, hd);
                }
            }
            for (int64_t g = 0; g < per_kv; g++)
                for (int64_t d = 0; d < hd; d++) o[g * hd + d] /= total[g];
        }
    }
}
