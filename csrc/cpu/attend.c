/* Grouped-query attention of a few new tokens over one layer's KV cache: RoPE, the cache write,
 * the masked softmax and the weighted sum of values, one (token, head) pair per work item.
 *
 * Decode and verification are a handful of queries against the whole cache, so the work is
 * per slot: q·k, one exp, one row of V. With AVX2 (head widths that are whole multiples of 8) a
 * slot costs a few FMAs, a horizontal sum and an eighth of a vector exp; the portable path (and
 * any other width) does the same in plain loops. The default model's 8 heads over 191 slots took
 * 30 µs in the portable loop, whose scalar expf and per-slot call dominated.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dot.h"
#include "ops.h"
#include "pool.h"
#include "quant.h"
#include "simd.h"

typedef struct {
    float *qr; /* [T, nh*D]: q after RoPE */
    const attn_args *a;
} attn_job;

static void rope_row(float *x, const float *cos, const float *sin, long D, int interleave) {
    long half = D / 2;
    for (long i = 0; i < half; i++) {
        float c = cos[i], s = sin[i];
        if (interleave) {
            float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * c - b * s;
            x[2 * i + 1] = b * c + a * s;
        } else {
            float a = x[i], b = x[i + half];
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    }
}

/* One head of one token, portable: o = Σ_s softmax(scale · q·K[s])_s V[s] over allowed slots. */
static void head_portable(const float *q, const float *K, const float *V, const uint8_t *ok, long S, long D,
                          float scale, const float *sink, float *scores, float *acc, float *o) {
    float top = -INFINITY;
    for (long s = 0; s < S; s++) {
        if (!ok[s]) continue;
        const float *k = K + (size_t)s * D;
        float dot = 0.0f;
        for (long d = 0; d < D; d++) dot += q[d] * k[d];
        scores[s] = dot * scale;
        if (scores[s] > top) top = scores[s];
    }
    if (sink && *sink > top) top = *sink;
    double total = sink ? exp((double)*sink - top) : 0.0;
    for (long d = 0; d < D; d++) acc[d] = 0.0f;
    for (long s = 0; s < S; s++) {
        if (!ok[s]) continue;
        const float w = expf(scores[s] - top), *v = V + (size_t)s * D;
        total += w;
        for (long d = 0; d < D; d++) acc[d] += w * v[d];
    }
    const float inv = (float)(1.0 / total);
    for (long d = 0; d < D; d++) o[d] = acc[d] * inv;
}

#ifdef HAVE_AVX2_PATH
/* One head of one token (see head_portable). N8 = D / 8 is a compile-time constant in each
 * instance, so the loops unroll and the accumulators live in registers: with a run-time width the
 * compiler kept them in memory, and each slot waited on a store and a reload (2.3x slower). */
INLINE_AVX2 void head_avx2_n(
    const long N8, const float *q, const float *K, const float *V, const uint8_t *ok, long S, float scale,
    const float *sink, float *scores, float *o) {
    const long D = 8 * N8;
    __m256 qv[N8];
    for (long i = 0; i < N8; i++) qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * i), _mm256_set1_ps(scale));
    /* scores, 8 slots at a time: eight independent dot products, then one transposing reduction */
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    long s0 = 0;
    for (; s0 + 8 <= S; s0 += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) {
            const float *k = K + (size_t)(s0 + j) * D;
            a[j] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
            for (long i = 1; i < N8; i++) a[j] = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k + 8 * i), a[j]);
        }
        __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        __m256 sc = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
        __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ok + s0)));
        sc = _mm256_blendv_ps(sc, ninf, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, _mm256_setzero_si256())));
        _mm256_storeu_ps(scores + s0, sc); /* masked: -inf, whose exp below is 0 */
        vmax = _mm256_max_ps(vmax, sc);
    }
    float top = -INFINITY, lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    for (long s = s0; s < S; s++) {
        if (!ok[s]) {
            scores[s] = -INFINITY;
            continue;
        }
        const float *k = K + (size_t)s * D;
        __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
        for (long i = 1; i < N8; i++) a = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k + 8 * i), a);
        scores[s] = hsum(a);
        if (scores[s] > top) top = scores[s];
    }
    if (sink && *sink > top) top = *sink;
    const __m256 vtop = _mm256_set1_ps(top);
    long s = 0;
    for (; s + 8 <= S; s += 8) _mm256_storeu_ps(scores + s, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), vtop)));
    if (s < S) { /* the last few slots through the same exp, so every weight rounds alike */
        float tail[8];
        for (long i = 0; i < 8; i++) tail[i] = s + i < S ? scores[s + i] - top : -INFINITY;
        _mm256_storeu_ps(tail, exp_neg8(_mm256_loadu_ps(tail)));
        for (long i = 0; s + i < S; i++) scores[s + i] = tail[i];
    }
    double total = sink ? exp((double)*sink - top) : 0.0;
    for (s = 0; s < S; s++) total += scores[s];
    const __m256 inv = _mm256_set1_ps((float)(1.0 / total));
    /* Σ w_s V[s], at most 8 vectors of the row at a time (registers: 8 accumulators + V + w) */
    for (long c = 0; c < N8; c += 8) {
        const long n = N8 - c < 8 ? N8 - c : 8;
        __m256 acc[8];
        for (long i = 0; i < n; i++) acc[i] = _mm256_setzero_ps();
        for (s = 0; s < S; s++) {
            const float w = scores[s];
            if (w == 0.0f) continue; /* masked, or too small to count */
            const float *v = V + (size_t)s * D + 8 * c;
            const __m256 wv = _mm256_set1_ps(w);
            for (long i = 0; i < n; i++) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (long i = 0; i < n; i++) _mm256_storeu_ps(o + 8 * (c + i), _mm256_mul_ps(acc[i], inv));
    }
}

#define HEAD_N(N) \
    AVX2 static void head_avx2_##N(const float *q, const float *K, const float *V, const uint8_t *ok, long S, \
                                   float scale, const float *sink, float *scores, float *o) { \
        head_avx2_n(N, q, K, V, ok, S, scale, sink, scores, o); \
    }
HEAD_N(2)
HEAD_N(4)
HEAD_N(8)
HEAD_N(12)
HEAD_N(16)
HEAD_N(24)
HEAD_N(32)

typedef void (*head_fn)(const float *, const float *, const float *, const uint8_t *, long, float, const float *,
                        float *, float *);

/* The instance for a head width; NULL where there is none (the portable loop then). */
static head_fn head_avx2(long D) {
    switch (D) {
    case 16: return head_avx2_2;
    case 32: return head_avx2_4;
    case 64: return head_avx2_8;
    case 96: return head_avx2_12;
    case 128: return head_avx2_16;
    case 192: return head_avx2_24;
    case 256: return head_avx2_32;
    }
    return NULL;
}
#endif

static void attn_part(void *p, int ith, int nth) {
    const attn_job *j = p;
    const attn_args *a = j->a;
    const long D = a->D, S = a->start + a->T, group = a->nh / a->nkv;
    long items = (long)a->nh * a->T;
    long i0, i1;
    pool_span(items, ith, nth, &i0, &i1);
    float *scores = malloc(sizeof(float) * (size_t)(S + D)), *acc = scores + S;
    if (!scores) return;
#ifdef HAVE_AVX2_PATH
    head_fn fast = dot_simd() ? head_avx2(D) : NULL;
#endif
    for (long it = i0; it < i1; it++) {
        long h = it / a->T, t = it % a->T, g = h / group;
        const float *q = j->qr + (size_t)t * a->nh * D + (size_t)h * D;
        const float *K = a->kcache + (size_t)g * a->cap * D, *V = a->vcache + (size_t)g * a->cap * D;
        const uint8_t *ok = a->allowed + (size_t)t * S;
        const float *sink = a->sinks ? a->sinks + h : NULL;
        float *o = a->out + (size_t)t * a->nh * D + (size_t)h * D;
#ifdef HAVE_AVX2_PATH
        if (fast) {
            fast(q, K, V, ok, S, a->scale, sink, scores, o);
            continue;
        }
#endif
        head_portable(q, K, V, ok, S, D, a->scale, sink, scores, acc, o);
    }
    free(scores);
}

int op_attend(const attn_args *a) {
    const long D = a->D, T = a->T;
    /* rotate q (a copy) and k (in the cache), write k and v into the cache */
    float *qr = malloc(sizeof(float) * (size_t)T * a->nh * D + 1);
    if (!qr) return -2;
    for (long t = 0; t < T; t++) {
        const float *cos = a->cos + (size_t)t * (D / 2), *sin = a->sin + (size_t)t * (D / 2);
        for (long h = 0; h < a->nh; h++) {
            float *x = qr + (size_t)t * a->nh * D + (size_t)h * D;
            for (long d = 0; d < D; d++) x[d] = a->q[(size_t)t * a->nh * D + (size_t)h * D + d];
            if (a->rope) rope_row(x, cos, sin, D, a->interleave);
        }
        for (long g = 0; g < a->nkv; g++) {
            float *kc = a->kcache + ((size_t)g * a->cap + (size_t)(a->start + t)) * D;
            float *vc = a->vcache + ((size_t)g * a->cap + (size_t)(a->start + t)) * D;
            for (long d = 0; d < D; d++) {
                kc[d] = a->k[(size_t)t * a->nkv * D + (size_t)g * D + d];
                vc[d] = a->v[(size_t)t * a->nkv * D + (size_t)g * D + d];
            }
            if (a->rope) rope_row(kc, cos, sin, D, a->interleave);
        }
    }
    attn_job j = {qr, a};
    long work = (long)a->nh * T * (a->start + T) * D;
    if (work < POOL_MIN_WORK || pool_threads() <= 1)
        attn_part(&j, 0, 1);
    else
        pool_run(attn_part, &j, pool_chunks());
    free(qr);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* the whole attention block of a decode step: out = h + o(attention(q/k norms(qkv(RMSNorm(h)))))  */

int op_attn_block(const attn_block_args *b) {
    const long T = b->T, H = b->H, D = b->D, nq = b->nh * D, nk = b->nkv * D, N = nq + 2 * nk;
    float *x = malloc(sizeof(float) * (size_t)T * (size_t)(H + N + nq + 2 * nk + nq) + 1);
    if (!x) return -2;
    float *qkv = x + (size_t)T * H, *q = qkv + (size_t)T * N, *k = q + (size_t)T * nq, *v = k + (size_t)T * nk,
          *att = v + (size_t)T * nk;
    op_rms_norm(b->h, b->norm, T, H, b->eps, x);
    int rc = op_matmul(b->qkv_type, b->qkv, N, H, x, (int)T, qkv, b->qkv_bias);
    if (rc) goto done;
    for (long t = 0; t < T; t++) { /* split the joined product per token */
        const float *row = qkv + (size_t)t * N;
        memcpy(q + (size_t)t * nq, row, sizeof(float) * (size_t)nq);
        memcpy(k + (size_t)t * nk, row + nq, sizeof(float) * (size_t)nk);
        memcpy(v + (size_t)t * nk, row + nq + nk, sizeof(float) * (size_t)nk);
    }
    if (b->qk_norm == 1) { /* OLMoE: over the whole projection, before the head split */
        op_rms_norm(q, b->q_norm, T, nq, b->eps, q);
        op_rms_norm(k, b->k_norm, T, nk, b->eps, k);
    } else if (b->qk_norm == 2) { /* Qwen3: per head */
        op_rms_norm(q, b->q_norm, T * b->nh, D, b->eps, q);
        op_rms_norm(k, b->k_norm, T * b->nkv, D, b->eps, k);
    }
    attn_args a = b->attn;
    a.q = q;
    a.k = k;
    a.v = v;
    a.out = att;
    rc = op_attend(&a);
    if (rc) goto done;
    rc = op_matmul(b->o_type, b->o, H, nq, att, (int)T, b->out, b->o_bias);
    if (rc) goto done;
    for (long i = 0; i < T * H; i++) b->out[i] += b->h[i];
done:
    free(x);
    return rc;
}
