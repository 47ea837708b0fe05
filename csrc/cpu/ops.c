/* Matrix x small batch and the fused SwiGLU experts of one MoE layer, split over the thread pool. */
#include "ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dot.h"
#include "kquant.h"
#include "pool.h"
#include "quant.h"


/* ---------------------------------------------------------------------------------------------- */
/* matmul: y[T, N] = x[T, K] W[N, K]^T (+ bias)                                                    */

typedef struct {
    int type;
    const uint8_t *W;
    size_t rb;
    long N, K;
    int T;
    const float *const *xs;
    float *const *ys;
    const float *bias;
    const kq_batch *xq; /* the xs quantised once for every chunk, or NULL */
} matmul_job;

static int act_once = 1; /* see ops.h op_act_once */

int op_act_once(int on) {
    if (on >= 0) act_once = on != 0;
    return act_once;
}

static void matmul_part(void *p, int ith, int nth) {
    const matmul_job *j = p;
    long r0, r1;
    pool_span(j->N, ith, nth, &r0, &r1);
    if (r0 >= r1) return;
    if (j->xq)
        rows_dot_kq_batch(j->type, j->W, j->rb, j->K, r0, r1, j->xq, j->ys);
    else
        rows_dot(j->type, j->W, j->rb, j->K, r0, r1, j->xs, j->ys, j->T);
    if (j->bias)
        for (int t = 0; t < j->T; t++)
            for (long r = r0; r < r1; r++) j->ys[t][r] += j->bias[r];
}

int op_matmul(int type, const uint8_t *W, long N, long K, const float *x, int T, float *y, const float *bias) {
    size_t rb = row_bytes(type, K);
    if (!rb) return -1;
    const float **xs = malloc(sizeof(float *) * (size_t)T);
    float **ys = malloc(sizeof(float *) * (size_t)T);
    if (!xs || !ys) {
        free(xs);
        free(ys);
        return -2;
    }
    for (int t = 0; t < T; t++) {
        xs[t] = x + (size_t)t * (size_t)K;
        ys[t] = y + (size_t)t * (size_t)N;
    }
    matmul_job j = {type, W, rb, N, K, T, xs, ys, bias, NULL};
    if (N * K * (long)T < POOL_MIN_WORK || pool_threads() <= 1) {
        matmul_part(&j, 0, 1);
    } else {
        /* a prompt's tokens quantised once, not in each of the pool's chunks (T > 1: one token's
         * quantisation is cheaper than the chunks' wait for it) */
        kq_batch xq;
        int shared = act_once && T > 1 && dot_kq_path(type) && kq_batch_make(&xq, type, xs, T, K) == 0;
        j.xq = shared ? &xq : NULL;
        pool_run(matmul_part, &j, pool_chunks());
        if (shared) kq_batch_free(&xq);
    }
    free(xs);
    free(ys);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* dequantise rows (embedding lookups)                                                            */

int op_dequant_rows(int type, const uint8_t *W, long N, long K, const int64_t *ids, long n, float *out) {
    size_t rb = row_bytes(type, K);
    if (!rb) return -1;
    for (long i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= N) return -3;
        dequant_row(type, W + (size_t)ids[i] * rb, out + (size_t)i * (size_t)K, K);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* one MoE layer's routed experts                                                                 */

typedef struct {
    const moe_expert *ex;
    int n_ex;
    long I, H;
    const float *x;
    float *out;
    int act;
    float alpha, limit;
    /* per expert: pointers into scratch */
    const float ***x_rows;  /* [e][j] -> x[tok_j]   */
    float ***g_rows;        /* [e][j] -> gate / act  */
    float ***u_rows;        /* [e][j] -> up          */
    float ***d_rows;        /* [e][j] -> down output */
    kq_batch *xq, *gq;      /* [e]: x and the activations quantised once (nb 0: not made) */
    long *cost;             /* [e + 1]: gate/up work before expert e, in (row, token) units */
} moe_job;

/* A gate/up row's work: its tokens, and a few more for reading and unpacking it. Chunks of equal
 * rows took uneven work: a random-weight OLMoE-1B-7B's late layers send 180-500 of a 512-token
 * prompt's tokens to one expert and none to many, so one chunk held most of a layer. */
static int moe_balance = 1; /* 0: every row one unit, chunks of equal rows (as before; benchmarks) */
#define MOE_ROW_COST(n) (moe_balance ? (long)(n) + 4 : 1L)

int op_moe_balance(int on) {
    if (on >= 0) moe_balance = on != 0;
    return moe_balance;
}

static inline long ceil_rows(long c, long w) { return c <= 0 ? 0 : (c + w - 1) / w; }

/* Quantise each expert's inputs once per phase (gate/up: x; down: the activations) where its rows
 * take kquant.c's int8 kernel. Quantised per pool chunk instead, a 512-token prompt at
 * OLMoE-1B-7B's shape quantised each expert's activations in every one of the 8 down chunks. */
static void moe_quantise_part(void *p, int ith, int nth, int down) {
    const moe_job *m = p;
    long e0, e1;
    pool_span(m->n_ex, ith, nth, &e0, &e1);
    for (long e = e0; e < e1; e++) {
        const moe_expert *x = &m->ex[e];
        if (down ? !dot_kq_path(x->dtype)
                 : !(dot_kq_path(x->gtype) && dot_kq_path(x->utype) &&
                     kq_act_block(x->gtype) == kq_act_block(x->utype)))
            continue;
        if (down)
            kq_batch_make(&m->gq[e], x->dtype, (const float *const *)m->g_rows[e], x->n, m->I);
        else
            kq_batch_make(&m->xq[e], x->gtype, m->x_rows[e], x->n, m->H);
    }
}

static void moe_quantise_x(void *p, int ith, int nth) { moe_quantise_part(p, ith, nth, 0); }
static void moe_quantise_g(void *p, int ith, int nth) { moe_quantise_part(p, ith, nth, 1); }

static inline float activate(const moe_job *m, float g, float u) {
    if (m->act == MOE_ACT_SWIGLU_CLAMPED) {
        if (g > m->limit) g = m->limit;
        if (u > m->limit) u = m->limit;
        if (u < -m->limit) u = -m->limit;
        return (u + 1.0f) * g / (1.0f + expf(-m->alpha * g));
    }
    return g / (1.0f + expf(-g)) * u;
}

/* phase 1: gate and up rows of every expert, as one flat row range, then the activation */
static void moe_gate_up_part(void *p, int ith, int nth) {
    const moe_job *m = p;
    const long I = m->I, H = m->H;
    long c0, c1; /* this chunk's share of the work; a row goes where its work starts */
    pool_span(m->cost[m->n_ex], ith, nth, &c0, &c1);
    for (int e = 0; e < m->n_ex; e++) {
        const moe_expert *x = &m->ex[e];
        const long w = (m->cost[e + 1] - m->cost[e]) / I; /* (the flag read once, in op_moe) */
        long r0 = ceil_rows(c0 - m->cost[e], w), r1 = ceil_rows(c1 - m->cost[e], w);
        r0 = r0 < I ? r0 : I;
        r1 = r1 < I ? r1 : I;
        if (r0 >= r1) continue;
        if (m->xq[e].nb) {
            rows_dot_kq_batch(x->gtype, x->gate, row_bytes(x->gtype, H), H, r0, r1, &m->xq[e], m->g_rows[e]);
            rows_dot_kq_batch(x->utype, x->up, row_bytes(x->utype, H), H, r0, r1, &m->xq[e], m->u_rows[e]);
        } else {
            rows_dot(x->gtype, x->gate, row_bytes(x->gtype, H), H, r0, r1, m->x_rows[e], m->g_rows[e], x->n);
            rows_dot(x->utype, x->up, row_bytes(x->utype, H), H, r0, r1, m->x_rows[e], m->u_rows[e], x->n);
        }
        for (int j = 0; j < x->n; j++) {
            float *g = m->g_rows[e][j], *u = m->u_rows[e][j];
            for (long r = r0; r < r1; r++)
                g[r] = activate(m, g[r] + (x->gate_bias ? x->gate_bias[r] : 0.0f),
                                u[r] + (x->up_bias ? x->up_bias[r] : 0.0f));
        }
    }
}

/* phase 2 (after every activation of phase 1): down rows split by output row, so each chunk owns
 * its slice of out */
static void moe_down_part(void *p, int ith, int nth) {
    const moe_job *m = p;
    const long I = m->I, H = m->H;
    long r0, r1;
    pool_span(H, ith, nth, &r0, &r1);
    if (r0 >= r1) return;
    for (int e = 0; e < m->n_ex; e++) {
        const moe_expert *x = &m->ex[e];
        if (m->gq[e].nb)
            rows_dot_kq_batch(x->dtype, x->down, row_bytes(x->dtype, I), I, r0, r1, &m->gq[e], m->d_rows[e]);
        else
            rows_dot(x->dtype, x->down, row_bytes(x->dtype, I), I, r0, r1, (const float *const *)m->g_rows[e],
                     m->d_rows[e], x->n);
        for (int j = 0; j < x->n; j++) {
            float *o = m->out + (size_t)x->tok[j] * (size_t)H, *d = m->d_rows[e][j], w = x->weight[j];
            for (long r = r0; r < r1; r++) o[r] += w * (d[r] + (x->down_bias ? x->down_bias[r] : 0.0f));
        }
    }
}

int op_moe(const moe_expert *ex, int n_ex, long I, long H, const float *x, float *out, int act, float alpha,
           float limit) {
    long pairs = 0;
    for (int e = 0; e < n_ex; e++) {
        if (!row_bytes(ex[e].gtype, H) || !row_bytes(ex[e].utype, H) || !row_bytes(ex[e].dtype, I)) return -1;
        pairs += ex[e].n;
    }
    /* scratch: gate/act [pairs, I], up [pairs, I], down out [pairs, H], and the row pointers */
    float *scratch = arena_get(ARENA_MOE, sizeof(float) * (size_t)pairs * (size_t)(2 * I + H) + 1);
    void **ptrs = malloc(sizeof(void *) * ((size_t)pairs * 4 + (size_t)n_ex * 4) + 1);
    kq_batch *batches = calloc(2 * (size_t)n_ex + 1, sizeof(kq_batch)); /* zeroed: nb 0, none made */
    long *cost = malloc(sizeof(long) * ((size_t)n_ex + 1));
    if (!scratch || !ptrs || !batches || !cost) {
        free(ptrs);
        free(batches);
        free(cost);
        return -2;
    }
    cost[0] = 0;
    for (int e = 0; e < n_ex; e++) cost[e + 1] = cost[e] + MOE_ROW_COST(ex[e].n) * I;
    moe_job m = {ex, n_ex, I, H, x, out, act, alpha, limit, NULL, NULL, NULL, NULL, batches, batches + n_ex, cost};
    void **heads = ptrs, **rows = ptrs + (size_t)n_ex * 4;
    m.x_rows = (const float ***)heads;
    m.g_rows = (float ***)(heads + n_ex);
    m.u_rows = (float ***)(heads + 2 * n_ex);
    m.d_rows = (float ***)(heads + 3 * n_ex);
    float *g = scratch, *u = scratch + (size_t)pairs * I, *d = scratch + (size_t)pairs * 2 * I;
    for (int e = 0; e < n_ex; e++) {
        int n = ex[e].n;
        m.x_rows[e] = (const float **)rows;
        m.g_rows[e] = (float **)(rows + n);
        m.u_rows[e] = (float **)(rows + 2 * n);
        m.d_rows[e] = (float **)(rows + 3 * n);
        for (int j = 0; j < n; j++) {
            m.x_rows[e][j] = x + (size_t)ex[e].tok[j] * (size_t)H;
            m.g_rows[e][j] = g;
            m.u_rows[e][j] = u;
            m.d_rows[e][j] = d;
            g += I;
            u += I;
            d += H;
        }
        rows += 4 * (size_t)n;
    }
    long work = 3 * pairs * I * H;
    /* one chunk reads an expert's inputs: nothing to share (a decode token's few experts) */
    const int share = act_once && pool_threads() > 1 && work >= POOL_MIN_WORK;
    if (work < POOL_MIN_WORK || pool_threads() <= 1) {
        moe_gate_up_part(&m, 0, 1);
        moe_down_part(&m, 0, 1);
    } else {
        if (share) pool_run(moe_quantise_x, &m, pool_chunks());
        pool_run(moe_gate_up_part, &m, pool_chunks());
        if (share) pool_run(moe_quantise_g, &m, pool_chunks());
        pool_run(moe_down_part, &m, pool_chunks());
    }
    for (int e = 0; e < 2 * n_ex; e++) kq_batch_free(&batches[e]);
    free(batches);
    free(cost);
    free(ptrs);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* RMSNorm over rows: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w                                */

void op_rms_norm(const float *x, const float *w, long rows, long n, float eps, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * (size_t)n;
        float *o = out + (size_t)r * (size_t)n;
        double ss = 0.0;
        for (long i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        float scale = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
        for (long i = 0; i < n; i++) o[i] = xr[i] * scale * w[i];
    }
}

/* y[N] = x[K] W + bias for an input-major float32 W [K, N] (the router, kept so for BLAS): the
 * products of x[0], then x[1], … added in that order, the same bits for every caller */
void op_router(const float *W, long N, long K, const float *x, const float *bias, float *y) {
    for (long n = 0; n < N; n++) y[n] = 0.0f;
    for (long k = 0; k < K; k++) {
        const float xk = x[k], *row = W + (size_t)k * (size_t)N;
        for (long n = 0; n < N; n++) y[n] += xk * row[n];
    }
    if (bias)
        for (long n = 0; n < N; n++) y[n] += bias[n];
}

/* ---------------------------------------------------------------------------------------------- */
/* routing: top-k of each row of `select`, mixture weights from `logits` (runtime/model/routing.py) */

int op_route(const float *logits, const float *select, long T, long E, int k, int kind, int norm, float scale,
             int64_t *experts, float *weights) {
    if (k <= 0 || k > E || k > 64) return -1;
    for (long t = 0; t < T; t++) {
        const float *lg = logits + (size_t)t * E, *sel = select + (size_t)t * E;
        int64_t *ex = experts + (size_t)t * k;
        float *w = weights + (size_t)t * k;
        /* insertion into a sorted top-k list: strictly greater moves up, so ties keep the lower id
         * first (the reference's stable sort); NaN never enters */
        int n = 0;
        for (long e = 0; e < E; e++) {
            float v = sel[e];
            if (!(v == v)) return -3; /* NaN: the reference path decides what that means */
            if (n == k && !(v > sel[ex[k - 1]])) continue;
            int i = n < k ? n++ : k - 1;
            while (i > 0 && v > sel[ex[i - 1]]) {
                ex[i] = ex[i - 1];
                i--;
            }
            ex[i] = e;
        }
        /* weights: softmax over all experts (kind 0) or over the chosen logits (kind 1) */
        float top = -INFINITY;
        if (kind == 0)
            for (long e = 0; e < E; e++) top = lg[e] > top ? lg[e] : top;
        else
            for (int j = 0; j < k; j++) top = lg[ex[j]] > top ? lg[ex[j]] : top;
        double total = 0.0;
        if (kind == 0)
            for (long e = 0; e < E; e++) total += expf(lg[e] - top);
        for (int j = 0; j < k; j++) {
            w[j] = expf(lg[ex[j]] - top);
            if (kind == 1) total += w[j];
        }
        for (int j = 0; j < k; j++) w[j] = (float)(w[j] / total);
        if (norm && kind == 0) {
            double chosen = 0.0;
            for (int j = 0; j < k; j++) chosen += w[j];
            for (int j = 0; j < k; j++) w[j] = (float)(w[j] / chosen);
        }
        if (scale != 1.0f)
            for (int j = 0; j < k; j++) w[j] *= scale;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* one decode token's MoE layer (step.c): the restriction of its choices, then its experts         */

void op_restrict(const float *logits, long E, int k, const uint8_t *allowed, int best, int64_t *experts,
                 float *weights) {
    float w0 = weights[0];
    int left = 0;
    for (int j = 0; j < k; j++) {
        if (experts[j] >= 0 && experts[j] < E && allowed[experts[j]]) {
            left++;
        } else {
            experts[j] = -1;
            weights[j] = 0.0f;
        }
    }
    if (!best || left) return;
    int any = 0;
    for (long e = 0; e < E; e++) any |= allowed[e] != 0;
    if (!any) return;
    /* NumPy's argmax over the allowed scores (the rest -inf): the first maximum */
    long at = 0;
    float top = allowed[0] ? logits[0] : -INFINITY;
    for (long e = 1; e < E; e++) {
        float v = allowed[e] ? logits[e] : -INFINITY;
        if (v > top) {
            top = v;
            at = e;
        }
    }
    experts[0] = at;
    weights[0] = w0;
}

int op_moe_token(const moe_expert *chosen, int k, long I, long H, const float *x, float *total, int act, float alpha,
                 float limit) {
    /* rows [k, H] of x and of out: choice j reads row j and writes row j, as the batch path's
     * row t·k + j does (its tok is j) */
    float *xk = malloc(sizeof(float) * (size_t)(2 * k) * (size_t)H + 1);
    moe_expert *ex = malloc(sizeof(moe_expert) * (size_t)k + 1);
    int32_t *slot = malloc(sizeof(int32_t) * (size_t)k + 1);
    if (!xk || !ex || !slot) {
        free(xk);
        free(ex);
        free(slot);
        return -2;
    }
    float *out = xk + (size_t)k * (size_t)H;
    int n_ex = 0;
    for (int j = 0; j < k; j++) {
        memcpy(xk + (size_t)j * (size_t)H, x, sizeof(float) * (size_t)H);
        memset(out + (size_t)j * (size_t)H, 0, sizeof(float) * (size_t)H);
        if (!chosen[j].gate) continue; /* a dropped choice: its row stays 0 */
        slot[j] = j;
        ex[n_ex] = chosen[j];
        ex[n_ex].tok = &slot[j];
        ex[n_ex].n = 1;
        n_ex++;
    }
    int rc = n_ex ? op_moe(ex, n_ex, I, H, xk, out, act, alpha, limit) : 0;
    if (!rc) { /* the rows summed in choice order, one addition at a time: NumPy's float32 sums */
        memcpy(total, out, sizeof(float) * (size_t)H);
        for (int j = 1; j < k; j++)
            for (long r = 0; r < H; r++) total[r] = total[r] + out[(size_t)j * (size_t)H + r];
    }
    free(xk);
    free(ex);
    free(slot);
    return rc;
}
