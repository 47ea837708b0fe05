// Router top-k and reuse-aware gating math, shared by the CUDA kernels (kernels.cu) and the
// host-compiled test library (host_api.cpp). Mirrors runtime/routing.py and runtime/gating.py:
// top-k is highest first with ties to the lower expert id; mixture weights always come from the
// unbiased router scores, the reuse bias only changes which experts are selected.
#pragma once

#ifdef __CUDACC__
#define S2_HD __host__ __device__
#else
#define S2_HD
#include <cmath>
#endif

#define S2_MAX_EXPERTS 512
#define S2_MAX_TOPK 64

enum S2RouterKind { S2_SOFTMAX_TOPK = 0, S2_TOPK_SOFTMAX = 1 };
enum S2GatingVariant { S2_RG_PAPER = 0, S2_RG_CODE = 1 };

// Indices of the k largest of x (+ bias if given), highest first, ties to the lower index.
// O(E·k) selection: E ≤ 512 and k ≤ 64 in every MoE we target, and it needs no scratch memory.
template <typename T>
S2_HD inline void s2_topk(const T* x, const T* bias, int E, int k, int* out) {
    for (int j = 0; j < k; ++j) {
        int best = -1;
        T best_v = 0;
        for (int e = 0; e < E; ++e) {
            bool taken = false;
            for (int i = 0; i < j; ++i) taken |= (out[i] == e);
            if (taken) continue;
            T v = bias ? x[e] + bias[e] : x[e];
            if (best < 0 || v > best_v) { best = e; best_v = v; }  // strict '>': ties keep the lower id
        }
        out[j] = best;
    }
}

// Route one token: choose k experts (on logits + optional selection bias) and their weights.
S2_HD inline void s2_route_row(const float* logits, const float* bias, int E, int k, int kind, int renorm,
                               int* ids, float* weights) {
    s2_topk<float>(logits, bias, E, k, ids);
    if (kind == S2_TOPK_SOFTMAX) {  // softmax over the chosen logits (Mixtral, GPT-OSS)
        float m = logits[ids[0]];
        for (int j = 1; j < k; ++j) m = fmaxf(m, logits[ids[j]]);
        float s = 0.f;
        for (int j = 0; j < k; ++j) { weights[j] = expf(logits[ids[j]] - m); s += weights[j]; }
        for (int j = 0; j < k; ++j) weights[j] /= s;
        return;
    }
    float m = logits[0];
    for (int e = 1; e < E; ++e) m = fmaxf(m, logits[e]);
    float s = 0.f;
    for (int e = 0; e < E; ++e) s += expf(logits[e] - m);
    float picked = 0.f;
    for (int j = 0; j < k; ++j) { weights[j] = expf(logits[ids[j]] - m) / s; picked += weights[j]; }
    if (renorm)
        for (int j = 0; j < k; ++j) weights[j] /= picked;
}

// Token weights w_b for reuse-aware gating. Paper: the draft confidence; code: router peakedness
// (max - mean of the logits) scaled by 1 / max_b w_b.
S2_HD inline void s2_rg_token_weights(const float* logits, const float* confidence, int B, int E, int variant,
                                      double* w) {
    if (variant == S2_RG_PAPER && confidence) {
        for (int b = 0; b < B; ++b) w[b] = confidence[b];
        return;
    }
    double top = 0.0;
    for (int b = 0; b < B; ++b) {
        const float* row = logits + (long)b * E;
        float mx = row[0];
        double sum = 0.0;
        for (int e = 0; e < E; ++e) { mx = fmaxf(mx, row[e]); sum += row[e]; }
        w[b] = (double)mx - sum / E;
        if (b == 0 || w[b] > top) top = w[b];
    }
    for (int b = 0; b < B; ++b) w[b] = top > 0 ? w[b] / top : 0.0;
}

// Gap between a token's top-1 and (k+1)-th logit: how far the bias may move its choice.
S2_HD inline float s2_rg_gap(const float* row, int E, int k) {
    int ids[S2_MAX_TOPK + 1];
    s2_topk<float>(row, nullptr, E, k + 1, ids);
    return row[ids[0]] - row[ids[k]];
}

// Preferred set E* and per-token λ for one layer's verification batch. Returns 0 when gating is a
// no-op (B ≤ 1, cap ≤ 0, strength ≤ 0, k ≥ E, all w_b = 0 or all λ_b ≤ 0), else the size of E*.
S2_HD inline int s2_rg_plan(const float* logits, const float* confidence, int B, int E, int k, int cap,
                            int variant, float strength, double* w, double* g, int* preferred, float* lambda) {
    if (B <= 1 || cap <= 0 || strength <= 0.f || k >= E) return 0;
    s2_rg_token_weights(logits, confidence, B, E, variant, w);
    bool any = false;
    for (int b = 0; b < B; ++b) any |= w[b] > 0;
    if (!any) return 0;
    for (int e = 0; e < E; ++e) {
        double acc = 0.0;
        for (int b = 0; b < B; ++b) acc += w[b] * logits[(long)b * E + e];
        g[e] = acc;  // double, as NumPy accumulates float64 weights × float32 logits
    }
    int n_pref = cap > k ? cap : k;
    if (n_pref > E) n_pref = E;
    s2_topk<double>(g, nullptr, E, n_pref, preferred);
    double mean = 0.0;
    for (int b = 0; b < B; ++b) { lambda[b] = strength * s2_rg_gap(logits + (long)b * E, E, k); mean += lambda[b]; }
    if (variant == S2_RG_CODE)
        for (int b = 0; b < B; ++b) lambda[b] = (float)(mean / B);
    bool positive = false;
    for (int b = 0; b < B; ++b) positive |= lambda[b] > 0;
    return positive ? n_pref : 0;
}

// Bias row for token b: λ_b on the preferred experts, 0 elsewhere.
S2_HD inline void s2_rg_bias_row(const int* preferred, int n_pref, float lambda_b, int E, float* bias) {
    for (int e = 0; e < E; ++e) bias[e] = 0.f;
    for (int i = 0; i < n_pref; ++i) bias[preferred[i]] = lambda_b;
}
