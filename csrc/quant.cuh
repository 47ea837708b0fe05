// Weight encodings the device kernels read in place: float types and the GGML blocks of the
// common GGUF files (Q4_K_M: Q4_K + Q6_K; Q8_0; Q4_0; GPT-OSS: MXFP4). A row is whole blocks, as
// GGML stores it; the kernels decode 32 values at a time (a "unit") into registers and never
// write a decoded weight to memory. Formats as gguf.quants (llama.cpp's reference) decodes them:
// tests/test_fused_kernels.py checks every type against it.
#pragma once

#ifndef S2_HD
#ifdef __CUDACC__
#define S2_HD __host__ __device__
#else
#define S2_HD
#include <cmath>
#endif
#endif

#define S2_UNIT 32  // values a lane decodes at once (a Q8_0 / Q4_0 / MXFP4 block, 1/8 of a K block)

// Loops over a unit's values or a pass's tokens run to a constant bound (guarded where fewer), fully
// unrolled on the device, so the arrays they index stay in registers instead of local memory.
#ifdef __CUDACC__
#define S2_UNROLL _Pragma("unroll")
#else
#define S2_UNROLL
#endif

// WEIGHT_TYPES in runtime/kernels/device.py
enum S2WeightType {
    S2_W_F32 = 0, S2_W_F16 = 1, S2_W_BF16 = 2, S2_W_Q8_0 = 3, S2_W_Q4_0 = 4, S2_W_Q4_K = 5, S2_W_Q6_K = 6,
    S2_W_MXFP4 = 7,
};

S2_HD inline float s2_bits_to_float(unsigned int u) {
    union { unsigned int u; float f; } c;
    c.u = u;
    return c.f;
}

// IEEE half → float, exactly (subnormals, infinities and NaN included).
S2_HD inline float s2_half_to_float(unsigned short h) {
    unsigned int sign = (unsigned int)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1fu) return s2_bits_to_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        float v = (float)man * 5.9604644775390625e-8f;  // man · 2^-24
        return sign ? -v : v;
    }
    return s2_bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));  // rebias 15 → 127
}

// float → IEEE half, rounding to nearest even as NumPy's astype(float16) does (an f16 KV cache).
S2_HD inline unsigned short s2_float_to_half(float f) {
    union { float f; unsigned int u; } c;
    c.f = f;
    unsigned int sign = (c.u >> 16) & 0x8000u, ax = c.u & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (unsigned short)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));  // inf, NaN
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds past 65504
    if (ax < 0x38800000u) {  // below 2^-14: a subnormal half, f · 2^24 rounded
        int e = (int)(ax >> 23), shift = 126 - e;
        if (e == 0 || shift > 24) return (unsigned short)sign;
        unsigned int m = (ax & 0x7fffffu) | 0x800000u, q = m >> shift, rem = m & ((1u << shift) - 1u);
        unsigned int half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) ++q;
        return (unsigned short)(sign | q);
    }
    unsigned int h = (ax >> 13) - (112u << 10), rem = ax & 0x1fffu;  // rebias 127 → 15
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
    return (unsigned short)(sign | h);
}

S2_HD inline float s2_f16_at(const unsigned char* p) { return s2_half_to_float((unsigned short)(p[0] | p[1] << 8)); }

// Twice an E2M1 (FP4) code's value: 0, 1, 2, 3, 4, 6, 8, 12, negated with bit 3 (gguf.quants'
// MXFP4 table), computed: a table indexed at run time would live in local memory.
S2_HD inline float s2_e2m1x2(int code) {
    int c = code & 7, v = c < 4 ? c : (2 | (c & 1)) << ((c >> 1) - 1);
    return (float)(code & 8 ? -v : v);
}

// Bytes of a row of K values (K a whole number of blocks: the host checks).
S2_HD inline long s2_row_bytes(int type, long K) {
    switch (type) {
        case S2_W_F32: return 4 * K;
        case S2_W_F16: case S2_W_BF16: return 2 * K;
        case S2_W_Q8_0: return K / 32 * 34;
        case S2_W_Q4_0: return K / 32 * 18;
        case S2_W_MXFP4: return K / 32 * 17;
        case S2_W_Q4_K: return K / 256 * 144;
        case S2_W_Q6_K: return K / 256 * 210;
    }
    return 0;
}

// Element i of a float matrix (F32, F16, BF16) at element offset i.
S2_HD inline float s2_weight(const void* w, long i, int type) {
    if (type == S2_W_F16) return s2_half_to_float(((const unsigned short*)w)[i]);
    if (type == S2_W_BF16) return s2_bits_to_float((unsigned int)((const unsigned short*)w)[i] << 16);
    return ((const float*)w)[i];
}

// The values of unit u (elements [32u, 32u + n), n = min(32, K - 32u)) of the row at ``row`` into
// out; returns n. Block types have K % 32 == 0, so n is 32 for them.
S2_HD inline int s2_unit(const unsigned char* row, int type, long K, long u, float* out) {
    long j0 = u * S2_UNIT;
    int n = K - j0 < S2_UNIT ? (int)(K - j0) : S2_UNIT;
    switch (type) {
        case S2_W_F32: case S2_W_F16: case S2_W_BF16:
            S2_UNROLL for (int i = 0; i < S2_UNIT; ++i) out[i] = i < n ? s2_weight(row, j0 + i, type) : 0.f;
            return n;
        case S2_W_Q8_0: {  // f16 d, 32 × int8
            const unsigned char* b = row + u * 34;
            float d = s2_f16_at(b);
            S2_UNROLL for (int i = 0; i < 32; ++i) out[i] = d * (float)(signed char)b[2 + i];
            return 32;
        }
        case S2_W_Q4_0: {  // f16 d, 16 bytes: low nibbles are values 0–15, high ones 16–31, offset 8
            const unsigned char* b = row + u * 18;
            float d = s2_f16_at(b);
            S2_UNROLL for (int i = 0; i < 16; ++i) {
                out[i] = d * (float)((b[2 + i] & 0xf) - 8);
                out[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
            }
            return 32;
        }
        case S2_W_MXFP4: {  // E8M0 scale, halved (s2_e2m1x2 doubles the E2M1 values), 16 bytes of nibbles
            const unsigned char* b = row + u * 17;
            unsigned int e = b[0];
            float d = s2_bits_to_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
            S2_UNROLL for (int i = 0; i < 16; ++i) {
                out[i] = d * s2_e2m1x2(b[1 + i] & 0xf);
                out[i + 16] = d * s2_e2m1x2(b[1 + i] >> 4);
            }
            return 32;
        }
        case S2_W_Q4_K: {  // f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
            const unsigned char* b = row + (u / 8) * 144;
            int s = (int)(u % 8);  // sub-block: 64-value chunk s / 2, low nibbles when s is even
            const unsigned char* sc = b + 4;
            int scale, min;
            if (s < 4) {
                scale = sc[s] & 63, min = sc[s + 4] & 63;
            } else {
                scale = (sc[s + 4] & 0xf) | ((sc[s - 4] >> 6) << 4);
                min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
            }
            float d = s2_f16_at(b) * (float)scale, m = s2_f16_at(b + 2) * (float)min;
            const unsigned char* q = b + 16 + 32 * (s / 2);
            int shift = 4 * (s % 2);
            S2_UNROLL for (int i = 0; i < 32; ++i) out[i] = d * (float)((q[i] >> shift) & 0xf) - m;
            return 32;
        }
        case S2_W_Q6_K: {  // 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d
            const unsigned char* b = row + (u / 8) * 210;
            int s = (int)(u % 8), half = s / 4, part = s % 4;  // 128-value half, 32-value part of it
            const unsigned char* ql = b + 64 * half + 32 * (part % 2);
            const unsigned char* qh = b + 128 + 32 * half;
            const signed char* scales = (const signed char*)(b + 192) + 8 * half + 2 * part;
            float d = s2_f16_at(b + 208);
            int lshift = 4 * (part / 2), hshift = 2 * part;
            S2_UNROLL for (int i = 0; i < 32; ++i) {
                int q = (((ql[i] >> lshift) & 0xf) | (((qh[i] >> hshift) & 3) << 4)) - 32;
                out[i] = d * (float)scales[i / 16] * (float)q;
            }
            return 32;
        }
    }
    return 0;
}

// Element j of a row (the embedding lookup): its unit decoded, one value kept.
S2_HD inline float s2_value(const unsigned char* row, int type, long K, long j) {
    if (type <= S2_W_BF16) return s2_weight(row, j, type);
    float v[S2_UNIT];
    s2_unit(row, type, K, j / S2_UNIT, v);
    return v[j % S2_UNIT];
}
