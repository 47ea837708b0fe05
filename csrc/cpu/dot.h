/* Row dot products on stored blocks (see dot.c). */
#ifndef S2MOE_DOT_H
#define S2MOE_DOT_H

#include <stddef.h>
#include <stdint.h>

/* ys[t][r] = W[r] . xs[t] for r in [r0, r1), t < nb; W rows are rb bytes of K values of `type`. */
void rows_dot(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs,
              float *const *ys, int nb);
/* Use the SIMD path if `want` and the CPU has it; returns whether it is used. */
int dot_use_simd(int want);
/* Which VNNI products Q8_0 / Q4_0 rows against int8 activations take (the same bits as AVX2): want 0
 * keeps AVX2, 1 the best there is (AVX-VNNI, else AVX-512 VNNI), 2 AVX-512 VNNI only (tests). Returns
 * the choice: 0 none (no SIMD path or no such instruction), 1 AVX-VNNI, 2 AVX-512 VNNI. */
int dot_use_vnni(int want);
/* Whether this build holds the VNNI products (a compiler and assembler that know them). */
int dot_vnni_built(void);
/* The VNNI products in use (dot_use_vnni's return). */
int dot_vnni(void);
/* Whether the SIMD path is in use (attend.c follows the same switch). */
int dot_simd(void);
/* Q8_0 / Q4_0 rows against int8-quantised activations (1, the default) or float ones (0); -1 asks. */
int dot_act_q8(int on);
/* Whether rows_dot takes kquant.c's int8 kernel for `type` (so a kq_batch may stand for its xs). */
int dot_kq_path(int type);
/* One token against plain rows four at a time (1, the default) or one at a time (0): the same bits,
 * a switch for benchmarks and tests; -1 asks. */
int dot_rows4(int on);
/* AVX-512 where the CPU has it (F, BW, VL): plain rows (F32, F16, BF16, dot512.c) and the K-quants'
 * batches in tiles of rows × tokens (kquant_avx2.c, the same bits as AVX2's). want 1 (the default)
 * or 0 (AVX2 alone, for tests and benchmarks); -1 asks. Returns the choice. */
int dot_use_avx512(int want);
/* dot512.c: whether this build and CPU have its path, and its rows (`four`: one token four rows at a time). */
int dot512_available(void);
void rows_plain_avx512(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs,
                       float *const *ys, int nb, int four);
/* "avx2+fma+f16c" or "portable". */
const char *dot_path(void);

#endif
