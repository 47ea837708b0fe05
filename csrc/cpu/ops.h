/* Operations the Python seam calls (runtime/kernels/cpu.py); each returns 0 or a negative error. */
#ifndef S2MOE_OPS_H
#define S2MOE_OPS_H

#include <stdint.h>

enum { MOE_ACT_SWIGLU = 0, MOE_ACT_SWIGLU_CLAMPED = 1 };

/* One routed expert of a layer and the tokens sent to it. */
typedef struct {
    int gtype, utype, dtype;
    const uint8_t *gate, *up, *down;       /* [I, H], [I, H], [H, I] stored rows */
    const float *gate_bias, *up_bias, *down_bias; /* NULL when absent */
    const int32_t *tok;                    /* token rows of x, n of them */
    const float *weight;                   /* mixture weight per token */
    int n;
} moe_expert;

/* y[T, N] = x[T, K] W^T (+ bias[N]); -1: K does not fill whole blocks; -2: out of memory. */
int op_matmul(int type, const uint8_t *W, long N, long K, const float *x, int T, float *y, const float *bias);
/* out[n, K] = W[ids] decoded; -3: an id outside 0..N-1. */
int op_dequant_rows(int type, const uint8_t *W, long N, long K, const int64_t *ids, long n, float *out);
/* out[tok] += weight * down(act(gate x + gb, up x + ub)) + db, for every expert; threads split the
 * gate/up rows of all experts, then the output rows (each thread owns a slice of out). */
/* Whether op_matmul and op_moe quantise int8 activations once per call / phase (1, the default),
 * shared by every pool chunk, or in each chunk (0: as before; a switch for tests and benchmarks). */
int op_act_once(int on);
/* Whether op_moe splits its gate/up rows into chunks of equal work (1, the default) or rows (0). */
int op_moe_balance(int on);
int op_moe(const moe_expert *ex, int n_ex, long I, long H, const float *x, float *out, int act, float alpha,
           float limit);

/* KV cache types (model/kv_cache.py): a position's head row is D floats, D halves, or D/32 blocks
 * of ggml's q8_0 (f16 scale, 32 int8). Rows are rounded once, when written. */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2 };

static inline long kv_row_bytes(int kv_type, long D) {
    return kv_type == KV_F32 ? 4 * D : kv_type == KV_F16 ? 2 * D : (D % 32 ? 0 : D / 32 * 34);
}

/* Grouped-query attention of T new tokens at positions start.. over one layer's KV cache. */
typedef struct {
    const float *q, *k, *v;       /* [T, nh*D], [T, nkv*D], [T, nkv*D] (before RoPE) */
    uint8_t *kcache, *vcache;     /* [nkv, cap, row]: positions start..start+T-1 are written */
    const float *cos, *sin;       /* [T, D/2] */
    const uint8_t *allowed;       /* [T, start+T]: which slots each token sees */
    const float *sinks;           /* [nh] or NULL: a logit that joins each head's normaliser */
    float *out;                   /* [T, nh*D] */
    long T, nh, nkv, D, cap, start;
    float scale;
    int rope, interleave;
    int kv_type;                  /* KV_F32, KV_F16 or KV_Q8_0 */
} attn_args;

int op_attend(const attn_args *a);

/* The attention block of one layer: out = h + o(attention(RMSNorm(h))), the projections on stored
 * rows (q|k|v joined), optional q/k RMSNorm (1: over the whole projection, 2: per head). `attn`
 * carries the cache, RoPE tables, mask, sinks, sizes and scale; its q, k, v and out are set here. */
typedef struct {
    const float *h, *norm;        /* [T, H], [H] */
    float eps;
    int qkv_type, o_type;
    const uint8_t *qkv, *o;       /* [(nh + 2 nkv) D, H], [H, nh D] stored rows */
    const float *qkv_bias, *o_bias; /* NULL when absent */
    int qk_norm;                  /* 0 none, 1 full, 2 per head */
    const float *q_norm, *k_norm; /* [nh D] and [nkv D], or [D] and [D] */
    float *out;                   /* [T, H] */
    long T, H, nh, nkv, D;
    attn_args attn;
} attn_block_args;

int op_attn_block(const attn_block_args *b);

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for rows of n values (double accumulation). */
void op_rms_norm(const float *x, const float *w, long rows, long n, float eps, float *out);

/* y[N] = x[K] W (+ bias[N]) for a float32 W stored input-major [K, N], in a fixed order (see ops.c). */
void op_router(const float *W, long N, long K, const float *x, const float *bias, float *y);

/* Per row of T: the k largest of select[E] (ties: lower id first) into experts, and their mixture
 * weights from logits[E]: kind 0 softmax over all E (renormalised over the k if norm), kind 1
 * softmax over the k chosen; times scale. -1: bad k; -3: a NaN in select. */
int op_route(const float *logits, const float *select, long T, long E, int k, int kind, int norm, float scale,
             int64_t *experts, float *weights);

/* model/routing.py `restrict` for one token: choices not `allowed` ([E] bool) become -1 with weight
 * 0; a token left with none gets, with `best`, the allowed expert scored highest, at the weight of
 * its own top choice. */
void op_restrict(const float *logits, long E, int k, const uint8_t *allowed, int best, int64_t *experts,
                 float *weights);
/* One decode token's experts: total[H] = the sum, in choice order, of chosen[j]'s weighted output on
 * x[H] (a choice with a NULL gate adds a row of zeros); each choice's weight and no tok/n set. */
int op_moe_token(const moe_expert *chosen, int k, long I, long H, const float *x, float *total, int act, float alpha,
                 float limit);

#endif
