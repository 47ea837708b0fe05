/* The AVX2 path's switches, shared by dot.c, attend.c and predict.c: whether this build has it, the
 * target attributes its functions carry (chosen at run time by dot_simd()), a horizontal sum and an
 * exp. */
#ifndef S2MOE_SIMD_H
#define S2MOE_SIMD_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE_AVX2 static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* AVX-VNNI (Alder Lake, Sapphire Rapids and later): one instruction for the int8 products of the
 * Q8_0 / Q4_0 rows against int8 activations (dot.c), where AVX2 takes three. GCC 11 and clang 16
 * (and its run-time check) first know it; older compilers build the AVX2 path alone, and so does a
 * toolchain whose assembler cannot emit it (setup.py probes and defines S2MOE_NO_VNNI). */
#if ((defined(__clang__) && __clang_major__ >= 16) || (!defined(__clang__) && __GNUC__ >= 11)) && !defined(S2MOE_NO_VNNI)
#define HAVE_VNNI_PATH 1
#define VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define INLINE_VNNI static inline __attribute__((always_inline, target("avx2,fma,f16c,avxvnni")))
/* the same instruction in its EVEX form, on 256-bit registers: AVX-512 VNNI CPUs without AVX-VNNI
 * (Ice Lake, Cascade Lake, Zen 4) */
#define VNNI512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define INLINE_VNNI512 static inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#endif

/* AMX-INT8 (Sapphire Rapids and later): tile products for a prompt's K-quant rows (kquant_amx.c).
 * GCC 11 and clang 12 know its intrinsics; setup.py probes the assembler (S2MOE_NO_AMX). */
#if ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)) && !defined(S2MOE_NO_AMX) && defined(__linux__)
#define HAVE_AMX_PATH 1
#endif

INLINE_AVX2 float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x ≤ 0 (attention scores, or logits, minus their maximum): x = n·ln2 + r with
 * |r| ≤ ln2/2, e^r by a degree-6 polynomial (Cephes' expf coefficients, relative error about 1e-7),
 * 2^n through the exponent bits. Below -87 the result is 0, as expf's underflow is. */
INLINE_AVX2 __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

#endif
