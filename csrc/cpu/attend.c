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

/* A cache row of D values written from float32 (RoPE already applied), rounded to the cache's type
 * as model/kv_cache.py `KVCache.encode` rounds it, bit for bit (q8_0: ggml's reference quantiser). */
static void kv_store_row(int kind, const float *x, long D, uint8_t *dst) {
    if (kind == KV_F32) {
        memcpy(dst, x, sizeof(float) * (size_t)D);
    } else if (kind == KV_F16) {
        for (long i = 0; i < D; i++) {
            uint16_t h = f32_to_f16(x[i]);
            memcpy(dst + 2 * i, &h, 2);
        }
    } else {
        for (long b = 0; b < D / 32; b++, dst += 34) {
            const float *v = x + 32 * b;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
            uint16_t h = f32_to_f16(d);
            memcpy(dst, &h, 2);
            for (int i = 0; i < 32; i++) dst[2 + i] = (uint8_t)(int8_t)roundf(v[i] * inv);
        }
    }
}

/* A cache row as float32: the row itself for f32, else decoded into tmp. */
static const float *kv_load_row(int kind, const uint8_t *src, long D, float *tmp) {
    if (kind == KV_F32) return (const float *)src;
    if (kind == KV_F16) {
        for (long i = 0; i < D; i++) tmp[i] = f16_to_f32(rd16(src + 2 * i));
    } else {
        for (long b = 0; b < D / 32; b++, src += 34) {
            const float d = f16_to_f32(rd16(src));
            for (int i = 0; i < 32; i++) tmp[32 * b + i] = d * (float)(int8_t)src[2 + i];
        }
    }
    return tmp;
}

/* One head of one token, portable: o = Σ_s softmax(scale · q·K[s])_s V[s] over allowed slots. */
static void head_portable(int kind, const float *q, const uint8_t *K, const uint8_t *V, const uint8_t *ok, long S,
                          long D, float scale, const float *sink, float *scores, float *acc, float *row, float *o) {
    const size_t rb = (size_t)kv_row_bytes(kind, D);
    float top = -INFINITY;
    for (long s = 0; s < S; s++) {
        if (!ok[s]) continue;
        const float *k = kv_load_row(kind, K + (size_t)s * rb, D, row);
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
        const float w = expf(scores[s] - top), *v = kv_load_row(kind, V + (size_t)s * rb, D, row);
        total += w;
        for (long d = 0; d < D; d++) acc[d] += w * v[d];
    }
    const float inv = (float)(1.0 / total);
    for (long d = 0; d < D; d++) o[d] = acc[d] * inv;
}

#ifdef HAVE_AVX2_PATH
/* Values 8i..8i+7 of a cache row as float32: a load, a conversion of halves, or q8_0's int8 times
 * its block's scale (exact in float32: an 11-bit scale times an 8-bit integer). */
INLINE_AVX2 __m256 kv_load8(const int kind, const uint8_t *row, long i) {
    if (kind == KV_F32) return _mm256_loadu_ps((const float *)row + 8 * i);
    if (kind == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 16 * i)));
    const uint8_t *blk = row + 34 * (i >> 2);
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * (i & 3))));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(_cvtsh_ss(rd16(blk))));
}

/* One head of one token (see head_portable). N8 = D / 8 and the cache type are compile-time
 * constants in each instance, so the loops unroll and the accumulators live in registers: with a
 * run-time width the compiler kept them in memory, and each slot waited on a store and a reload
 * (2.3x slower). */
INLINE_AVX2 void head_avx2_n(
    const long N8, const int kind, const float *q, const uint8_t *K, const uint8_t *V, const uint8_t *ok, long S,
    float scale, const float *sink, float *scores, float *o) {
    const long D = 8 * N8;
    const size_t rb = (size_t)kv_row_bytes(kind, D);
    __m256 qv[N8];
    for (long i = 0; i < N8; i++) qv[i] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * i), _mm256_set1_ps(scale));
    /* scores, 8 slots at a time: eight independent dot products, then one transposing reduction */
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    long s0 = 0;
    for (; s0 + 8 <= S; s0 += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) {
            const uint8_t *k = K + (size_t)(s0 + j) * rb;
            a[j] = _mm256_mul_ps(qv[0], kv_load8(kind, k, 0));
            for (long i = 1; i < N8; i++) a[j] = _mm256_fmadd_ps(qv[i], kv_load8(kind, k, i), a[j]);
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
        const uint8_t *k = K + (size_t)s * rb;
        __m256 a = _mm256_mul_ps(qv[0], kv_load8(kind, k, 0));
        for (long i = 1; i < N8; i++) a = _mm256_fmadd_ps(qv[i], kv_load8(kind, k, i), a);
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
            const uint8_t *v = V + (size_t)s * rb;
            const __m256 wv = _mm256_set1_ps(w);
            for (long i = 0; i < n; i++) acc[i] = _mm256_fmadd_ps(wv, kv_load8(kind, v, c + i), acc[i]);
        }
        for (long i = 0; i < n; i++) _mm256_storeu_ps(o + 8 * (c + i), _mm256_mul_ps(acc[i], inv));
    }
}

#define HEAD_N(N, KIND, SUF) \
    AVX2 static void head_avx2_##N##SUF(const float *q, const uint8_t *K, const uint8_t *V, const uint8_t *ok, \
                                        long S, float scale, const float *sink, float *scores, float *o) { \
        head_avx2_n(N, KIND, q, K, V, ok, S, scale, sink, scores, o); \
    }
#define HEADS(N) HEAD_N(N, KV_F32, _f32) HEAD_N(N, KV_F16, _f16) HEAD_N(N, KV_Q8_0, _q8)
HEADS(2)
HEADS(4)
HEADS(8)
HEADS(12)
HEADS(16)
HEADS(24)
HEADS(32)

typedef void (*head_fn)(const float *, const uint8_t *, const uint8_t *, const uint8_t *, long, float, const float *,
                        float *, float *);

/* The instance for a head width and cache type; NULL where there is none (the portable loop then). */
static head_fn head_avx2(long D, int kind) {
#define ROW(N) {head_avx2_##N##_f32, head_avx2_##N##_f16, head_avx2_##N##_q8}
    static const head_fn table[7][3] = {ROW(2), ROW(4), ROW(8), ROW(12), ROW(16), ROW(24), ROW(32)};
#undef ROW
    static const long widths[7] = {16, 32, 64, 96, 128, 192, 256};
    if (kind == KV_Q8_0 && D % 32) return NULL;
    for (int i = 0; i < 7; i++)
        if (widths[i] == D) return table[i][kind];
    return NULL;
}
#endif

static void attn_part(void *p, int ith, int nth) {
    const attn_job *j = p;
    const attn_args *a = j->a;
    const long D = a->D, S = a->start + a->T, group = a->nh / a->nkv;
    const size_t plane = (size_t)a->cap * (size_t)kv_row_bytes(a->kv_type, D); /* one kv head's rows */
    long items = (long)a->nh * a->T;
    long i0, i1;
    pool_span(items, ith, nth, &i0, &i1);
    float *scores = malloc(sizeof(float) * (size_t)(S + 2 * D)), *acc = scores + S, *row = acc + D;
    if (!scores) return;
#ifdef HAVE_AVX2_PATH
    head_fn fast = dot_simd() ? head_avx2(D, a->kv_type) : NULL;
#endif
    for (long it = i0; it < i1; it++) {
        long h = it / a->T, t = it % a->T, g = h / group;
        const float *q = j->qr + (size_t)t * a->nh * D + (size_t)h * D;
        const uint8_t *K = a->kcache + (size_t)g * plane, *V = a->vcache + (size_t)g * plane;
        const uint8_t *ok = a->allowed + (size_t)t * S;
        const float *sink = a->sinks ? a->sinks + h : NULL;
        float *o = a->out + (size_t)t * a->nh * D + (size_t)h * D;
#ifdef HAVE_AVX2_PATH
        if (fast) {
            fast(q, K, V, ok, S, a->scale, sink, scores, o);
            continue;
        }
#endif
        head_portable(a->kv_type, q, K, V, ok, S, D, a->scale, sink, scores, acc, row, o);
    }
    free(scores);
}

int op_attend(const attn_args *a) {
    const long D = a->D, T = a->T;
    /* rotate q (a copy) and k, write k and v into the cache in its type */
    const size_t rb = (size_t)kv_row_bytes(a->kv_type, D);
    float *qr = arena_get(ARENA_ATTEND, sizeof(float) * ((size_t)T * a->nh * D + (size_t)D) + 1);
    if (!qr) return -2;
    float *kr = qr + (size_t)T * a->nh * D;
    for (long t = 0; t < T; t++) {
        const float *cos = a->cos + (size_t)t * (D / 2), *sin = a->sin + (size_t)t * (D / 2);
        for (long h = 0; h < a->nh; h++) {
            float *x = qr + (size_t)t * a->nh * D + (size_t)h * D;
            for (long d = 0; d < D; d++) x[d] = a->q[(size_t)t * a->nh * D + (size_t)h * D + d];
            if (a->rope) rope_row(x, cos, sin, D, a->interleave);
        }
        for (long g = 0; g < a->nkv; g++) {
            const size_t at = ((size_t)g * a->cap + (size_t)(a->start + t)) * rb;
            memcpy(kr, a->k + (size_t)t * a->nkv * D + (size_t)g * D, sizeof(float) * (size_t)D);
            if (a->rope) rope_row(kr, cos, sin, D, a->interleave);
            kv_store_row(a->kv_type, kr, D, a->kcache + at);
            kv_store_row(a->kv_type, a->v + (size_t)t * a->nkv * D + (size_t)g * D, D, a->vcache + at);
        }
    }
    attn_job j = {qr, a};
    long work = (long)a->nh * T * (a->start + T) * D;
    if (work < POOL_MIN_WORK || pool_threads() <= 1)
        attn_part(&j, 0, 1);
    else
        pool_run(attn_part, &j, pool_chunks());
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* the whole attention block of a decode step: out = h + o(attention(q/k norms(qkv(RMSNorm(h)))))  */

int op_attn_block(const attn_block_args *b) {
    const long T = b->T, H = b->H, D = b->D, nq = b->nh * D, nk = b->nkv * D, N = nq + 2 * nk;
    float *x = arena_get(ARENA_BLOCK, sizeof(float) * (size_t)T * (size_t)(H + N + nq + 2 * nk + nq) + 1);
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
    return rc;
}
