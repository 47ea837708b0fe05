/* The AVX2 path's switches, shared by dot.c and attend.c: whether this build has it, the target
 * attributes its functions carry (chosen at run time by dot_simd()), and a horizontal sum. */
#ifndef S2MOE_SIMD_H
#define S2MOE_SIMD_H

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
#endif

#endif
