// CUDA kernels loaded with cupy.RawModule (name_expressions not needed: extern "C").
// The math lives in routing.cuh (__host__ __device__) so the host build tests it on the CPU.
#include "routing.cuh"

// One thread per token: router top-k and mixture weights, optional selection bias [B, E].
extern "C" __global__ void s2_router_topk(const float* logits, const float* bias, int B, int E, int k, int kind,
                                          int renorm, int* ids, float* weights) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    s2_route_row(logits + (long)b * E, bias ? bias + (long)b * E : nullptr, E, k, kind, renorm,
                 ids + (long)b * k, weights + (long)b * k);
}

// Fused reuse-aware gating for one layer's verification batch (B ≤ blockDim.x, one block):
// thread 0 plans E* and λ in shared memory; then every token selects with the bias and weights
// from the unbiased scores. B is a verification batch (≤ draft cap + 1), so one block suffices.
extern "C" __global__ void s2_reuse_gating(const float* logits, const float* confidence, int B, int E, int k,
                                           int cap, int variant, float strength, int kind, int renorm, int* ids,
                                           float* weights) {
    __shared__ double w[S2_MAX_TOPK];
    __shared__ double g[S2_MAX_EXPERTS];
    __shared__ int preferred[S2_MAX_EXPERTS];
    __shared__ float lambda[S2_MAX_TOPK];
    __shared__ int n_pref;
    if (threadIdx.x == 0)
        n_pref = (B <= S2_MAX_TOPK && E <= S2_MAX_EXPERTS)
                     ? s2_rg_plan(logits, confidence, B, E, k, cap, variant, strength, w, g, preferred, lambda)
                     : 0;
    __syncthreads();
    int b = threadIdx.x;
    if (b >= B) return;
    float bias[S2_MAX_EXPERTS];
    if (n_pref > 0) s2_rg_bias_row(preferred, n_pref, lambda[b], E, bias);
    s2_route_row(logits + (long)b * E, n_pref > 0 ? bias : nullptr, E, k, kind, renorm, ids + (long)b * k,
                 weights + (long)b * k);
}
