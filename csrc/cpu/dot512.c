/* Plain rows (F32, F16, BF16) against float tokens on AVX-512: sixteen weights a conversion and an
 * FMA, where AVX2 takes eight. A verification's few tokens are bound by that arithmetic (five
 * tokens read F16 rows at 22-31 GB/s, one token at 50), and here take 0.87-0.95x AVX2's time; one
 * token reads at the caches' rate either way (docs/performance/row-products.md).
 *
 * The sums are not AVX2's: sixteen lanes, two chains per row (elements 0-15 and 16-31 of each group
 * of 32), a row's last elements under a mask, then the compiler's fixed reduction. They are the
 * same whatever the token count and whichever rows run together, so a token's bits inside a
 * verification batch are its own pass's: greedy speculation stays AR's token for token. Results
 * differ from AVX2's by float32 rounding, as two machines' do; `dot_use_avx512(0)` keeps AVX2.
 */
#include "dot.h"

#include "quant.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX512_PATH 1
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#define INLINE_AVX512 static inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

/* n ≤ 16 weights of a plain row from element k (lanes past n are 0; no byte past them is read). */
INLINE_AVX512 __m512 load16(const int TYPE, const uint8_t *row, long k, __mmask16 m) {
    if (TYPE == T_F32) return _mm512_maskz_loadu_ps(m, (const float *)row + k);
    __m256i h = _mm256_maskz_loadu_epi16(m, row + 2 * k);
    if (TYPE == T_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE_AVX512 __mmask16 first(long n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* One row against NB (1..4) tokens. */
INLINE_AVX512 void row512(const int TYPE, const int NB, const uint8_t *row, long K, const float *const *xs,
                          float *const *ys, long r) {
    const long G = K / 32, rest = K - 32 * G;
    __m512 a[4][2];
    for (int t = 0; t < NB; t++) a[t][0] = a[t][1] = _mm512_setzero_ps();
    for (long g = 0; g < G; g++) {
        const __m512 w0 = load16(TYPE, row, 32 * g, 0xFFFF), w1 = load16(TYPE, row, 32 * g + 16, 0xFFFF);
        for (int t = 0; t < NB; t++) {
            a[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs[t] + 32 * g), a[t][0]);
            a[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs[t] + 32 * g + 16), a[t][1]);
        }
    }
    if (rest) { /* the row's last 1..31 elements, masked (0 · 0 adds nothing) */
        const long k = 32 * G;
        const __mmask16 m0 = first(rest), m1 = first(rest > 16 ? rest - 16 : 0);
        const __m512 w0 = load16(TYPE, row, k, m0), w1 = load16(TYPE, row, k + 16, m1);
        for (int t = 0; t < NB; t++) {
            a[t][0] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m0, xs[t] + k), a[t][0]);
            a[t][1] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m1, xs[t] + k + 16), a[t][1]);
        }
    }
    for (int t = 0; t < NB; t++) ys[t][r] = _mm512_reduce_add_ps(_mm512_add_ps(a[t][0], a[t][1]));
}

/* Four rows against one token: row512's operations for each, side by side (the same bits), so
 * eight FMA chains hide the FMA's latency; the next four rows' lines are asked for ahead, since
 * four rows read side by side are not one stream to the hardware prefetcher. */
INLINE_AVX512 void rows4_512(const int TYPE, const uint8_t *W, size_t rb, long K, const float *x, float *y, long r) {
    const long G = K / 32, rest = K - 32 * G, line = TYPE == T_F32 ? 128 : 64; /* bytes of a group */
    const uint8_t *row[4] = {W + (size_t)r * rb, W + (size_t)(r + 1) * rb, W + (size_t)(r + 2) * rb,
                             W + (size_t)(r + 3) * rb};
    __m512 a[4][2];
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    for (long g = 0; g < G; g++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * g), x1 = _mm512_loadu_ps(x + 32 * g + 16);
        for (int i = 0; i < 4; i++) {
            _mm_prefetch((const char *)row[i] + 4 * rb + line * g, _MM_HINT_T0);
            a[i][0] = _mm512_fmadd_ps(load16(TYPE, row[i], 32 * g, 0xFFFF), x0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(load16(TYPE, row[i], 32 * g + 16, 0xFFFF), x1, a[i][1]);
        }
    }
    if (rest) {
        const long k = 32 * G;
        const __mmask16 m0 = first(rest), m1 = first(rest > 16 ? rest - 16 : 0);
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, x + k), x1 = _mm512_maskz_loadu_ps(m1, x + k + 16);
        for (int i = 0; i < 4; i++) {
            a[i][0] = _mm512_fmadd_ps(load16(TYPE, row[i], k, m0), x0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(load16(TYPE, row[i], k + 16, m1), x1, a[i][1]);
        }
    }
    for (int i = 0; i < 4; i++) y[r + i] = _mm512_reduce_add_ps(_mm512_add_ps(a[i][0], a[i][1]));
}

#define ROWS512(NAME, TYPE)                                                                          \
    AVX512 static void NAME(const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs, \
                            float *const *ys, int nb, int four) {                                    \
        if (nb == 1 && four)                                                                         \
            for (; r0 + 4 <= r1; r0 += 4) rows4_512(TYPE, W, rb, K, xs[0], ys[0], r0);               \
        for (long r = r0; r < r1; r++) {                                                             \
            const uint8_t *row = W + (size_t)r * rb;                                                 \
            int t = 0;                                                                               \
            for (; t + 4 <= nb; t += 4) row512(TYPE, 4, row, K, xs + t, ys + t, r);                  \
            switch (nb - t) {                                                                        \
            case 1: row512(TYPE, 1, row, K, xs + t, ys + t, r); break;                               \
            case 2: row512(TYPE, 2, row, K, xs + t, ys + t, r); break;                               \
            case 3: row512(TYPE, 3, row, K, xs + t, ys + t, r); break;                               \
            }                                                                                        \
        }                                                                                            \
    }
ROWS512(rows512_f32, T_F32)
ROWS512(rows512_f16, T_F16)
ROWS512(rows512_bf16, T_BF16)
#endif

int dot512_available(void) {
#ifdef HAVE_AVX512_PATH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

void rows_plain_avx512(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs,
                       float *const *ys, int nb, int four) {
#ifdef HAVE_AVX512_PATH
    switch (type) {
    case T_F32: rows512_f32(W, rb, K, r0, r1, xs, ys, nb, four); break;
    case T_F16: rows512_f16(W, rb, K, r0, r1, xs, ys, nb, four); break;
    case T_BF16: rows512_bf16(W, rb, K, r0, r1, xs, ys, nb, four); break;
    }
#else
    (void)type, (void)W, (void)rb, (void)K, (void)r0, (void)r1, (void)xs, (void)ys, (void)nb, (void)four;
#endif
}
