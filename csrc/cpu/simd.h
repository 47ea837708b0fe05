/* The AVX2 path's switches, shared by dot.c and attend.c: whether this build has it, the target
 * attributes its functions carry (chosen at run time by dot_simd()), and a horizontal sum. */
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

INLINE_AVX2 float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
