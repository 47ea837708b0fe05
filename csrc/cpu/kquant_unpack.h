/* A super-block of the K-quants and IQ4_XS unpacked into registers: shared by kquant_avx2.c's rows
 * and tiles and kquant_amx.c's panels, so every path meets the same codes and integer scales. */
#ifndef S2MOE_KQUANT_UNPACK_H
#define S2MOE_KQUANT_UNPACK_H

#include "quant.h"
#include "simd.h"

#ifdef HAVE_AVX2_PATH

INLINE_AVX2 float h2f(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* 16 bytes of nibbles → 32 codes: the low nibbles (elements 0-15), then the high ones. */
INLINE_AVX2 __m256i nib_block(__m128i q) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

INLINE_AVX2 __m256i iq4_table(void) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_IQ4)); }
/* Two int16 scales, one per run of 16 of a block of 32, as madd's second operand. */
INLINE_AVX2 __m256i run_scales(int a, int b) {
    return _mm256_set_m128i(_mm_set1_epi16((short)b), _mm_set1_epi16((short)a));
}

/* A super-block's codes c[8] (unsigned, but IQ4_XS's signed), the int16 scale pairs sv[8] of its
 * blocks of 32, the int16 factors mv of its runs' Σ q, and the float multipliers of the two sums.
 * Returns whether the Σ q term exists. */
INLINE_AVX2 int super_block(const int TYPE, const uint8_t *b, __m256i *c, __m256i *sv, __m256i *mv, float *dsum,
                            float *dq) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    if (TYPE == T_Q4_K || TYPE == T_Q5_K) { /* d, dmin, scales[12], (Q5_K: qh[32],) qs[128] */
        const uint8_t *qs = b + (TYPE == T_Q5_K ? 48 : 16);
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 16));
        for (int p = 0; p < 4; p++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (TYPE == T_Q5_K) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p), m1), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p + 1), m1), 4));
            }
            c[2 * p] = lo;
            c[2 * p + 1] = hi;
        }
        /* the eight 6-bit scales and mins, four to a word: bytes 0-3 hold the low six bits of
         * scales 0-3, bytes 4-7 those of mins 0-3; bytes 8-11 the low four bits of scales and
         * mins 4-7, whose top two bits are the top bits of bytes 0-3 (scales) and 4-7 (mins) */
        const uint32_t u0 = rd32(b + 4), u1 = rd32(b + 8), u2 = rd32(b + 12);
        const uint32_t sc[2] = {u0 & 0x3F3F3F3Fu, (u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u)};
        const uint32_t mn[2] = {u1 & 0x3F3F3F3Fu, ((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u)};
        for (int j = 0; j < 8; j++) sv[j] = _mm256_set1_epi16((short)((sc[j / 4] >> (8 * (j % 4))) & 0xFF));
        const __m128i m8 = _mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]);
        *mv = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)); /* each min for its two runs */
        *dsum = h2f(b);
        *dq = -h2f(b + 2);
        return 1;
    }
    if (TYPE == T_Q6_K) { /* ql[128], qh[64], int8 scales[16], d; code − 32 */
        for (int h = 0; h < 2; h++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h)),
                          q1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i lo[4] = {_mm256_and_si256(q0, m4), _mm256_and_si256(q1, m4),
                                   _mm256_and_si256(_mm256_srli_epi16(q0, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(q1, 4), m4)};
            for (int i = 0; i < 4; i++)
                c[4 * h + i] = _mm256_or_si256(lo[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), m3), 4));
        }
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int g = 0; g < 8; g++) sv[g] = run_scales(sc[2 * g], sc[2 * g + 1]);
        *mv = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)), 5); /* 32 · sc */
        *dsum = h2f(b + 208);
        *dq = -*dsum;
        return 1;
    }
    if (TYPE == T_Q2_K || TYPE == T_Q3_K) {
        const uint8_t *qs = b + (TYPE == T_Q2_K ? 16 : 32);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int i = 0; i < 4; i++) {
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * i), m3);
                if (TYPE == T_Q3_K) /* the hmask bit is the code's third bit; the code is less 4 */
                    v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + i), m1), 2));
                c[4 * h + i] = v;
            }
        }
        if (TYPE == T_Q2_K) { /* scales[16]: scale in the low nibble, min in the high one */
            const __m128i s8 = _mm_loadu_si128((const __m128i *)b);
            for (int g = 0; g < 8; g++) sv[g] = run_scales(b[2 * g] & 0xF, b[2 * g + 1] & 0xF);
            *mv = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(0x0F)));
            *dsum = h2f(b + 80);
            *dq = -h2f(b + 82);
            return 1;
        }
        const uint8_t *s = b + 96;
        int16_t sc[16];
        for (int j = 0; j < 16; j++) {
            int lo = j < 8 ? s[j] & 0xF : s[j - 8] >> 4, hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
            sc[j] = (int16_t)((lo | (hi << 4)) - 32);
        }
        for (int g = 0; g < 8; g++) sv[g] = run_scales(sc[2 * g], sc[2 * g + 1]);
        *mv = _mm256_slli_epi16(_mm256_loadu_si256((const __m256i *)sc), 2); /* 4 · sc */
        *dsum = h2f(b + 108);
        *dq = -*dsum;
        return 1;
    }
    /* IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]; 6-bit scales less 32, codes by table */
    const int sh = rd16(b + 2);
    for (int g = 0; g < 8; g++) {
        int ls = ((b[4 + g / 2] >> (4 * (g % 2))) & 0xF) | (((sh >> (2 * g)) & 3) << 4);
        c[g] = _mm256_shuffle_epi8(iq4_table(), nib_block(_mm_loadu_si128((const __m128i *)(b + 8 + 16 * g))));
        sv[g] = _mm256_set1_epi16((short)(ls - 32));
    }
    *mv = _mm256_setzero_si256();
    *dsum = h2f(b);
    *dq = 0.0f;
    return 0;
}

#endif

#endif
