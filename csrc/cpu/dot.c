/* Row dot products on stored blocks: y_t[r] = W[r] . x_t for a range of rows and up to a few
 * dozen tokens. Weights are dequantised in registers, 32 at a time, and used for up to four tokens
 * before the next 32 are decoded.
 *
 * Activations stay float32, except against Q8_0 and Q4_0 rows (and kquant.c's types, which take the
 * same int8 activations: the K-quants, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS): there each token's x is quantised
 * to int8 in blocks of 32 (d = max|x| / 127, q = x · (1/d) rounded half to even, all in float32)
 * and codes meet codes in integers, as llama.cpp's CPU backend does. At one token that is 1.6× the
 * float loop, whose cost was decoding codes to floats (docs/performance/kernels.md). The NumPy
 * reference quantises identically, so the integer sums are exact and results agree to float32
 * rounding; dot_act_q8(0) keeps float activations for every type.
 *
 * Two paths: AVX2 + FMA + F16C, chosen at run time when the CPU has them, and a portable path
 * (decode a row, then plain loops the compiler vectorises) for every other CPU.
 */
#include "dot.h"

#include <math.h>
#include <stdlib.h>

#include "kquant.h"
#include "quant.h"
#include "simd.h"

/* ------------------------------------------------------------------------------------------ */
/* portable path                                                                              */

static void rows_dot_portable(int type, const uint8_t *W, size_t rb, long K, long r0, long r1,
                              const float *const *xs, float *const *ys, int nb) {
    float *row = malloc((size_t)K * sizeof(float));
    if (!row) return; /* callers check inputs; an allocation failure leaves y unchanged */
    for (long r = r0; r < r1; r++) {
        dequant_row(type, W + (size_t)r * rb, row, K);
        for (int t = 0; t < nb; t++) {
            const float *x = xs[t];
            float s = 0.0f;
            for (long k = 0; k < K; k++) s += row[k] * x[k];
            ys[t][r] = s;
        }
    }
    free(row);
}

static int act_q8 = 1; /* int8 activations against Q8_0 / Q4_0 rows (here) and kquant.c's types */
#define ACT_Q8(type) (act_q8 && ((type) == T_Q8_0 || (type) == T_Q4_0))

int dot_kq_path(int type) { return act_q8 && kq_type(type); }

int dot_act_q8(int on) {
    if (on >= 0) act_q8 = on != 0;
    return act_q8;
}

static int rows4_on = 1; /* one token against plain rows four at a time (the same bits) */

int dot_rows4(int on) {
    if (on >= 0) rows4_on = on != 0;
    return rows4_on;
}

/* A Q8_0 or Q4_0 group's 32 signed codes and its scale. */
static float codes_portable(int type, const uint8_t *row, long g, int *c) {
    if (type == T_Q8_0) {
        const uint8_t *b = row + 34 * g;
        for (int i = 0; i < 32; i++) c[i] = (int8_t)b[2 + i];
        return f16_to_f32(rd16(b));
    }
    const uint8_t *b = row + 18 * g;
    for (int i = 0; i < 16; i++) {
        c[i] = (b[2 + i] & 0x0F) - 8;
        c[i + 16] = (b[2 + i] >> 4) - 8;
    }
    return f16_to_f32(rd16(b));
}

static void rows_q8act_portable(int type, const uint8_t *W, size_t rb, long K, long r0, long r1,
                                const int8_t *const *qs, const float *const *ds, float *const *ys, int nb) {
    const long G = K / 32;
    int c[32];
    for (long r = r0; r < r1; r++) {
        const uint8_t *row = W + (size_t)r * rb;
        for (int t = 0; t < nb; t++) ys[t][r] = 0.0f;
        for (long g = 0; g < G; g++) {
            float dw = codes_portable(type, row, g, c);
            for (int t = 0; t < nb; t++) {
                const int8_t *q = qs[t] + 32 * g;
                int isum = 0;
                for (int i = 0; i < 32; i++) isum += c[i] * q[i];
                ys[t][r] += dw * ds[t][g] * (float)isum;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* AVX2 path                                                                                  */

#ifdef HAVE_AVX2_PATH

INLINE_AVX2 float h2f(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

INLINE_AVX2 __m256 i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
INLINE_AVX2 __m256 u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* 32 consecutive weights of a plain row (F32, F16, BF16) into w[0..3]. */
INLINE_AVX2 void load_plain(const int TYPE, const uint8_t *row, long g, __m256 *w) {
    if (TYPE == T_F32) {
        const float *p = (const float *)row + 32 * g;
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps(p + 8 * i);
    } else if (TYPE == T_F16) {
        const __m128i *p = (const __m128i *)(row + 64 * g);
        for (int i = 0; i < 4; i++) w[i] = _mm256_cvtph_ps(_mm_loadu_si128(p + i));
    } else {
        const __m128i *p = (const __m128i *)(row + 64 * g);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + i)), 16));
    }
}

/* 8 consecutive weights of a plain row from element k. */
INLINE_AVX2 __m256 load_plain8(const int TYPE, const uint8_t *row, long k) {
    if (TYPE == T_F32) return _mm256_loadu_ps((const float *)row + k);
    __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * k));
    if (TYPE == T_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* A quantised group of 32: its codes as (unscaled) floats in w[0..3] and the affine map that
 * turns Σ code·x into the group's share of the dot product: scale · Σ code·x + bias · Σ x. The
 * scale is applied once per group instead of once per weight (Q4_0: scale d, bias −8d; Q4_K:
 * scale d·sc, bias −dmin·m; Q8_0, MXFP4: bias 0). */
INLINE_AVX2 void load_quant(const int TYPE, const uint8_t *row, long g, const float *q4k, __m256 *w, float *scale,
                            float *bias) {
    if (TYPE == T_Q8_0) {
        const uint8_t *b = row + 34 * g;
        for (int i = 0; i < 4; i++) w[i] = i8x8(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)));
        *scale = h2f(b);
        *bias = 0.0f;
        return;
    }
    __m128i m4 = _mm_set1_epi8(0x0F), lo, hi;
    if (TYPE == T_Q4_K) { /* group j of its super-block: bytes 32·(j/2).., low or high nibbles */
        const uint8_t *qs = row + 144 * (g >> 3) + 16 + 32 * ((g & 7) >> 1);
        __m128i q0 = _mm_loadu_si128((const __m128i *)qs), q1 = _mm_loadu_si128((const __m128i *)(qs + 16));
        if (g & 1) {
            q0 = _mm_srli_epi16(q0, 4);
            q1 = _mm_srli_epi16(q1, 4);
        }
        lo = _mm_and_si128(q0, m4);
        hi = _mm_and_si128(q1, m4);
        *scale = q4k[2 * (g & 7)];
        *bias = q4k[2 * (g & 7) + 1];
        w[0] = u8x8(lo);
        w[1] = u8x8(_mm_srli_si128(lo, 8));
        w[2] = u8x8(hi);
        w[3] = u8x8(_mm_srli_si128(hi, 8));
        return;
    }
    const uint8_t *b = row + (TYPE == T_Q4_0 ? 18 : 17) * g;
    __m128i q = _mm_loadu_si128((const __m128i *)(b + (TYPE == T_Q4_0 ? 2 : 1)));
    lo = _mm_and_si128(q, m4); /* elements 0-15 */
    hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4); /* elements 16-31 */
    if (TYPE == T_MXFP4) {
        __m128i table = _mm_loadu_si128((const __m128i *)KVALUES_MXFP4);
        lo = _mm_shuffle_epi8(table, lo);
        hi = _mm_shuffle_epi8(table, hi);
        *scale = e8m0_half(b[0]);
        *bias = 0.0f;
        w[0] = i8x8(lo);
        w[1] = i8x8(_mm_srli_si128(lo, 8));
        w[2] = i8x8(hi);
        w[3] = i8x8(_mm_srli_si128(hi, 8));
        return;
    }
    *scale = h2f(b); /* Q4_0: code − 8 */
    *bias = -8.0f * *scale;
    w[0] = u8x8(lo);
    w[1] = u8x8(_mm_srli_si128(lo, 8));
    w[2] = u8x8(hi);
    w[3] = u8x8(_mm_srli_si128(hi, 8));
}

#define IS_PLAIN(TYPE) ((TYPE) == T_F32 || (TYPE) == T_F16 || (TYPE) == T_BF16)

/* s plus a plain row's elements k..K-1 against x, one at a time (a row's rest past its eights). */
INLINE_AVX2 float plain_rest(const int TYPE, const uint8_t *row, long k, long K, const float *x, float s) {
    for (; k < K; k++) {
        float wk = TYPE == T_F32   ? ((const float *)row)[k]
                   : TYPE == T_F16 ? f16_to_f32(rd16(row + 2 * k))
                                   : bf16_to_f32(rd16(row + 2 * k));
        s += wk * x[k];
    }
    return s;
}
#define HAS_BIAS(TYPE) ((TYPE) == T_Q4_0 || (TYPE) == T_Q4_K)

/* One row against NB (1..4) tokens. Plain types: two partial sums per token keep two FMA chains
 * busy. Quantised types: Σ code·x per group (chains independent across groups), then one FMA with
 * the group's scale; the bias term uses the token's precomputed group sums of x. */
INLINE_AVX2 void row_tmpl(const int TYPE, const int NB, const uint8_t *row, long K, const float *const *xs,
                          const float *const *xsum, float *const *ys, long r) {
    const long G = K / 32;
    __m256 a[4][2];
    float bsum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float q4k[16];
    for (int t = 0; t < NB; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();
    for (long g = 0; g < G; g++) {
        __m256 w[4];
        if (IS_PLAIN(TYPE)) {
            load_plain(TYPE, row, g, w);
            for (int t = 0; t < NB; t++) {
                const float *x = xs[t] + 32 * g;
                a[t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), a[t][0]);
                a[t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a[t][1]);
                a[t][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a[t][0]);
                a[t][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a[t][1]);
            }
            continue;
        }
        if (TYPE == T_Q4_K && (g & 7) == 0) { /* a new super-block: decode its 8 scales and mins once */
            const uint8_t *b = row + 144 * (g >> 3);
            float d = h2f(b), dmin = h2f(b + 2);
            for (int i = 0; i < 8; i++) {
                uint8_t sc, m;
                q4k_scale_min(i, b + 4, &sc, &m);
                q4k[2 * i] = d * sc;
                q4k[2 * i + 1] = -dmin * m;
            }
        }
        float scale, bias;
        load_quant(TYPE, row, g, q4k, w, &scale, &bias);
        const __m256 vs = _mm256_set1_ps(scale);
        for (int t = 0; t < NB; t++) {
            const float *x = xs[t] + 32 * g;
            __m256 lo = _mm256_mul_ps(w[0], _mm256_loadu_ps(x)), hi = _mm256_mul_ps(w[1], _mm256_loadu_ps(x + 8));
            lo = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), lo);
            hi = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), hi);
            a[t][0] = _mm256_fmadd_ps(vs, lo, a[t][0]);
            a[t][1] = _mm256_fmadd_ps(vs, hi, a[t][1]);
            if (HAS_BIAS(TYPE)) bsum[t] += bias * xsum[t][g];
        }
    }
    long k8 = 32 * G;
    if (IS_PLAIN(TYPE)) /* a row that is not whole groups (the default model's K = 112): 8 at a time */
        for (; k8 + 8 <= K; k8 += 8) {
            __m256 w8 = load_plain8(TYPE, row, k8);
            for (int t = 0; t < NB; t++) a[t][0] = _mm256_fmadd_ps(w8, _mm256_loadu_ps(xs[t] + k8), a[t][0]);
        }
    for (int t = 0; t < NB; t++) /* (quantised rows are whole groups: no rest) */
        ys[t][r] = plain_rest(TYPE, row, k8, K, xs[t], hsum(_mm256_add_ps(a[t][0], a[t][1])) + bsum[t]);
}

/* Four plain rows against one token. Each row's operations are row_tmpl's for NB = 1, in the same
 * order, so each gives the same bits; what changes is that four rows' eight FMA chains run side by
 * side. One row's two chains wait on the FMA's latency (about 4 cycles), which held a decode
 * token's F16 products at about 5 weights a cycle on data in cache (docs/performance/
 * row-products.md). */
INLINE_AVX2 void rows4_tmpl(const int TYPE, const uint8_t *W, size_t rb, long K, const float *x, float *y, long r) {
    const long G = K / 32;
    const uint8_t *row[4] = {W + (size_t)r * rb, W + (size_t)(r + 1) * rb, W + (size_t)(r + 2) * rb,
                             W + (size_t)(r + 3) * rb};
    __m256 a[4][2];
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (long g = 0; g < G; g++) {
        const float *p = x + 32 * g;
        const __m256 x0 = _mm256_loadu_ps(p), x1 = _mm256_loadu_ps(p + 8), x2 = _mm256_loadu_ps(p + 16),
                     x3 = _mm256_loadu_ps(p + 24);
        for (int i = 0; i < 4; i++) {
            __m256 w[4];
            /* the next four rows' line: four rows read side by side are not one stream to the
             * hardware prefetcher, and rows from L3 or memory then waited on every line (past the
             * matrix's end it is only a hint: a prefetch never faults) */
            _mm_prefetch((const char *)row[i] + 4 * rb + (TYPE == T_F32 ? 128 : 64) * g, _MM_HINT_T0);
            load_plain(TYPE, row[i], g, w);
            a[i][0] = _mm256_fmadd_ps(w[0], x0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(w[1], x1, a[i][1]);
            a[i][0] = _mm256_fmadd_ps(w[2], x2, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(w[3], x3, a[i][1]);
        }
    }
    for (int i = 0; i < 4; i++) {
        long k8 = 32 * G;
        for (; k8 + 8 <= K; k8 += 8) a[i][0] = _mm256_fmadd_ps(load_plain8(TYPE, row[i], k8), _mm256_loadu_ps(x + k8), a[i][0]);
        /* (+ 0.0f: row_tmpl adds its bias sum, 0 for plain rows; the same bits for a sum of −0) */
        y[r + i] = plain_rest(TYPE, row[i], k8, K, x, hsum(_mm256_add_ps(a[i][0], a[i][1])) + 0.0f);
    }
}

/* Rows outside, tokens inside: each row is read from memory once for the whole batch. ROW is
 * row_tmpl (float tokens, their group sums) or row_q8act (int8 tokens, their scales). */
#define ROWS_OF(NAME, ROW, TYPE, XT) ROWS_OF_AS(AVX2, NAME, ROW, TYPE, XT)
#define ROWS_OF_AS(ATTR, NAME, ROW, TYPE, XT)                                                       \
    ATTR static void NAME(const uint8_t *W, size_t rb, long K, long r0, long r1, XT xs,            \
                          const float *const *xsum, float *const *ys, int nb) {                     \
        for (long r = r0; r < r1; r++) {                                                            \
            const uint8_t *row = W + (size_t)r * rb;                                                \
            int t = 0;                                                                              \
            for (; t + 4 <= nb; t += 4) ROW(TYPE, 4, row, K, xs + t, xsum + t, ys + t, r);          \
            switch (nb - t) {                                                                       \
            case 1: ROW(TYPE, 1, row, K, xs + t, xsum + t, ys + t, r); break;                       \
            case 2: ROW(TYPE, 2, row, K, xs + t, xsum + t, ys + t, r); break;                       \
            case 3: ROW(TYPE, 3, row, K, xs + t, xsum + t, ys + t, r); break;                       \
            }                                                                                       \
        }                                                                                           \
    }
#define ROWS_FN(NAME, TYPE) ROWS_OF(NAME, row_tmpl, TYPE, const float *const *)
/* Plain rows: one token takes four rows at a time (rows4_tmpl, the same bits as row_tmpl). */
#define ROWS_PLAIN(NAME, TYPE)                                                                      \
    ROWS_OF(NAME##_rows, row_tmpl, TYPE, const float *const *)                                      \
    AVX2 static void NAME(const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs, \
                          const float *const *xsum, float *const *ys, int nb) {                     \
        if (nb == 1 && rows4_on)                                                                    \
            for (; r0 + 4 <= r1; r0 += 4) rows4_tmpl(TYPE, W, rb, K, xs[0], ys[0], r0);             \
        NAME##_rows(W, rb, K, r0, r1, xs, xsum, ys, nb);                                            \
    }

ROWS_PLAIN(rows_f32, T_F32)
ROWS_PLAIN(rows_f16, T_F16)
ROWS_PLAIN(rows_bf16, T_BF16)
ROWS_FN(rows_q8_0, T_Q8_0)
ROWS_FN(rows_q4_0, T_Q4_0)
ROWS_FN(rows_mxfp4, T_MXFP4)
ROWS_FN(rows_q4_k, T_Q4_K)

/* A group's 32 signed codes (Q4_0: nibble − 8, elements 0-15 in the low nibbles) and its scale. */
INLINE_AVX2 __m256i load_codes(const int TYPE, const uint8_t *row, long g, float *dw) {
    if (TYPE == T_Q8_0) {
        const uint8_t *b = row + 34 * g;
        *dw = h2f(b);
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    }
    const uint8_t *b = row + 18 * g;
    *dw = h2f(b);
    const __m128i m4 = _mm_set1_epi8(0x0F), q = _mm_loadu_si128((const __m128i *)(b + 2));
    __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    return _mm256_sub_epi8(w, _mm256_set1_epi8(8));
}

/* One row against NB (1..4) int8 tokens: per group, |w| · (x with w's sign) summed to eight int32
 * (PRODUCT: AVX2 in 16-bit pairs, at most 2 · 128 · 127, no saturation, then pairs of pairs; VNNI
 * in one step, the same integers), then one FMA with d_w · d_x. Both give the same bits. */
#define ROW_Q8ACT(NAME, ATTR, PRODUCT)                                                                   \
    ATTR void NAME(const int TYPE, const int NB, const uint8_t *row, long K, const int8_t *const *qs,    \
                   const float *const *ds, float *const *ys, long r) {                                   \
        const long G = K / 32;                                                                           \
        const __m256i ones = _mm256_set1_epi16(1);                                                       \
        (void)ones;                                                                                      \
        __m256 a[4];                                                                                     \
        for (int t = 0; t < NB; t++) a[t] = _mm256_setzero_ps();                                         \
        for (long g = 0; g < G; g++) {                                                                   \
            float dw;                                                                                    \
            const __m256i w = load_codes(TYPE, row, g, &dw), aw = _mm256_sign_epi8(w, w);                \
            for (int t = 0; t < NB; t++) {                                                               \
                const __m256i x = _mm256_loadu_si256((const __m256i *)(qs[t] + 32 * g));                 \
                const __m256i p = PRODUCT(aw, _mm256_sign_epi8(x, w));                                   \
                a[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ds[t][g]), _mm256_cvtepi32_ps(p), a[t]);      \
            }                                                                                            \
        }                                                                                                \
        for (int t = 0; t < NB; t++) ys[t][r] = hsum(a[t]);                                              \
    }
/* Four int8 rows against one token: ROW_Q8ACT's operations for each row, in its order (the same
 * bits), side by side, so four FMA chains run where one row has one; with the next four rows'
 * lines asked for ahead, as rows4_tmpl does. */
#define ROWS4_Q8ACT(NAME, ATTR, PRODUCT)                                                                  \
    ATTR void NAME(const int TYPE, const uint8_t *W, size_t rb, long K, const int8_t *q, const float *d,  \
                   float *y, long r) {                                                                    \
        const long G = K / 32, gb = TYPE == T_Q8_0 ? 34 : 18; /* bytes of a group */                      \
        const __m256i ones = _mm256_set1_epi16(1);                                                        \
        (void)ones;                                                                                       \
        const uint8_t *row[4] = {W + (size_t)r * rb, W + (size_t)(r + 1) * rb, W + (size_t)(r + 2) * rb,  \
                                 W + (size_t)(r + 3) * rb};                                               \
        __m256 a[4];                                                                                      \
        for (int i = 0; i < 4; i++) a[i] = _mm256_setzero_ps();                                           \
        for (long g = 0; g < G; g++) {                                                                    \
            const __m256i x = _mm256_loadu_si256((const __m256i *)(q + 32 * g));                          \
            for (int i = 0; i < 4; i++) {                                                                 \
                float dw;                                                                                 \
                _mm_prefetch((const char *)row[i] + 4 * rb + gb * g, _MM_HINT_T0);                        \
                const __m256i w = load_codes(TYPE, row[i], g, &dw), aw = _mm256_sign_epi8(w, w);          \
                const __m256i p = PRODUCT(aw, _mm256_sign_epi8(x, w));                                    \
                a[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d[g]), _mm256_cvtepi32_ps(p), a[i]);           \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < 4; i++) y[r + i] = hsum(a[i]);                                                \
    }
/* The rows of one int8 type: one token four rows at a time, the rest (and batches) row by row. */
#define ROWS_Q8ACT(NAME, ATTR, ROW, ROW4, TYPE)                                                           \
    ROWS_OF_AS(ATTR, NAME##_rows, ROW, TYPE, const int8_t *const *)                                       \
    ATTR static void NAME(const uint8_t *W, size_t rb, long K, long r0, long r1, const int8_t *const *qs, \
                          const float *const *ds, float *const *ys, int nb) {                             \
        if (nb == 1 && rows4_on)                                                                          \
            for (; r0 + 4 <= r1; r0 += 4) ROW4(TYPE, W, rb, K, qs[0], ds[0], ys[0], r0);                  \
        NAME##_rows(W, rb, K, r0, r1, qs, ds, ys, nb);                                                    \
    }
typedef void (*q8act_rows)(const uint8_t *, size_t, long, long, long, const int8_t *const *, const float *const *,
                           float *const *, int);
#define PRODUCT_AVX2(aw, sx) _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones)
ROW_Q8ACT(row_q8act, INLINE_AVX2, PRODUCT_AVX2)
ROWS4_Q8ACT(rows4_q8act, INLINE_AVX2, PRODUCT_AVX2)
ROWS_Q8ACT(rows_q8act_q8_0, AVX2, row_q8act, rows4_q8act, T_Q8_0)
ROWS_Q8ACT(rows_q8act_q4_0, AVX2, row_q8act, rows4_q8act, T_Q4_0)

#ifdef HAVE_VNNI_PATH
#define PRODUCT_VNNI(aw, sx) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, sx)
ROW_Q8ACT(row_q8act_vnni, INLINE_VNNI, PRODUCT_VNNI)
ROWS4_Q8ACT(rows4_q8act_vnni, INLINE_VNNI, PRODUCT_VNNI)
ROWS_Q8ACT(rows_q8act_vnni_q8_0, VNNI, row_q8act_vnni, rows4_q8act_vnni, T_Q8_0)
ROWS_Q8ACT(rows_q8act_vnni_q4_0, VNNI, row_q8act_vnni, rows4_q8act_vnni, T_Q4_0)
#define PRODUCT_VNNI512(aw, sx) _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx)
ROW_Q8ACT(row_q8act_vnni512, INLINE_VNNI512, PRODUCT_VNNI512)
ROWS4_Q8ACT(rows4_q8act_vnni512, INLINE_VNNI512, PRODUCT_VNNI512)
ROWS_Q8ACT(rows_q8act_vnni512_q8_0, VNNI512, row_q8act_vnni512, rows4_q8act_vnni512, T_Q8_0)
ROWS_Q8ACT(rows_q8act_vnni512_q4_0, VNNI512, row_q8act_vnni512, rows4_q8act_vnni512, T_Q4_0)
#endif

/* Σ x over each group of 32, per token (the bias term of Q4_0 / Q4_K). */
AVX2 static void group_sums(const float *x, long G, float *out) {
    for (long g = 0; g < G; g++) {
        const float *p = x + 32 * g;
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
        out[g] = hsum(s);
    }
}

static void rows_dot_avx2(int type, const uint8_t *W, size_t rb, long K, long r0, long r1,
                          const float *const *xs, float *const *ys, int nb) {
    const float *sums[nb > 0 ? nb : 1];
    float *buf = NULL;
    if (type == T_Q4_0 || type == T_Q4_K) {
        long G = K / 32;
        buf = malloc(sizeof(float) * (size_t)(nb * G));
        if (!buf) return;
        for (int t = 0; t < nb; t++) {
            group_sums(xs[t], G, buf + t * G);
            sums[t] = buf + t * G;
        }
    }
    switch (type) {
    case T_F32: rows_f32(W, rb, K, r0, r1, xs, sums, ys, nb); break;
    case T_F16: rows_f16(W, rb, K, r0, r1, xs, sums, ys, nb); break;
    case T_BF16: rows_bf16(W, rb, K, r0, r1, xs, sums, ys, nb); break;
    case T_Q8_0: rows_q8_0(W, rb, K, r0, r1, xs, sums, ys, nb); break;
    case T_Q4_0: rows_q4_0(W, rb, K, r0, r1, xs, sums, ys, nb); break;
    case T_MXFP4: rows_mxfp4(W, rb, K, r0, r1, xs, sums, ys, nb); break;
    case T_Q4_K: rows_q4_k(W, rb, K, r0, r1, xs, sums, ys, nb); break;
    }
    free(buf);
}
#endif

/* ------------------------------------------------------------------------------------------ */

static int use_avx2 = -1; /* -1: not decided yet */
static int use_vnni;      /* the int8 rows' VNNI products (with use_avx2 only): 0 none, 1 AVX-VNNI, 2 AVX-512 VNNI */
static int use_avx512;    /* plain rows on AVX-512 (with use_avx2 only) */
static int want_avx512 = 1;
static int want_vnni = 1; /* what `dot_use_vnni` last asked for: kept when the SIMD path is switched */

int dot_use_simd(int want) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    int have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    use_avx2 = want && have;
#else
    (void)want;
    use_avx2 = 0;
#endif
    dot_use_vnni(want_vnni);
    dot_use_avx512(want_avx512);
    return use_avx2;
}

int dot_use_avx512(int want) {
    if (use_avx2 < 0) dot_use_simd(1);
    if (want >= 0) want_avx512 = want != 0;
    use_avx512 = use_avx2 && want_avx512 && dot512_available();
    return use_avx512;
}

int dot_vnni_built(void) {
#ifdef HAVE_VNNI_PATH
    return 1;
#else
    return 0;
#endif
}

int dot_use_vnni(int want) {
    want_vnni = want;
    if (use_avx2 < 0) dot_use_simd(1);
#ifdef HAVE_VNNI_PATH
    int vex = __builtin_cpu_supports("avxvnni"),
        evex = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    use_vnni = !use_avx2 || !want ? 0 : want == 1 && vex ? 1 : evex ? 2 : 0;
#else
    (void)want;
    use_vnni = 0;
#endif
    return use_vnni;
}

int dot_vnni(void) {
    if (use_avx2 < 0) dot_use_simd(1);
    return use_vnni;
}

int dot_simd(void) {
    if (use_avx2 < 0) dot_use_simd(1);
    return use_avx2;
}

const char *dot_path(void) {
    if (use_avx2 < 0) dot_use_simd(1);
    if (!use_avx2) return "portable";
    static const char *names[2][3] = {{"avx2+fma+f16c", "avx2+fma+f16c+avxvnni", "avx2+fma+f16c+avx512vnni"},
                                      {"avx2+fma+f16c+avx512", "avx2+fma+f16c+avx512+avxvnni", "avx2+fma+f16c+avx512+avx512vnni"}};
    return names[use_avx512 ? 1 : 0][use_vnni];
}

/* Q8_0 / Q4_0 rows against int8 activations: each call quantises its tokens once (a call is one
 * chunk of rows: K values per token against rows × K weights, under 1 % of the work). */
static void rows_dot_q8act(int type, const uint8_t *W, size_t rb, long K, long r0, long r1,
                           const float *const *xs, float *const *ys, int nb) {
    const long G = K / 32;
    int8_t *q = malloc((size_t)nb * (size_t)K + 32);
    float *d = malloc(sizeof(float) * (size_t)(nb * G + 1));
    const int8_t *qs[nb > 0 ? nb : 1];
    const float *ds[nb > 0 ? nb : 1];
    if (!q || !d) goto done; /* callers check inputs; an allocation failure leaves y unchanged */
    for (int t = 0; t < nb; t++) {
        qs[t] = q + (size_t)t * (size_t)K;
        ds[t] = d + (size_t)t * (size_t)G;
    }
#ifdef HAVE_AVX2_PATH
    if (use_avx2) {
        for (int t = 0; t < nb; t++) act_quantize(xs[t], K, (int8_t *)qs[t], (float *)ds[t]);
        q8act_rows rows = type == T_Q8_0 ? rows_q8act_q8_0 : rows_q8act_q4_0;
#ifdef HAVE_VNNI_PATH
        if (use_vnni == 1) rows = type == T_Q8_0 ? rows_q8act_vnni_q8_0 : rows_q8act_vnni_q4_0;
        if (use_vnni == 2) rows = type == T_Q8_0 ? rows_q8act_vnni512_q8_0 : rows_q8act_vnni512_q4_0;
#endif
        rows(W, rb, K, r0, r1, qs, ds, ys, nb);
        goto done;
    }
#endif
    for (int t = 0; t < nb; t++) act_quantize(xs[t], K, (int8_t *)qs[t], (float *)ds[t]);
    rows_q8act_portable(type, W, rb, K, r0, r1, qs, ds, ys, nb);
done:
    free(q);
    free(d);
}

void rows_dot(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs,
              float *const *ys, int nb) {
    if (use_avx2 < 0) dot_use_simd(1);
    if (ACT_Q8(type)) {
        rows_dot_q8act(type, W, rb, K, r0, r1, xs, ys, nb);
        return;
    }
    if (act_q8 && kq_type(type)) { /* the K-quants and the other llama.cpp blocks (kquant.c) */
        rows_dot_kq(type, W, rb, K, r0, r1, xs, ys, nb);
        return;
    }
#ifdef HAVE_AVX2_PATH
    /* (float activations against kquant.c's types, Q4_K aside, take the portable loop: a test switch) */
    if (use_avx2 && (!kq_type(type) || type == T_Q4_K)) {
        if (use_avx512 && (type == T_F32 || type == T_F16 || type == T_BF16))
            rows_plain_avx512(type, W, rb, K, r0, r1, xs, ys, nb, rows4_on);
        else
            rows_dot_avx2(type, W, rb, K, r0, r1, xs, ys, nb);
        return;
    }
#endif
    rows_dot_portable(type, W, rb, K, r0, r1, xs, ys, nb);
}
