// CUDA kernels loaded with cupy.RawModule (name_expressions not needed: extern "C").
// The math lives in routing.cuh (__host__ __device__) so the host build tests it on the CPU.
// runtime/kernels/cuda.py inlines the quoted includes into the source it hands CuPy: CuPy's
// kernel cache is keyed on the source string, so a header edit must change that string.
#include "routing.cuh"
#include "decode.cuh"  // the fused decode kernels (norms, projections, attention, grouped experts)

// One thread per token (any B: as many blocks as needed): router top-k and mixture weights,
// optional selection bias [B, E] (float32, C-contiguous: checked by the caller).
extern "C" __global__ void s2_router_topk(const float* logits, const float* bias, int B, int E, int k, int kind,
                                          int renorm, int* ids, float* weights) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    s2_route_row(logits + (long)b * E, bias ? bias + (long)b * E : nullptr, E, k, kind, renorm,
                 ids + (long)b * k, weights + (long)b * k);
}

// Fused reuse-aware gating for one layer's batch, any size B: one block; thread 0 plans E* and λ
// (per-token scratch `w` [B] and `lambda` [B] in global memory, so B has no limit), then the block's
// threads select token after token with the bias, weights from the unbiased scores. The host side
// (runtime/kernels/cuda.py) sends E > S2_MAX_EXPERTS or k > S2_MAX_TOPK to the NumPy path; should
// such a launch arrive anyway, every id is -1 rather than a silently unbiased choice.
extern "C" __global__ void s2_reuse_gating(const float* logits, const float* confidence, int B, int E, int k,
                                           int cap, int variant, float strength, int kind, int renorm, double* w,
                                           float* lambda, int* ids, float* weights) {
    __shared__ double g[S2_MAX_EXPERTS];
    __shared__ int preferred[S2_MAX_EXPERTS];
    __shared__ int n_pref;
    if (threadIdx.x == 0)
        n_pref = (E <= S2_MAX_EXPERTS && k <= S2_MAX_TOPK)
                     ? s2_rg_plan(logits, confidence, B, E, k, cap, variant, strength, w, g, preferred, lambda)
                     : -1;
    __syncthreads();
    float bias[S2_MAX_EXPERTS];
    for (int b = threadIdx.x; b < B; b += blockDim.x) {
        if (n_pref < 0) {
            for (int j = 0; j < k; ++j) { ids[(long)b * k + j] = -1; weights[(long)b * k + j] = 0.f; }
            continue;
        }
        if (n_pref > 0) s2_rg_bias_row(preferred, n_pref, lambda[b], E, bias);
        s2_route_row(logits + (long)b * E, n_pref > 0 ? bias : nullptr, E, k, kind, renorm, ids + (long)b * k,
                     weights + (long)b * k);
    }
}
