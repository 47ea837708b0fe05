// Fused decode kernels (issue 19): a decode token was ~630 small device ops; these put a layer's
// norms, projections, RoPE + KV write, attention and grouped experts into 7 launches (8 when a long
// context needs the attention merge).
// runtime/kernels/device.py checks every limit on the host and takes the op-by-op path beyond them.
//
// Products give each output one warp: its lanes take the row's 32-value units in turn, decode each
// unit into registers (quant.cuh: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, MXFP4, read as stored)
// once for every token of the pass, and a shuffle butterfly sums the lanes. A weight byte is read
// once per pass (1–16 tokens: decode and verification), never written decoded. Attention is
// split over chunks of the context (one thread each) and merged: long contexts spread out.
#pragma once

#include "quant.cuh"  // (S2_HD, the weight types and their decoders)

#define S2_MAX_HEAD_DIM 256
#define S2_MAX_TOKENS 16  // MAX_TOKENS in runtime/kernels/device.py

enum S2QkNorm { S2_QK_NONE = 0, S2_QK_FULL = 1, S2_QK_PER_HEAD = 2 };

#define S2_WARP 32
#ifdef __CUDACC__
// v[0..n) summed over the warp's 32 lanes (every lane gets the sums): a butterfly of shuffles.
// (n ≤ S2_MAX_TOKENS; unrolled to that bound so v stays in registers.)
__device__ inline void s2_warp_sum(float* v, int n) {
    S2_UNROLL for (int i = 0; i < S2_MAX_TOKENS; ++i)
        if (i < n)
            for (int off = S2_WARP / 2; off > 0; off >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
}
#else
void s2_warp_sum(float* v, int n);  // the CPU stand-in's (tests/fake_cupy.py): the same butterfly over its fibers
#endif

// sqrt(mean(x²) + eps) over x [K]: the RMSNorm denominator (x / denom · weight).
S2_HD inline float s2_rms_denom(const float* x, int K, float eps) {
    float ss = 0.f;
    for (int j = 0; j < K; ++j) ss += x[j] * x[j];
    return sqrtf(ss / K + eps);
}

// This lane's share of x [K] · the row at ``row`` (type, K values): units lane, lane + 32, …
// (the warp's lanes together cover the row; s2_warp_sum adds the shares).
S2_HD inline float s2_lane_dot(const float* x, const unsigned char* row, int type, long K, int lane) {
    float acc = 0.f, v[S2_UNIT];
    for (long u = lane; u * S2_UNIT < K; u += S2_WARP) {
        int n = s2_unit(row, type, K, u, v);
        const float* xu = x + u * S2_UNIT;
        S2_UNROLL for (int i = 0; i < S2_UNIT; ++i) acc += i < n ? xu[i] * v[i] : 0.f;
    }
    return acc;
}

// y [T, n0 + n1 + n2] = x [T, K] · [W0; W1; W2]ᵀ (+ bias per part) (+ residual [T, N]): up to three
// matrices of one width (q, k and v), each of its own type (t0, t1, t2: a Q4_K_M file mixes Q4_K
// and Q6_K), in one launch. Rows of block types are whole blocks; a float32 matrix may instead be
// strided (element (r, j) at r · rs + j · cs: an input-major router). With ``norm`` [K], x is
// RMSNorm-ed first (each warp sums the squares itself), and ``xn`` [T, K], when given, receives the
// normalised rows (the experts' input beside the router logits). One warp per column, for columns
// up to max(N, ⌈K / 32⌉ when xn is given), over all T ≤ S2_MAX_TOKENS tokens.
extern "C" __global__ void s2_linear(const float* x, int T, int K, const float* norm, float eps, float* xn, long rs,
                                     long cs, const void* w0, int t0, const float* b0, int n0, const void* w1, int t1,
                                     const float* b1, int n1, const void* w2, int t2, const float* b2, int n2,
                                     const float* residual, float* y) {
    long N = (long)n0 + n1 + n2, units = (K + S2_WARP - 1) / S2_WARP, M = (xn && units > N) ? units : N;
    long col = ((long)blockIdx.x * blockDim.x + threadIdx.x) / S2_WARP;  // whole warps stay or leave together
    int lane = threadIdx.x % S2_WARP;
    if (col >= M || T > S2_MAX_TOKENS) return;
    float denom[S2_MAX_TOKENS], acc[S2_MAX_TOKENS];  // (token loops: constant bounds, guarded: registers)
    S2_UNROLL for (int t = 0; t < S2_MAX_TOKENS; ++t) {
        acc[t] = 0.f;
        if (norm && t < T)
            for (int j = lane; j < K; j += S2_WARP) acc[t] += x[(long)t * K + j] * x[(long)t * K + j];
    }
    if (norm) s2_warp_sum(acc, T);
    S2_UNROLL for (int t = 0; t < S2_MAX_TOKENS; ++t) denom[t] = norm ? sqrtf(acc[t] / K + eps) : 1.f;
    long jn = col * S2_WARP + lane;
    if (xn && jn < K)
        S2_UNROLL for (int t = 0; t < S2_MAX_TOKENS; ++t)
            if (t < T) xn[(long)t * K + jn] = x[(long)t * K + jn] / denom[t] * norm[jn];
    if (col >= N) return;
    long r = col;
    const void* w = w0;
    const float* b = b0;
    int type = t0;
    if (r >= n0) {
        r -= n0, w = w1, b = b1, type = t1;
        if (r >= n1) r -= n1, w = w2, b = b2, type = t2;
    }
    S2_UNROLL for (int t = 0; t < S2_MAX_TOKENS; ++t) acc[t] = 0.f;
    if (cs == 1) {  // row-major: units decoded once, used by every token
        const unsigned char* row = (const unsigned char*)w + r * s2_row_bytes(type, rs);
        float v[S2_UNIT];
        for (long u = lane; u < units; u += S2_WARP) {
            int n = s2_unit(row, type, K, u, v);  // (past n: zeros, and x is not read there)
            S2_UNROLL for (int i = 0; i < S2_UNIT; ++i) v[i] *= (norm && i < n) ? norm[u * S2_UNIT + i] : 1.f;
            S2_UNROLL for (int t = 0; t < S2_MAX_TOKENS; ++t) {
                if (t >= T) continue;
                const float* xu = x + (long)t * K + u * S2_UNIT;
                float s = 0.f;
                S2_UNROLL for (int i = 0; i < S2_UNIT; ++i) s += i < n ? xu[i] * v[i] : 0.f;
                acc[t] += s;
            }
        }
    } else {  // a strided float32 matrix
        for (long j = lane; j < K; j += S2_WARP) {
            float wv = ((const float*)w)[r * rs + j * cs] * (norm ? norm[j] : 1.f);
            S2_UNROLL for (int t = 0; t < S2_MAX_TOKENS; ++t)
                if (t < T) acc[t] += x[(long)t * K + j] * wv;
        }
    }
    s2_warp_sum(acc, T);
    if (lane) return;
    S2_UNROLL for (int t = 0; t < S2_MAX_TOKENS; ++t) {
        if (t >= T) continue;
        float v = acc[t] / denom[t];
        if (b) v += b[r];
        if (residual) v = residual[(long)t * N + col] + v;
        y[(long)t * N + col] = v;
    }
}

// y [T, H] = x / sqrt(mean(x²) + eps) · w, one thread per row.
extern "C" __global__ void s2_rms_norm(const float* x, const float* w, int T, int H, float eps, float* y) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* row = x + (long)t * H;
    float denom = s2_rms_denom(row, H, eps);
    for (int j = 0; j < H; ++j) y[(long)t * H + j] = row[j] / denom * w[j];
}

// y [T, H] = rows ids [T] (int64) of the table W [V, H] (any weight type), decoded to float32.
extern "C" __global__ void s2_embed(const void* w, int type, const long long* ids, int T, int H, float* y) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)T * H) return;
    y[i] = s2_value((const unsigned char*)w + ids[i / H] * s2_row_bytes(type, H), type, H, i % H);
}

// Element i of a KV cache kept as float32 or (kv_half) IEEE half.
S2_HD inline float s2_kv_load(const void* kv, long i, int kv_half) {
    return kv_half ? s2_half_to_float(((const unsigned short*)kv)[i]) : ((const float*)kv)[i];
}

S2_HD inline void s2_kv_store(void* kv, long i, float v, int kv_half) {
    if (kv_half)
        ((unsigned short*)kv)[i] = s2_float_to_half(v);
    else
        ((float*)kv)[i] = v;
}

// From qkv [T, (nh + 2·nkv)·D] (s2_linear's q | k | v), one thread per (token, q or k head):
// the optional q/k RMSNorm (S2_QK_FULL: over the whole projection, each thread summing it itself;
// S2_QK_PER_HEAD: over its head), RoPE with cos/sin [T, D/2] (halves, or adjacent pairs with
// interleave), q into q_out [T, nh·D], k (and its head's v) into the cache [nkv, cap, D] at start + t
// (float32, or IEEE half with kv_half: rounded to nearest even, as the reference's f16 cache).
extern "C" __global__ void s2_qk_rope_kv(const float* qkv, int T, int nh, int nkv, int D, int norm_mode,
                                         const float* q_norm, const float* k_norm, float eps, const float* cos,
                                         const float* sin, int interleave, int start, int cap, float* q_out,
                                         void* keys, void* values, int kv_half) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int heads = nh + nkv;
    if (i >= T * heads || D > S2_MAX_HEAD_DIM) return;
    int t = i / heads, hd = i % heads;
    bool is_q = hd < nh;
    int kh = hd - nh;
    const float* row = qkv + (long)t * (nh + 2 * nkv) * D;
    const float* part = is_q ? row : row + (long)nh * D;  // the whole q (or k) projection
    const float* src = part + (long)(is_q ? hd : kh) * D;
    const float* nw = is_q ? q_norm : k_norm;
    float denom = 1.f;
    long woff = 0;
    if (norm_mode == S2_QK_FULL || norm_mode == S2_QK_PER_HEAD) {
        const float* span = norm_mode == S2_QK_FULL ? part : src;
        int n = norm_mode == S2_QK_FULL ? (is_q ? nh : nkv) * D : D;
        denom = s2_rms_denom(span, n, eps);
        woff = norm_mode == S2_QK_FULL ? (long)(is_q ? hd : kh) * D : 0;
    }
    float v[S2_MAX_HEAD_DIM];
    for (int j = 0; j < D; ++j) v[j] = norm_mode ? src[j] / denom * nw[woff + j] : src[j];
    void* dst = is_q ? (void*)(q_out + ((long)t * nh + hd) * D) : keys;
    long at = is_q ? 0 : ((long)kh * cap + start + t) * D;
    int half = is_q ? 0 : kv_half;
    const float* c = cos + (long)t * (D / 2);
    const float* s = sin + (long)t * (D / 2);
    for (int j = 0; j < D / 2; ++j) {
        int a = interleave ? 2 * j : j, b = interleave ? 2 * j + 1 : j + D / 2;
        s2_kv_store(dst, at + a, v[a] * c[j] - v[b] * s[j], half);
        s2_kv_store(dst, at + b, v[b] * c[j] + v[a] * s[j], half);
    }
    if (!is_q) {
        const float* vsrc = row + (long)(nh + nkv) * D + (long)kh * D;
        for (int j = 0; j < D; ++j) s2_kv_store(values, at + j, vsrc[j], kv_half);
    }
}

// Online softmax of q · K[s] · scale over the slots [s0, s1) that ``allow`` [S] marks, times V (the
// head's slots from element ``base`` of the cache, float32 or half):
// running max m, normaliser l and unnormalised sum acc [D] (m = -FLT_MAX, l = 0: no slot yet).
S2_HD inline void s2_attend_span(const float* qv, const void* keys, const void* values, long base,
                                 const unsigned char* allow, int s0, int s1, int D, int kv_half, float scale, float* m,
                                 float* l, float* acc) {
    for (int s = s0; s < s1; ++s) {
        if (!allow[s]) continue;
        long k = base + (long)s * D;
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot += qv[d] * s2_kv_load(keys, k + d, kv_half);
        float score = dot * scale;
        if (score > *m) {  // rescale what was summed under the old max
            float corr = expf(*m - score);
            *l *= corr;
            for (int d = 0; d < D; ++d) acc[d] *= corr;
            *m = score;
        }
        float p = expf(score - *m);
        *l += p;
        for (int d = 0; d < D; ++d) acc[d] += p * s2_kv_load(values, k + d, kv_half);
    }
}

// Grouped-query attention over the slots allowed [T, S] (bool) marks; q [T, nh·D], cache [nkv, cap,
// D] (float32, or half with kv_half), heads sharing a KV head in groups. One thread per (token,
// head, chunk of ``chunk`` slots): with one chunk it writes out [T, nh·D] itself, adding an
// optional sink logit per head [nh] to the normaliser; with more (long contexts) it writes (m, l,
// acc) to part [T·nh·C, D + 2] and s2_attend_merge finishes (chunks spread a long context over
// threads).
extern "C" __global__ void s2_attend(const float* q, const void* keys, const void* values,
                                     const unsigned char* allowed, int T, int S, int nh, int nkv, int D, int cap,
                                     int kv_half, float scale, int chunk, const float* sinks, float* out,
                                     float* part) {
    int C = (S + chunk - 1) / chunk;
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)T * nh * C || D > S2_MAX_HEAD_DIM) return;
    int c = (int)(i % C), th = (int)(i / C), t = th / nh, h = th % nh, kh = h / (nh / nkv);
    float acc[S2_MAX_HEAD_DIM];
    for (int d = 0; d < D; ++d) acc[d] = 0.f;
    float m = -3.402823466e38f, l = 0.f;
    int s1 = (c + 1) * chunk < S ? (c + 1) * chunk : S;
    s2_attend_span(q + (long)th * D, keys, values, (long)kh * cap * D, allowed + (long)t * S, c * chunk, s1, D,
                   kv_half, scale, &m, &l, acc);
    if (C > 1) {
        float* o = part + i * (D + 2);
        o[0] = m, o[1] = l;
        for (int d = 0; d < D; ++d) o[2 + d] = acc[d];
        return;
    }
    if (sinks && sinks[h] > m) {
        float corr = expf(m - sinks[h]);
        l *= corr;
        for (int d = 0; d < D; ++d) acc[d] *= corr;
        m = sinks[h];
    }
    if (sinks) l += expf(sinks[h] - m);
    for (int d = 0; d < D; ++d) out[(long)th * D + d] = acc[d] / l;
}

// The C chunks' (m, l, acc) of s2_attend → out [T, nh·D], one thread per (token, head); the sink
// logit (optional, per head) joins the normaliser. Chunks with no allowed slot add nothing.
extern "C" __global__ void s2_attend_merge(const float* part, int T, int nh, int D, int C, const float* sinks,
                                           float* out) {
    int th = blockIdx.x * blockDim.x + threadIdx.x;
    if (th >= T * nh) return;
    const float* p = part + (long)th * C * (D + 2);
    float m = sinks ? sinks[th % nh] : -3.402823466e38f;
    for (int c = 0; c < C; ++c)
        if (p[(long)c * (D + 2) + 1] > 0.f && p[(long)c * (D + 2)] > m) m = p[(long)c * (D + 2)];
    float l = sinks ? expf(sinks[th % nh] - m) : 0.f;
    for (int c = 0; c < C; ++c) {
        const float* pc = p + (long)c * (D + 2);
        if (pc[1] > 0.f) l += pc[1] * expf(pc[0] - m);
    }
    float* o = out + (long)th * D;
    for (int d = 0; d < D; ++d) {
        float sum = 0.f;
        for (int c = 0; c < C; ++c) {
            const float* pc = p + (long)c * (D + 2);
            if (pc[1] > 0.f) sum += pc[2 + d] * expf(pc[0] - m);
        }
        o[d] = sum / l;
    }
}

// Grouped experts. ``table`` (int64, one upload per group of experts) holds, for P (token, expert)
// pairs sorted by token: [3P] device addresses of the pair's gate [I, H], up [I, H] and down [H, I]
// weights, [P] the pair's token, [P] its mixture weight (float64 bits), [P] the three matrices'
// types (gate | up << 8 | down << 16), [3P] addresses of their float32 biases (0: none), [T + 1]
// each token's first pair.
enum S2ExpertAct { S2_ACT_SWIGLU = 0, S2_ACT_SWIGLU_CLAMPED = 1 };  // ACTS in runtime/kernels/device.py

// hidden [P, I] = act(x[t] · gate + bg, x[t] · up + bu), one warp per (pair, row): SwiGLU, or
// GPT-OSS's clamped variant (gate ≤ limit, |up| ≤ limit, (up + 1) · gate · σ(alpha · gate)).
extern "C" __global__ void s2_experts_gate_up(const float* x, int H, int I, int P, const long long* table, int act,
                                              float alpha, float limit, float* hidden) {
    long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / S2_WARP;
    int lane = threadIdx.x % S2_WARP;
    if (warp >= (long)P * I) return;
    long p = warp / I, r = warp % I;
    const float* xt = x + table[3L * P + p] * H;
    int types = (int)table[5L * P + p], tg = types & 0xff, tu = (types >> 8) & 0xff;
    float gu[2] = {s2_lane_dot(xt, (const unsigned char*)table[3 * p] + r * s2_row_bytes(tg, H), tg, H, lane),
                   s2_lane_dot(xt, (const unsigned char*)table[3 * p + 1] + r * s2_row_bytes(tu, H), tu, H, lane)};
    s2_warp_sum(gu, 2);
    if (lane) return;
    const float* bg = (const float*)table[6L * P + 3 * p];
    const float* bu = (const float*)table[6L * P + 3 * p + 1];
    float g = gu[0] + (bg ? bg[r] : 0.f), u = gu[1] + (bu ? bu[r] : 0.f);
    if (act == S2_ACT_SWIGLU_CLAMPED) {
        g = g < limit ? g : limit;
        u = u < -limit ? -limit : (u > limit ? limit : u);
        hidden[warp] = (u + 1.f) * g / (1.f + expf(-alpha * g));
    } else {
        hidden[warp] = g / (1.f + expf(-g)) * u;
    }
}

// out [T, H] = base + Σ over the token's pairs of weight · (hidden[p] · down + bd), one warp per
// output, pairs in table order (one scatter-add per group, no atomics: the sum is deterministic).
// base may be out itself (a later group of the same layer).
extern "C" __global__ void s2_experts_down(const float* hidden, int H, int I, int T, int P, const long long* table,
                                           const float* base, float* out) {
    long warp = ((long)blockIdx.x * blockDim.x + threadIdx.x) / S2_WARP;
    int lane = threadIdx.x % S2_WARP;
    if (warp >= (long)T * H) return;
    long t = warp / H, j = warp % H;
    const double* mix = (const double*)(table + 4L * P);
    const long long* first = table + 9L * P;
    float sum = 0.f;
    for (long long p = first[t]; p < first[t + 1]; ++p) {
        int td = (int)(table[5L * P + p] >> 16) & 0xff;
        const unsigned char* row = (const unsigned char*)table[3 * p + 2] + j * s2_row_bytes(td, I);
        const float* bd = (const float*)table[6L * P + 3 * p + 2];
        // the bias once per pair, on lane 0's share: the warp sum adds it once
        sum += (float)mix[p] * (s2_lane_dot(hidden + p * I, row, td, I, lane) + (bd && lane == 0 ? bd[j] : 0.f));
    }
    s2_warp_sum(&sum, 1);
    if (lane == 0) out[warp] = base[warp] + sum;
}
