// Host build of the kernel math for tests (g++ -O2 -shared -fPIC): the same functions the CUDA
// kernels run, called over host arrays, so CI without a GPU checks them against NumPy.
#include <vector>

#include "quant.cuh"
#include "routing.cuh"

extern "C" {

void s2_host_route(const float* logits, const float* bias, int B, int E, int k, int kind, int renorm, int* ids,
                   float* weights) {
    for (int b = 0; b < B; ++b)
        s2_route_row(logits + (long)b * E, bias ? bias + (long)b * E : nullptr, E, k, kind, renorm,
                     ids + (long)b * k, weights + (long)b * k);
}

// Returns the size of E* (0 = no-op) and fills ids/weights as the fused kernel would.
int s2_host_reuse_gating(const float* logits, const float* confidence, int B, int E, int k, int cap, int variant,
                         float strength, int kind, int renorm, int* ids, float* weights) {
    std::vector<double> w(B);
    std::vector<double> g(E);
    std::vector<float> lambda(B), bias(E);
    std::vector<int> preferred(E);
    int n_pref = s2_rg_plan(logits, confidence, B, E, k, cap, variant, strength, w.data(), g.data(),
                            preferred.data(), lambda.data());
    for (int b = 0; b < B; ++b) {
        if (n_pref > 0) s2_rg_bias_row(preferred.data(), n_pref, lambda[b], E, bias.data());
        s2_route_row(logits + (long)b * E, n_pref > 0 ? bias.data() : nullptr, E, k, kind, renorm,
                     ids + (long)b * k, weights + (long)b * k);
    }
    return n_pref;
}

// out [N, K] = the rows of a stored matrix, decoded unit by unit as the device kernels decode them.
void s2_host_dequant(const unsigned char* w, int type, long N, long K, float* out) {
    for (long r = 0; r < N; ++r)
        for (long u = 0; u * S2_UNIT < K; ++u) s2_unit(w + r * s2_row_bytes(type, K), type, K, u, out + r * K + u * S2_UNIT);
}

void s2_host_to_half(const float* x, long n, unsigned short* out) {
    for (long i = 0; i < n; ++i) out[i] = s2_float_to_half(x[i]);
}
}
