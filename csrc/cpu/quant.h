/* Stored weight encodings (GGML type ids) and their portable scalar decoding.
 *
 * A weight matrix is N rows of K values; each row is a whole number of blocks, so row r starts at
 * r * row_bytes(type, K). Block layouts follow the GGUF specification:
 *   F32 / F16 / BF16  one value per element
 *   Q8_0   32 values: f16 d, int8 q[32]                      w = d * q
 *   Q4_0   32 values: f16 d, u8 qs[16]                       w = d * (nibble - 8); low nibbles are
 *                                                            elements 0-15, high nibbles 16-31
 *   Q4_K  256 values: f16 d, f16 dmin, u8 scales[12], u8 qs[128]; 8 sub-blocks of 32 with 6-bit
 *                     scale sc and min m: w = d*sc*q - dmin*m; bytes qs[32j..32j+31] hold sub-block
 *                     2j in their low nibbles and 2j+1 in their high nibbles
 *   MXFP4  32 values: u8 e (E8M0), u8 qs[16]                 w = kvalues[nibble] * 2^(e-128)
 *                     (doubled E2M1 values times half the scale, as ggml does: bit-identical)
 *   Q4_1, Q5_0, Q5_1, IQ4_NL (32 values) and Q2_K, Q3_K, Q5_K, Q6_K, IQ4_XS (256 values): kquant.c
 *                     says each layout where it unpacks it, and decodes their rows.
 */
#ifndef S2MOE_QUANT_H
#define S2MOE_QUANT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30, T_MXFP4 = 39
};

/* kquant.c: one row of the types it unpacks */
void kq_dequant_row(int type, const uint8_t *src, float *dst, long K);

static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* IQ4_NL / IQ4_XS: the non-linear 4-bit grid */
static const int8_t KVALUES_IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Elements per block and bytes per block; 0 for an unknown type. */
static inline int block_elems(int type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q8_0: case T_Q4_0: case T_MXFP4: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_IQ4_NL: return 32;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: return 256;
    default: return 0;
    }
}

static inline int block_bytes(int type) {
    switch (type) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q8_0: return 34;
    case T_Q4_0: return 18;
    case T_Q4_K: return 144;
    case T_MXFP4: return 17;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_IQ4_NL: return 18;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    case T_IQ4_XS: return 136;
    default: return 0;
    }
}

/* Bytes of one row of K values, or 0 when K does not fill whole blocks. */
static inline size_t row_bytes(int type, long K) {
    int be = block_elems(type);
    if (be == 0 || K % be) return 0;
    return (size_t)(K / be) * (size_t)block_bytes(type);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float32 -> f16 bits, rounded to nearest even (as NumPy's astype and F16C): the exponent rebiased
 * with the mantissa's dropped bits rounded by integer addition; results below f16's normal range
 * come from one float addition that lines the value up with f16's subnormal step. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x, sign;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x >= 0x47800000u) return (uint16_t)(sign | (x > 0x7f800000u ? 0x7e00 : 0x7c00)); /* >= 65536, inf, NaN */
    if (x < 0x38800000u) { /* below 2^-14: subnormal or zero */
        const uint32_t magic_bits = 126u << 23; /* 0.5: its ulp is f16's subnormal step, 2^-24 */
        float a, magic;
        memcpy(&a, &x, 4);
        memcpy(&magic, &magic_bits, 4);
        a += magic;
        memcpy(&x, &a, 4);
        return (uint16_t)(sign | (x - magic_bits));
    }
    x += ((uint32_t)(15 - 127) << 23) + 0xfff + ((x >> 13) & 1);
    return (uint16_t)(sign | (x >> 13)); /* a carry past 0x7bff gives 0x7c00: inf, as it should */
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* ggml's E8M0 → float, halved (pairs with the doubled E2M1 table). */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K: the 6-bit scale and min of sub-block j (0..7). */
static inline void q4k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Decode one row of K values (portable path, and the embedding lookup). */
static inline void dequant_row(int type, const uint8_t *src, float *dst, long K) {
    long i, b, j;
    switch (type) {
    case T_F32:
        memcpy(dst, src, (size_t)K * 4);
        break;
    case T_F16:
        for (i = 0; i < K; i++) dst[i] = f16_to_f32(rd16(src + 2 * i));
        break;
    case T_BF16:
        for (i = 0; i < K; i++) dst[i] = bf16_to_f32(rd16(src + 2 * i));
        break;
    case T_Q8_0:
        for (b = 0; b < K / 32; b++, src += 34) {
            float d = f16_to_f32(rd16(src));
            for (j = 0; j < 32; j++) dst[32 * b + j] = d * (float)(int8_t)src[2 + j];
        }
        break;
    case T_Q4_0:
        for (b = 0; b < K / 32; b++, src += 18) {
            float d = f16_to_f32(rd16(src));
            for (j = 0; j < 16; j++) {
                dst[32 * b + j] = d * (float)((src[2 + j] & 0xF) - 8);
                dst[32 * b + j + 16] = d * (float)((src[2 + j] >> 4) - 8);
            }
        }
        break;
    case T_MXFP4:
        for (b = 0; b < K / 32; b++, src += 17) {
            float d = e8m0_half(src[0]);
            for (j = 0; j < 16; j++) {
                dst[32 * b + j] = d * (float)KVALUES_MXFP4[src[1 + j] & 0xF];
                dst[32 * b + j + 16] = d * (float)KVALUES_MXFP4[src[1 + j] >> 4];
            }
        }
        break;
    case T_Q4_K:
        for (b = 0; b < K / 256; b++, src += 144) {
            float d = f16_to_f32(rd16(src)), dmin = f16_to_f32(rd16(src + 2));
            const uint8_t *scales = src + 4, *qs = src + 16;
            float *y = dst + 256 * b;
            for (int p = 0; p < 4; p++) {
                uint8_t sc, m;
                q4k_scale_min(2 * p, scales, &sc, &m);
                float d1 = d * sc, m1 = dmin * m;
                q4k_scale_min(2 * p + 1, scales, &sc, &m);
                float d2 = d * sc, m2 = dmin * m;
                for (j = 0; j < 32; j++) {
                    y[64 * p + j] = d1 * (qs[32 * p + j] & 0xF) - m1;
                    y[64 * p + 32 + j] = d2 * (qs[32 * p + j] >> 4) - m2;
                }
            }
        }
        break;
    default:
        kq_dequant_row(type, src, dst, K);
    }
}

#endif
