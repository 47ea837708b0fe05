/* Rows of the K-quants and the other llama.cpp block types against int8 activations (kquant.c). */
#ifndef S2MOE_KQUANT_H
#define S2MOE_KQUANT_H

#include <stddef.h>
#include <stdint.h>

/* Whether `type` has kquant.c's int8 kernel (Q2_K … Q6_K, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS). */
int kq_type(int type);
/* ys[t][r] = W[r] . xs[t] for r in [r0, r1), t < nb, with each x quantised to int8 blocks of 32. */
void rows_dot_kq(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs,
                 float *const *ys, int nb);
/* One token's x [K] (K a multiple of 32) as int8 blocks of 32 and their scales: d = max|x| / 127,
 * q = x · (1/d) rounded half to even, all in float32 (stored.py `quantize_activations`). */
void act_quantize(const float *x, long K, int8_t *q, float *d);

/* A batch's activations quantised once, for every row range that reads them (op_moe quantises an
 * expert's tokens once per phase instead of once per pool chunk). Made for `type`'s activation
 * block; any type of the same block reads it. kq_batch_make: 0, or -2 (out of memory). */
typedef struct {
    int nb;
    int8_t *q;
    float *d;
    int16_t *bs;
    const int8_t **qs;
    const float **ds;
    const int16_t **bsp;
    /* whether kquant_amx.c's tiles take this batch: then q, d and bs hold whole tiles of 16 tokens,
     * the last padded with zeros, and the codes of token t start at q + t · K */
    int amx;
} kq_batch;
int kq_batch_make(kq_batch *b, int type, const float *const *xs, int nb, long K);
void kq_batch_free(kq_batch *b);
void rows_dot_kq_batch(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_batch *b,
                       float *const *ys);

/* Whether the K-quants' batches take AMX tiles (kquant_amx.c): `want` 0 or 1 sets it, −1 asks; on
 * only where the CPU has AMX-INT8, the OS grants its state and the AVX-512 rows are on. */
int kq_use_amx(int want);
int kq_amx_built(void);
/* The fewest tokens a batch takes the AMX tiles with. */
extern int kq_amx_min;

/* -- between kquant.c and kquant_avx2.c / kquant_amx.c -- */

int kq_amx_type(int type); /* a K-quant with unsigned codes (Q2_K … Q6_K) */
/* 1 where the tiles took the rows (b laid out, a K-quant with unsigned codes), else 0 */
int kq_rows_amx(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_batch *b,
                float *const *ys);

/* The same, in blocks of B values (32 or 256). */
void act_quantize_blocks(const float *x, long K, int B, int8_t *q, float *d);
/* The activation block of `type`'s kernel: 256 for the K-quants and IQ4_XS (one scale per
 * super-block, so its integer sums need one float step), 32 for the 32-value blocks. */
int kq_act_block(int type);

/* A batch's activations: int8 codes [K], scales [K / block] and Σ codes per run of 16 [16 · units]. */
typedef struct {
    const int8_t *const *qs;
    const float *const *ds;
    const int16_t *const *bs;
} kq_acts;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
void act_quantize_avx2(const float *x, long K, int B, int8_t *q, float *d);
void kq_rows_avx2(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_acts *a,
                  float *const *ys, int nb);
#endif

#endif
