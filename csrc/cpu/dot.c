/* Row dot products on stored blocks: y_t[r] = W[r] . x_t for a range of rows and up to a few
 * dozen tokens. Weights are dequantised in registers, 32 at a time, and used for up to four tokens
 * before the next 32 are decoded; activations stay float32 (no activation quantisation, so the
 * result matches the NumPy reference to float32 rounding).
 *
 * Two paths: AVX2 + FMA + F16C, chosen at run time when the CPU has them, and a portable path
 * (decode a row, then plain loops the compiler vectorises) for every other CPU.
 */
#include "dot.h"

#include <stdlib.h>

#include "quant.h"

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

/* ------------------------------------------------------------------------------------------ */
/* AVX2 path                                                                                  */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE_AVX2 static inline __attribute__((always_inline, target("avx2,fma,f16c")))

INLINE_AVX2 float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE_AVX2 float h2f(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

INLINE_AVX2 __m256 i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
INLINE_AVX2 __m256 u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* 32 consecutive weights (group g of the row) into w[0..3]. TYPE is a constant after inlining. */
INLINE_AVX2 void load_group(const int TYPE, const uint8_t *row, long g, __m256 *w) {
    switch (TYPE) {
    case T_F32: {
        const float *p = (const float *)row + 32 * g;
        for (int i = 0; i < 4; i++) w[i] = _mm256_loadu_ps(p + 8 * i);
        break;
    }
    case T_F16: {
        const __m128i *p = (const __m128i *)(row + 64 * g);
        for (int i = 0; i < 4; i++) w[i] = _mm256_cvtph_ps(_mm_loadu_si128(p + i));
        break;
    }
    case T_BF16: {
        const __m128i *p = (const __m128i *)(row + 64 * g);
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + i)), 16));
        break;
    }
    case T_Q8_0: {
        const uint8_t *b = row + 34 * g;
        __m256 d = _mm256_set1_ps(h2f(b));
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, i8x8(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i))));
        break;
    }
    case T_Q4_0: case T_MXFP4: {
        const int bb = TYPE == T_Q4_0 ? 18 : 17, off = TYPE == T_Q4_0 ? 2 : 1;
        const uint8_t *b = row + bb * g;
        __m128i q = _mm_loadu_si128((const __m128i *)(b + off)), m4 = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        __m256 d;
        if (TYPE == T_Q4_0) {
            __m128i eight = _mm_set1_epi8(8);
            lo = _mm_sub_epi8(lo, eight);
            hi = _mm_sub_epi8(hi, eight);
            d = _mm256_set1_ps(h2f(b));
        } else {
            __m128i table = _mm_loadu_si128((const __m128i *)KVALUES_MXFP4);
            lo = _mm_shuffle_epi8(table, lo);
            hi = _mm_shuffle_epi8(table, hi);
            d = _mm256_set1_ps(e8m0_half(b[0]));
        }
        w[0] = _mm256_mul_ps(d, i8x8(lo));
        w[1] = _mm256_mul_ps(d, i8x8(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_mul_ps(d, i8x8(hi));
        w[3] = _mm256_mul_ps(d, i8x8(_mm_srli_si128(hi, 8)));
        break;
    }
    case T_Q4_K: /* see q4k_group: needs the super-block's decoded scales */
        break;
    }
}

/* Q4_K group j (0..7) of super-block b, with its scale and negated min already decoded. */
INLINE_AVX2 void q4k_group(const uint8_t *b, int j, float scale_f, float neg_min_f, __m256 *w) {
    __m256 scale = _mm256_set1_ps(scale_f), neg_min = _mm256_set1_ps(neg_min_f);
    const uint8_t *qs = b + 16 + 32 * (j >> 1);
    __m128i q0 = _mm_loadu_si128((const __m128i *)qs), q1 = _mm_loadu_si128((const __m128i *)(qs + 16));
    __m128i m4 = _mm_set1_epi8(0x0F);
    if (j & 1) {
        q0 = _mm_srli_epi16(q0, 4);
        q1 = _mm_srli_epi16(q1, 4);
    }
    q0 = _mm_and_si128(q0, m4);
    q1 = _mm_and_si128(q1, m4);
    w[0] = _mm256_fmadd_ps(u8x8(q0), scale, neg_min);
    w[1] = _mm256_fmadd_ps(u8x8(_mm_srli_si128(q0, 8)), scale, neg_min);
    w[2] = _mm256_fmadd_ps(u8x8(q1), scale, neg_min);
    w[3] = _mm256_fmadd_ps(u8x8(_mm_srli_si128(q1, 8)), scale, neg_min);
}

/* One row against NB (1..4) tokens; two partial sums per token keep two FMA chains busy. */
INLINE_AVX2 void row_tmpl(const int TYPE, const int NB, const uint8_t *row, long K, const float *const *xs,
                          float *const *ys, long r) {
    const long G = K / 32;
    __m256 a[4][2];
    for (int t = 0; t < NB; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();
    float q4k_scale[8], q4k_min[8];
    for (long g = 0; g < G; g++) {
        __m256 w[4];
        if (TYPE == T_Q4_K) {
            const uint8_t *b = row + 144 * (g >> 3);
            int j = (int)(g & 7);
            if (j == 0) { /* decode the super-block's 8 scales and mins once */
                float d = h2f(b), dmin = h2f(b + 2);
                for (int i = 0; i < 8; i++) {
                    uint8_t sc, m;
                    q4k_scale_min(i, b + 4, &sc, &m);
                    q4k_scale[i] = d * sc;
                    q4k_min[i] = -dmin * m;
                }
            }
            q4k_group(b, j, q4k_scale[j], q4k_min[j], w);
        } else {
            load_group(TYPE, row, g, w);
        }
        for (int t = 0; t < NB; t++) {
            const float *x = xs[t] + 32 * g;
            a[t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), a[t][0]);
            a[t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a[t][1]);
            a[t][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a[t][0]);
            a[t][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a[t][1]);
        }
    }
    for (int t = 0; t < NB; t++) {
        float s = hsum(_mm256_add_ps(a[t][0], a[t][1]));
        for (long k = 32 * G; k < K; k++) { /* plain types only: quantised rows are whole groups */
            float wk = TYPE == T_F32   ? ((const float *)row)[k]
                       : TYPE == T_F16 ? f16_to_f32(rd16(row + 2 * k))
                                       : bf16_to_f32(rd16(row + 2 * k));
            s += wk * xs[t][k];
        }
        ys[t][r] = s;
    }
}

/* Rows outside, tokens inside: each row is read from memory once for the whole batch. */
#define ROWS_FN(NAME, TYPE)                                                                         \
    AVX2 static void NAME(const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs, \
                          float *const *ys, int nb) {                                               \
        for (long r = r0; r < r1; r++) {                                                            \
            const uint8_t *row = W + (size_t)r * rb;                                                \
            int t = 0;                                                                              \
            for (; t + 4 <= nb; t += 4) row_tmpl(TYPE, 4, row, K, xs + t, ys + t, r);              \
            switch (nb - t) {                                                                       \
            case 1: row_tmpl(TYPE, 1, row, K, xs + t, ys + t, r); break;                            \
            case 2: row_tmpl(TYPE, 2, row, K, xs + t, ys + t, r); break;                            \
            case 3: row_tmpl(TYPE, 3, row, K, xs + t, ys + t, r); break;                            \
            }                                                                                       \
        }                                                                                           \
    }

ROWS_FN(rows_f32, T_F32)
ROWS_FN(rows_f16, T_F16)
ROWS_FN(rows_bf16, T_BF16)
ROWS_FN(rows_q8_0, T_Q8_0)
ROWS_FN(rows_q4_0, T_Q4_0)
ROWS_FN(rows_mxfp4, T_MXFP4)
ROWS_FN(rows_q4_k, T_Q4_K)

static void rows_dot_avx2(int type, const uint8_t *W, size_t rb, long K, long r0, long r1,
                          const float *const *xs, float *const *ys, int nb) {
    switch (type) {
    case T_F32: rows_f32(W, rb, K, r0, r1, xs, ys, nb); break;
    case T_F16: rows_f16(W, rb, K, r0, r1, xs, ys, nb); break;
    case T_BF16: rows_bf16(W, rb, K, r0, r1, xs, ys, nb); break;
    case T_Q8_0: rows_q8_0(W, rb, K, r0, r1, xs, ys, nb); break;
    case T_Q4_0: rows_q4_0(W, rb, K, r0, r1, xs, ys, nb); break;
    case T_MXFP4: rows_mxfp4(W, rb, K, r0, r1, xs, ys, nb); break;
    case T_Q4_K: rows_q4_k(W, rb, K, r0, r1, xs, ys, nb); break;
    }
}
#endif

/* ------------------------------------------------------------------------------------------ */

static int use_avx2 = -1; /* -1: not decided yet */

int dot_use_simd(int want) {
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    int have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    use_avx2 = want && have;
#else
    (void)want;
    use_avx2 = 0;
#endif
    return use_avx2;
}

const char *dot_path(void) {
    if (use_avx2 < 0) dot_use_simd(1);
    return use_avx2 ? "avx2+fma+f16c" : "portable";
}

void rows_dot(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs,
              float *const *ys, int nb) {
    if (use_avx2 < 0) dot_use_simd(1);
#ifdef HAVE_AVX2_PATH
    if (use_avx2) {
        rows_dot_avx2(type, W, rb, K, r0, r1, xs, ys, nb);
        return;
    }
#endif
    rows_dot_portable(type, W, rb, K, r0, r1, xs, ys, nb);
}
