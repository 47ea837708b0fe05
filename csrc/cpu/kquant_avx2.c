/* kquant.c's rows on AVX2 (+ FMA, F16C): codes unpacked into registers, integer products.
 *
 * The K-quants and IQ4_XS meet activations quantised in blocks of 256, one per super-block (as
 * llama.cpp's q8_K). Then a super-block's whole sum stays in integers: per block of 32,
 *     maddubs(codes, q)   → 16 sums of two products (unsigned codes ≤ 63 times |q| ≤ 127: ≤ 16002)
 *     madd(·, scales)     → 8 int32, each run of 16 weighed by its integer scale,
 * and the codes' offset (Q6_K's 32, Q3_K's 4) and the mins (Q2_K, Q4_K, Q5_K) come from the runs'
 * Σ q, times the integer scales or mins, in one madd. Both sums are added across lanes in integers,
 * and two float steps finish the super-block (kq_step, the same order on every path):
 *     acc += S · (d · dx);  acc += M · (−dm · dx),   S = Σ_runs sc · Σ code·q,  M = Σ_runs mn · Σ q.
 * The 32-value types (Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4) meet blocks of 32 (as llama.cpp's q8_0 / q8_1):
 * per block, the integer sum, then one FMA with d · dx, and the min as d_m · dx · Σ q.
 * All integer sums are exact (the largest, a Q6_K super-block, stays under 2^26).
 */
#include "kquant.h"

#include <string.h>

#include "dot.h"
#include "kquant_unpack.h"
#include "quant.h"
#include "simd.h"

#ifdef HAVE_AVX2_PATH

#define KQ_TB 8 /* tokens whose sums stay in registers while a row's unit is unpacked */
/* Super-blocks asked for ahead of the one in use. One row is one stream, yet without it a decode
 * token's rows from memory ran at 9 GB/s where Q4_0's (which asks too) ran at 15; 8 ahead gave
 * 12.4, 16 and 32 14.4 (the two cores' share of this VM's memory bandwidth). */
#define KQ_AHEAD 16

INLINE_AVX2 int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

/* A (row, token) pair's float steps after super-block u, from its exact integer sums S (codes ·
 * scales · q) and M (offsets or mins · Σ q): the order every path keeps, one rounding each (the
 * tiles take the same steps eight pairs to a vector: the same bits). */
INLINE_AVX2 float kq_step(float acc, int S, int M, int has_q, float dsum, float dq, float dx) {
    acc = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss((float)S), _mm_set_ss(dsum * dx), _mm_set_ss(acc)));
    if (has_q) acc = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss((float)M), _mm_set_ss(dq * dx), _mm_set_ss(acc)));
    return acc;
}

/* d = max|x| / 127 over each block of B, q = x · (1/d) rounded half to even: the same float32
 * operations as kquant.c's portable loop, so the same codes. */
AVX2 void act_quantize_avx2(const float *x, long K, int B, int8_t *q, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long g = 0; g < K / B; g++) {
        const float *p = x + (size_t)B * g;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < B; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i)));
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        float dd = _mm_cvtss_f32(s) / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
        d[g] = dd;
        const __m256 vid = _mm256_set1_ps(id);
        for (int i = 0; i < B; i += 32) {
            __m256i n[4];
            for (int k = 0; k < 4; k++)
                n[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i + 8 * k), vid),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            /* packs work within 128-bit lanes: the permute puts the 32 codes back in order */
            __m256i c = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
            c = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + (size_t)B * g + i), c);
        }
    }
}

/* 32 bits → 32 bytes, 0x10 where the bit is set (Q5_0 / Q5_1's fifth bits). */
INLINE_AVX2 __m256i fifth_bits(uint32_t qh) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}

INLINE_AVX2 __m256i mxfp4_table(void) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_MXFP4)); }

/* ------------------------------------------------------------------------------------------ */
/* the 32-value blocks                                                                        */

/* Block b's codes (signed for Q5_0 and IQ4_NL) and its scale d and min. */
INLINE_AVX2 __m256i small_block(const int TYPE, const uint8_t *b, float *d, float *m) {
    const int at = TYPE == T_Q4_1 ? 4 : TYPE == T_Q5_0 ? 6 : TYPE == T_Q5_1 ? 8 : TYPE == T_MXFP4 ? 1 : 2;
    __m256i v = nib_block(_mm_loadu_si128((const __m128i *)(b + at)));
    if (TYPE == T_Q5_0) v = _mm256_sub_epi8(_mm256_or_si256(v, fifth_bits(rd32(b + 2))), _mm256_set1_epi8(16));
    if (TYPE == T_Q5_1) v = _mm256_or_si256(v, fifth_bits(rd32(b + 4)));
    if (TYPE == T_IQ4_NL) v = _mm256_shuffle_epi8(iq4_table(), v);
    if (TYPE == T_MXFP4) v = _mm256_shuffle_epi8(mxfp4_table(), v);
    *d = TYPE == T_MXFP4 ? e8m0_half(b[0]) : h2f(b);
    *m = TYPE == T_Q4_1 || TYPE == T_Q5_1 ? h2f(b + 2) : 0.0f;
    return v;
}

INLINE_AVX2 void small_rows(const int TYPE, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_acts *a,
                            float *const *ys, int nb) {
    const long G = K / 32;
    const int bb = block_bytes(TYPE);
    const __m256i ones = _mm256_set1_epi16(1);
    for (long r = r0; r < r1; r++) {
        const uint8_t *row = W + (size_t)r * rb;
        for (int t0 = 0; t0 < nb; t0 += KQ_TB) {
            const int nt = nb - t0 < KQ_TB ? nb - t0 : KQ_TB;
            __m256 acc[KQ_TB];
            float mins[KQ_TB];
            for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps(), mins[t] = 0.0f;
            for (long g = 0; g < G; g++) {
                float d, m;
                _mm_prefetch((const char *)row + (size_t)bb * (g + 8 * KQ_AHEAD), _MM_HINT_T0); /* (as super_rows) */
                const __m256i c = small_block(TYPE, row + (size_t)bb * g, &d, &m), ac = _mm256_sign_epi8(c, c);
                for (int t = 0; t < nt; t++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(a->qs[t0 + t] + 32 * g));
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ac, _mm256_sign_epi8(x, c)), ones);
                    const float dx = a->ds[t0 + t][g];
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx), acc[t]);
                    if (TYPE == T_Q4_1 || TYPE == T_Q5_1)
                        mins[t] += m * dx * (float)(a->bs[t0 + t][2 * g] + a->bs[t0 + t][2 * g + 1]);
                }
            }
            for (int t = 0; t < nt; t++) ys[t0 + t][r] = hsum(acc[t]) + mins[t];
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* the super-blocks of 256                                                                    */

INLINE_AVX2 void super_rows(const int TYPE, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_acts *a,
                            float *const *ys, int nb) {
    const long U = K / 256;
    const int bb = block_bytes(TYPE);
    for (long r = r0; r < r1; r++) {
        const uint8_t *row = W + (size_t)r * rb;
        for (int t0 = 0; t0 < nb; t0 += KQ_TB) {
            const int nt = nb - t0 < KQ_TB ? nb - t0 : KQ_TB;
            float acc[KQ_TB];
            for (int t = 0; t < nt; t++) acc[t] = 0.0f;
            for (long u = 0; u < U; u++) {
                __m256i c[8], sv[8], mv, ac[8];
                float dsum, dq;
                /* the super-block KQ_AHEAD ahead (past the row's end: the next row's, and past the
                 * matrix's only a hint: a prefetch never faults) */
                for (int o = 0; o < bb; o += 64) _mm_prefetch((const char *)row + (size_t)bb * (u + KQ_AHEAD) + o, _MM_HINT_T0);
                const int has_q = super_block(TYPE, row + (size_t)bb * u, c, sv, &mv, &dsum, &dq);
                if (TYPE == T_IQ4_XS)
                    for (int g = 0; g < 8; g++) ac[g] = _mm256_sign_epi8(c[g], c[g]);
                for (int t = 0; t < nt; t++) {
                    const int8_t *q = a->qs[t0 + t] + 256 * u;
                    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                    for (int g = 0; g < 8; g++) {
                        __m256i x = _mm256_loadu_si256((const __m256i *)(q + 32 * g));
                        __m256i p = TYPE == T_IQ4_XS ? _mm256_maddubs_epi16(ac[g], _mm256_sign_epi8(x, c[g]))
                                                     : _mm256_maddubs_epi16(c[g], x);
                        p = _mm256_madd_epi16(p, sv[g]);
                        if (g & 1) s1 = _mm256_add_epi32(s1, p);
                        else s0 = _mm256_add_epi32(s0, p);
                    }
                    const int M = has_q ? hsum_i32(_mm256_madd_epi16(
                                              mv, _mm256_loadu_si256((const __m256i *)(a->bs[t0 + t] + 16 * u)))) : 0;
                    acc[t] = kq_step(acc[t], hsum_i32(_mm256_add_epi32(s0, s1)), M, has_q, dsum, dq, a->ds[t0 + t][u]);
                }
            }
            for (int t = 0; t < nt; t++) ys[t0 + t][r] = acc[t];
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* the super-blocks against a batch, on AVX-512's 32 registers                                */

/* A prompt's chunk or a verification meets each row many times: the products, not memory, bound
 * it. super_rows unpacks a row's super-block again for every eight tokens and keeps codes and
 * scales in memory (AVX2 has 16 registers); at 64 tokens it ran at 60 G products/s, a third of
 * the two ports' maddubs + madd. Here a tile of KT_R rows × KT_T tokens keeps its 16 integer sums
 * in registers (AVX-512VL: 32 of them, 256 bits wide, so the multiplies keep both ports, which
 * 512-bit ones would not), each code vector is loaded once for KT_T tokens and each token's
 * vector once for KT_R rows, and a super-block is unpacked once for the whole batch.
 * The integer sums are super_rows' (exact, whatever their grouping), and each (row, token) takes
 * kq_step's float steps, eight pairs to a vector: the same bits, whatever the batch. A whole tile's
 * float work is then a few instructions per pair, where a vector per pair cost about a quarter of
 * the tile's multiply-port instructions (64 tokens: Q4_K 79-81 -> 85 G/s, Q6_K 76-79 -> 81-82,
 * one token unchanged within noise, two alternating rounds). Unsigned codes only
 * (IQ4_XS keeps super_rows and its sign trick). */
#define AVX512VL __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
#define INLINE_AVX512VL static inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))
#define KT_R 4     /* rows of a tile */
#define KT_T 4     /* tokens of a tile */
#define KT_MAX 64  /* tokens a call takes at once (its float sums stay on the stack) */

typedef struct {
    __m256i c[KT_R][8], sv[KT_R][8], mv[KT_R];
    float dsum[KT_R], dq[KT_R];
    int has_q;
} kt_unit;

/* Eight vectors' integer totals, in order, in one vector (exact). */
INLINE_AVX512VL __m256i totals8(const __m256i *v) {
    const __m256i b0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* Rows i, i + 1 of a whole tile, tokens t .. t + 3, as one vector of eight pairs: kq_step's float
 * steps lane by lane (acc[i][t + j] in lane 4 (i' − i) + j). */
INLINE_AVX512VL void kt_steps8(const kt_unit *k, const __m256i *S, const __m256i *M, int i, __m256 vx,
                               float (*acc)[KT_MAX], int t) {
    const __m256 sums = _mm256_cvtepi32_ps(totals8(S)), vd = _mm256_set_m128(_mm_set1_ps(k->dsum[i + 1]), _mm_set1_ps(k->dsum[i]));
    __m256 v = _mm256_set_m128(_mm_loadu_ps(acc[i + 1] + t), _mm_loadu_ps(acc[i] + t));
    v = _mm256_fmadd_ps(sums, _mm256_mul_ps(vd, vx), v);
    if (k->has_q) {
        const __m256 vq = _mm256_set_m128(_mm_set1_ps(k->dq[i + 1]), _mm_set1_ps(k->dq[i]));
        v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals8(M)), _mm256_mul_ps(vq, vx), v);
    }
    _mm_storeu_ps(acc[i] + t, _mm256_castps256_ps128(v));
    _mm_storeu_ps(acc[i + 1] + t, _mm256_extractf128_ps(v, 1));
}

/* NR rows × NT tokens (from token t) of unpacked unit u, into acc[row][token]. */
INLINE_AVX512VL void kt_tile(const int NR, const int NT, const kt_unit *k, const kq_acts *a, int t, long u,
                             float (*acc)[KT_MAX]) {
    __m256i s[KT_R][KT_T];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NT; j++) s[i][j] = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        __m256i x[KT_T];
        for (int j = 0; j < NT; j++) x[j] = _mm256_loadu_si256((const __m256i *)(a->qs[t + j] + 256 * u + 32 * g));
        for (int i = 0; i < NR; i++) {
            const __m256i c = k->c[i][g], sv = k->sv[i][g];
            for (int j = 0; j < NT; j++)
                s[i][j] = _mm256_add_epi32(s[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(c, x[j]), sv));
        }
    }
    __m256i bs[KT_T], m[KT_R][KT_T];
    for (int j = 0; j < NT; j++) bs[j] = _mm256_loadu_si256((const __m256i *)(a->bs[t + j] + 16 * u));
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NT; j++) m[i][j] = k->has_q ? _mm256_madd_epi16(k->mv[i], bs[j]) : _mm256_setzero_si256();
    if (NR == KT_R && NT == KT_T) {
        const __m128 dx = _mm_set_ps(a->ds[t + 3][u], a->ds[t + 2][u], a->ds[t + 1][u], a->ds[t][u]);
        const __m256 vx = _mm256_set_m128(dx, dx);
        kt_steps8(k, s[0], m[0], 0, vx, acc, t);
        kt_steps8(k, s[2], m[2], 2, vx, acc, t);
        return;
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NT; j++)
            acc[i][t + j] = kq_step(acc[i][t + j], hsum_i32(s[i][j]), hsum_i32(m[i][j]), k->has_q, k->dsum[i], k->dq[i],
                                    a->ds[t + j][u]);
}

INLINE_AVX512VL void kt_rows(const int TYPE, const int NR, const uint8_t *W, size_t rb, long K, long r, const kq_acts *a,
                             float *const *ys, int t0, int nt) {
    const long U = K / 256;
    const int bb = block_bytes(TYPE);
    float acc[KT_R][KT_MAX];
    kt_unit k;
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = 0.0f;
    for (long u = 0; u < U; u++) {
        for (int i = 0; i < NR; i++) {
            const uint8_t *b = W + (size_t)(r + i) * rb + (size_t)bb * u;
            for (int o = 0; o < bb; o += 64) _mm_prefetch((const char *)b + (size_t)bb * KQ_AHEAD + o, _MM_HINT_T0);
            k.has_q = super_block(TYPE, b, k.c[i], k.sv[i], &k.mv[i], &k.dsum[i], &k.dq[i]);
        }
        const kq_acts at = {a->qs + t0, a->ds + t0, a->bs + t0};
        int t = 0;
        for (; t + KT_T <= nt; t += KT_T) kt_tile(NR, KT_T, &k, &at, t, u, acc);
        switch (nt - t) {
        case 1: kt_tile(NR, 1, &k, &at, t, u, acc); break;
        case 2: kt_tile(NR, 2, &k, &at, t, u, acc); break;
        case 3: kt_tile(NR, 3, &k, &at, t, u, acc); break;
        }
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < nt; j++) ys[t0 + j][r + i] = acc[i][j];
}

INLINE_AVX512VL void kt_rows_all(const int TYPE, const uint8_t *W, size_t rb, long K, long r0, long r1,
                                 const kq_acts *a, float *const *ys, int nb) {
    for (int t0 = 0; t0 < nb; t0 += KT_MAX) {
        const int nt = nb - t0 < KT_MAX ? nb - t0 : KT_MAX;
        long r = r0;
        for (; r + KT_R <= r1; r += KT_R) kt_rows(TYPE, KT_R, W, rb, K, r, a, ys, t0, nt);
        for (; r < r1; r++) kt_rows(TYPE, 1, W, rb, K, r, a, ys, t0, nt);
    }
}

/* Whether the tiles take this call: AVX-512VL+BW in use, a type with unsigned codes, and a batch
 * (one token's rows come from memory: super_rows and its prefetch serve it). */
AVX512VL static int kq_tiles(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_acts *a,
                             float *const *ys, int nb) {
    if (nb < KT_T || !dot_use_avx512(-1)) return 0;
    switch (type) {
    case T_Q2_K: kt_rows_all(T_Q2_K, W, rb, K, r0, r1, a, ys, nb); return 1;
    case T_Q3_K: kt_rows_all(T_Q3_K, W, rb, K, r0, r1, a, ys, nb); return 1;
    case T_Q4_K: kt_rows_all(T_Q4_K, W, rb, K, r0, r1, a, ys, nb); return 1;
    case T_Q5_K: kt_rows_all(T_Q5_K, W, rb, K, r0, r1, a, ys, nb); return 1;
    case T_Q6_K: kt_rows_all(T_Q6_K, W, rb, K, r0, r1, a, ys, nb); return 1;
    }
    return 0;
}

/* One copy per type (TYPE a constant in each). */
AVX2 void kq_rows_avx2(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_acts *a,
                       float *const *ys, int nb) {
    if (kq_tiles(type, W, rb, K, r0, r1, a, ys, nb)) return;
    switch (type) {
    case T_Q4_1: small_rows(T_Q4_1, W, rb, K, r0, r1, a, ys, nb); break;
    case T_Q5_0: small_rows(T_Q5_0, W, rb, K, r0, r1, a, ys, nb); break;
    case T_Q5_1: small_rows(T_Q5_1, W, rb, K, r0, r1, a, ys, nb); break;
    case T_IQ4_NL: small_rows(T_IQ4_NL, W, rb, K, r0, r1, a, ys, nb); break;
    case T_MXFP4: small_rows(T_MXFP4, W, rb, K, r0, r1, a, ys, nb); break;
    case T_Q2_K: super_rows(T_Q2_K, W, rb, K, r0, r1, a, ys, nb); break;
    case T_Q3_K: super_rows(T_Q3_K, W, rb, K, r0, r1, a, ys, nb); break;
    case T_Q4_K: super_rows(T_Q4_K, W, rb, K, r0, r1, a, ys, nb); break;
    case T_Q5_K: super_rows(T_Q5_K, W, rb, K, r0, r1, a, ys, nb); break;
    case T_Q6_K: super_rows(T_Q6_K, W, rb, K, r0, r1, a, ys, nb); break;
    case T_IQ4_XS: super_rows(T_IQ4_XS, W, rb, K, r0, r1, a, ys, nb); break;
    }
}

#endif
