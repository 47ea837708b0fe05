/* Row dot products of the K-quants (Q2_K … Q6_K) and the other llama.cpp block types (Q4_1, Q5_0,
 * Q5_1, IQ4_NL, IQ4_XS) against int8 activations. Q4_K_M, Q5_K_M and Q3_K_M files mix these types
 * (almost all carry Q6_K: the output head, attn_v, half the ffn_down), so each must run on its
 * stored blocks, not on float32 copies four to eight times their size.
 *
 * The scheme, in this file's portable form (kquant_avx2.c keeps the codes in registers and the
 * sums in integers): a row is taken 256 values at a time (a K-quant super-block, or eight 32-value
 * blocks) and unpacked into
 *     c[256]  int8 codes,   s[16], m[16]  the scale and offset of each run of 16,
 * so that w = s·c + m (Q6_K: c = q − 32, s = d·sc, m = 0; Q4_K: c = q, s = d·sc, m = −dmin·mn; …),
 * once for every token of the batch. Activations are int8 with a float scale dx per block: of 256
 * values against the super-block types (as llama.cpp's q8_K), of 32 against the others (as its
 * q8_0), so
 *     W[r]·x = Σ_runs dx · (s · Σ c·q + m · Σ q).
 * This file also holds the activations' quantiser and the row decoding (embedding lookups).
 *
 * A token's sums are taken in the same order whatever the batch and the rows beside it, so a
 * token's bits in a verification batch are its own decode pass's (greedy speculation equals AR).
 * stored.py `int8_runs_product` is the NumPy reference; its decoders are held to gguf.quants.
 */
#include "kquant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dot.h"
#include "quant.h"
#include "simd.h"

int kq_type(int type) {
    switch (type) {
    case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K:
    case T_Q6_K: case T_IQ4_XS: return 1;
    default: return 0;
    }
}

typedef struct {
    int8_t c[256] __attribute__((aligned(32)));
    float s[16] __attribute__((aligned(32)));
    float m[16] __attribute__((aligned(32)));
} kq_unit;

/* A 32-value block's codes from 16 bytes of nibbles: elements 0-15 low, 16-31 high. */
static inline __attribute__((always_inline)) void nibbles32(const uint8_t *qs, int8_t *c, int bias) {
    for (int l = 0; l < 16; l++) {
        c[l] = (int8_t)((qs[l] & 0xF) - bias);
        c[l + 16] = (int8_t)((qs[l] >> 4) - bias);
    }
}

static inline __attribute__((always_inline)) void table32(const int8_t *table, const uint8_t *qs, int8_t *c) {
    for (int l = 0; l < 16; l++) {
        c[l] = table[qs[l] & 0xF];
        c[l + 16] = table[qs[l] >> 4];
    }
}

/* The 5-bit codes of a Q5_0 / Q5_1 block (qh: bit i is element i's fifth bit). */
static inline __attribute__((always_inline)) void fives32(const uint8_t *qs, uint32_t qh, int8_t *c, int bias) {
    for (int l = 0; l < 16; l++) {
        c[l] = (int8_t)(((qs[l] & 0xF) | (((qh >> l) & 1) << 4)) - bias);
        c[l + 16] = (int8_t)(((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - bias);
    }
}

/* Unit u of a row (values 256u .. 256u + 32·ng) into k; returns whether it has offsets (m ≠ 0).
 * The portable path's unpacking, and the rows' decoding (kquant_avx2.c unpacks into registers). */
static inline __attribute__((always_inline)) int kq_unpack(int type, const uint8_t *row, long u, int ng, kq_unit *k) {
    for (int j = 2 * ng; j < 16; j++) k->s[j] = k->m[j] = 0.0f;
    switch (type) {
    case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4: {
        const int bb = block_bytes(type);
        for (int i = 0; i < ng; i++) {
            const uint8_t *b = row + (size_t)bb * (size_t)(8 * u + i);
            float d = type == T_MXFP4 ? e8m0_half(b[0]) : f16_to_f32(rd16(b)), m = 0.0f;
            if (type == T_Q4_1) { m = f16_to_f32(rd16(b + 2)); nibbles32(b + 4, k->c + 32 * i, 0); }
            if (type == T_Q5_0) fives32(b + 6, rd32(b + 2), k->c + 32 * i, 16);
            if (type == T_Q5_1) { m = f16_to_f32(rd16(b + 2)); fives32(b + 8, rd32(b + 4), k->c + 32 * i, 0); }
            if (type == T_IQ4_NL) table32(KVALUES_IQ4, b + 2, k->c + 32 * i);
            if (type == T_MXFP4) table32(KVALUES_MXFP4, b + 1, k->c + 32 * i); /* the doubled E2M1 values */
            k->s[2 * i] = k->s[2 * i + 1] = d;
            k->m[2 * i] = k->m[2 * i + 1] = m;
        }
        return type == T_Q4_1 || type == T_Q5_1;
    }
    case T_Q2_K: { /* scales[16] (low nibble scale, high nibble min), qs[64], d, dmin */
        const uint8_t *b = row + 84 * (size_t)u, *qs = b + 16;
        float d = f16_to_f32(rd16(b + 80)), dmin = f16_to_f32(rd16(b + 82));
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++) k->c[128 * h + 32 * s + l] = (int8_t)((qs[32 * h + l] >> (2 * s)) & 3);
        for (int j = 0; j < 16; j++) {
            k->s[j] = d * (float)(b[j] & 0xF);
            k->m[j] = -(dmin * (float)(b[j] >> 4));
        }
        return 1;
    }
    case T_Q3_K: { /* hmask[32], qs[64], scales[12] (6-bit, less 32), d; a clear hmask bit takes 4 off */
        const uint8_t *b = row + 110 * (size_t)u, *hm = b, *qs = b + 32, *sc = b + 96;
        float d = f16_to_f32(rd16(b + 108));
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++)
                    k->c[128 * h + 32 * s + l] = (int8_t)(((qs[32 * h + l] >> (2 * s)) & 3) -
                                                          (((hm[l] >> (4 * h + s)) & 1) ? 0 : 4));
        for (int j = 0; j < 16; j++) {
            int lo = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4, hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
            k->s[j] = d * (float)((lo | (hi << 4)) - 32);
            k->m[j] = 0.0f;
        }
        return 0;
    }
    case T_Q4_K: case T_Q5_K: { /* d, dmin, scales[12], (Q5_K: qh[32],) qs[128] */
        const uint8_t *b = row + (size_t)block_bytes(type) * (size_t)u;
        const uint8_t *qh = b + 16, *qs = b + (type == T_Q5_K ? 48 : 16);
        float d = f16_to_f32(rd16(b)), dmin = f16_to_f32(rd16(b + 2));
        for (int p = 0; p < 4; p++)
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * p + l] & 0xF, hi = qs[32 * p + l] >> 4;
                if (type == T_Q5_K) {
                    lo |= ((qh[l] >> (2 * p)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * p + 1)) & 1) << 4;
                }
                k->c[64 * p + l] = (int8_t)lo;
                k->c[64 * p + 32 + l] = (int8_t)hi;
            }
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            q4k_scale_min(j, b + 4, &sc, &mn);
            k->s[2 * j] = k->s[2 * j + 1] = d * (float)sc;
            k->m[2 * j] = k->m[2 * j + 1] = -(dmin * (float)mn);
        }
        return 1;
    }
    case T_Q6_K: { /* ql[128], qh[64], int8 scales[16], d: code = (4 low bits | 2 high bits << 4) − 32 */
        const uint8_t *b = row + 210 * (size_t)u, *ql = b, *qh = b + 128;
        float d = f16_to_f32(rd16(b + 208));
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++) {
                    int lo = (ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0xF;
                    int hi = (qh[32 * h + l] >> (2 * s)) & 3;
                    k->c[128 * h + 32 * s + l] = (int8_t)((lo | (hi << 4)) - 32);
                }
        for (int j = 0; j < 16; j++) {
            k->s[j] = d * (float)(int8_t)b[192 + j];
            k->m[j] = 0.0f;
        }
        return 0;
    }
    case T_IQ4_XS: { /* d, scales_h (u16), scales_l[4], qs[128]: 6-bit scales less 32, codes by table */
        const uint8_t *b = row + 136 * (size_t)u, *qs = b + 8;
        float d = f16_to_f32(rd16(b));
        int sh = rd16(b + 2);
        for (int i = 0; i < 8; i++) {
            int ls = ((b[4 + i / 2] >> (4 * (i % 2))) & 0xF) | (((sh >> (2 * i)) & 3) << 4);
            table32(KVALUES_IQ4, qs + 16 * i, k->c + 32 * i);
            k->s[2 * i] = k->s[2 * i + 1] = d * (float)(ls - 32);
            k->m[2 * i] = k->m[2 * i + 1] = 0.0f;
        }
        return 0;
    }
    }
    return 0;
}

/* (quant.h) one row's values, for the embedding lookup and the portable float path */
void kq_dequant_row(int type, const uint8_t *src, float *dst, long K) {
    const long G = K / 32;
    kq_unit k;
    for (long u = 0; u * 8 < G; u++) {
        int ng = G - 8 * u < 8 ? (int)(G - 8 * u) : 8;
        kq_unpack(type, src, u, ng, &k);
        for (int i = 0; i < 32 * ng; i++) dst[256 * u + i] = k.s[i / 16] * (float)k.c[i] + k.m[i / 16];
    }
}

/* ------------------------------------------------------------------------------------------ */
/* activations: int8 blocks of 32, and the runs of 16's sums (dx · Σ q) for the offsets         */

static void act_quantize_portable(const float *x, long K, int B, int8_t *q, float *d) {
    for (long g = 0; g < K / B; g++) {
        const float *p = x + (size_t)B * g;
        float amax = 0.0f;
        for (int i = 0; i < B; i++) amax = fmaxf(amax, fabsf(p[i]));
        float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
        d[g] = dd;
        for (int i = 0; i < B; i++) q[(size_t)B * g + i] = (int8_t)nearbyintf(p[i] * id);
    }
}

void act_quantize_blocks(const float *x, long K, int B, int8_t *q, float *d) {
#ifdef HAVE_AVX2_PATH
    if (dot_simd()) {
        act_quantize_avx2(x, K, B, q, d);
        return;
    }
#endif
    act_quantize_portable(x, K, B, q, d);
}

void act_quantize(const float *x, long K, int8_t *q, float *d) { act_quantize_blocks(x, K, 32, q, d); }

int kq_act_block(int type) {
    switch (type) {
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: return 256;
    default: return 32;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* the rows                                                                                   */

static void kq_rows_portable(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_acts *a,
                             float *const *ys, int nb) {
    const long G = K / 32, U = (G + 7) / 8;
    const int runs = kq_act_block(type) / 16; /* runs of 16 per activation scale */
    kq_unit k;
    for (long r = r0; r < r1; r++) {
        const uint8_t *row = W + (size_t)r * rb;
        for (int t = 0; t < nb; t++) ys[t][r] = 0.0f;
        for (long u = 0; u < U; u++) {
            int ng = G - 8 * u < 8 ? (int)(G - 8 * u) : 8, has_min = kq_unpack(type, row, u, ng, &k);
            for (int t = 0; t < nb; t++) {
                const int8_t *q = a->qs[t] + 256 * u;
                const int16_t *bs = a->bs[t] + 16 * u;
                float y = 0.0f;
                for (int j = 0; j < 2 * ng; j++) {
                    int isum = 0;
                    for (int i = 0; i < 16; i++) isum += k.c[16 * j + i] * q[16 * j + i];
                    float dx = a->ds[t][(16 * u + j) / runs];
                    y += dx * k.s[j] * (float)isum;
                    if (has_min) y += dx * k.m[j] * (float)bs[j];
                }
                ys[t][r] += y;
            }
        }
    }
}

int kq_batch_make(kq_batch *b, int type, const float *const *xs, int nb, long K) {
    const long U = (K / 32 + 7) / 8;
    const int B = kq_act_block(type);
    memset(b, 0, sizeof(*b));
    b->nb = nb;
    b->amx = B == 256 && nb >= kq_amx_min && kq_use_amx(-1);
    size_t n = nb > 0 ? (size_t)nb : 1, n_pad = b->amx ? (size_t)(nb + 15) / 16 * 16 : n;
    b->q = malloc(n_pad * (size_t)K + 32);
    b->d = malloc(sizeof(float) * (n_pad * (size_t)(K / B) + 1));
    b->bs = malloc(sizeof(int16_t) * (n_pad * (size_t)(16 * U) + 1));
    b->qs = malloc(sizeof(*b->qs) * n_pad);
    b->ds = malloc(sizeof(*b->ds) * n_pad);
    b->bsp = malloc(sizeof(*b->bsp) * n_pad);
    if (!b->q || !b->d || !b->bs || !b->qs || !b->ds || !b->bsp) {
        kq_batch_free(b);
        return -2;
    }
    for (size_t t = 0; t < (size_t)nb || (b->amx && t < n_pad); t++) {
        int8_t *qt = b->q + t * (size_t)K;
        int16_t *bt = b->bs + t * (size_t)(16 * U);
        if (t < (size_t)nb)
            act_quantize_blocks(xs[t], K, B, qt, b->d + t * (size_t)(K / B));
        else { /* the AMX tiles' padding: zero codes and scales */
            memset(qt, 0, (size_t)K);
            memset(b->d + t * (size_t)(K / B), 0, sizeof(float) * (size_t)(K / B));
        }
        for (long j = 0; j < 16 * U; j++) { /* Σ q over each run of 16 (0 past the row) */
            int sum = 0;
            for (int i = 0; j < K / 16 && i < 16; i++) sum += qt[16 * j + i];
            bt[j] = (int16_t)sum;
        }
        b->qs[t] = qt;
        b->ds[t] = b->d + t * (size_t)(K / B);
        b->bsp[t] = bt;
    }
    return 0;
}

void kq_batch_free(kq_batch *b) {
    free(b->q);
    free(b->d);
    free(b->bs);
    free((void *)b->qs);
    free((void *)b->ds);
    free((void *)b->bsp);
    memset(b, 0, sizeof(*b));
}

void rows_dot_kq_batch(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const kq_batch *b,
                       float *const *ys) {
    kq_acts acts = {b->qs, b->ds, b->bsp};
    if (b->amx && kq_rows_amx(type, W, rb, K, r0, r1, b, ys)) return;
#ifdef HAVE_AVX2_PATH
    if (dot_simd()) {
        kq_rows_avx2(type, W, rb, K, r0, r1, &acts, ys, b->nb);
        return;
    }
#endif
    kq_rows_portable(type, W, rb, K, r0, r1, &acts, ys, b->nb);
}

void rows_dot_kq(int type, const uint8_t *W, size_t rb, long K, long r0, long r1, const float *const *xs,
                 float *const *ys, int nb) {
    kq_batch b;
    if (kq_batch_make(&b, type, xs, nb, K)) return; /* callers check inputs; an allocation failure leaves y unchanged */
    rows_dot_kq_batch(type, W, rb, K, r0, r1, &b, ys);
    kq_batch_free(&b);
}
