// Fused multi-tensor Adam/AdamW: one launch for every tensor of a parameter group (as torch's fused AdamW and
// apex/DeepSpeed's multi_tensor_adam), each CUDA block taking one chunk of one tensor. Same arithmetic as the CPU
// op and torch.optim.AdamW: lerp for exp_avg, mul+addcmul for exp_avg_sq, sqrt(v)/sqrt(bc2)+eps, addcdiv.
// Chunks whose four tensors start 16-byte aligned move float4s (4 elements per load), the rest one float at a time.
#include "kernels.h"

namespace zero_kernels {
namespace {

__device__ inline void adam_one(float& p, float g, float& m, float& v, const CudaAdamArgs& a) {
  float grad = g * a.grad_scale;
  if (a.adamw) {
    p = p * a.decay;
  } else {
    grad = grad + a.weight_decay * p;
  }
  m = fmaf(a.one_minus_beta1, grad - m, m);
  v = fmaf(a.one_minus_beta2 * grad, grad, v * a.beta2);
  const float denom = __fdiv_rn(sqrtf(v), a.bias_correction2_sqrt) + a.eps;
  p = p + -a.step_size * __fdiv_rn(m, denom);  // addcdiv's order: value * (exp_avg / denom)
}

__device__ inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

__global__ void multi_tensor_adam_kernel(const int64_t* __restrict__ table, int num_tensors, int num_chunks,
                                         int64_t chunk_size, CudaAdamArgs a) {
  const int chunk = blockIdx.x;
  if (chunk >= num_chunks) return;
  const int64_t* numels = table + 4 * num_tensors;
  const int t = static_cast<int>(table[5 * num_tensors + chunk]);
  const int64_t start = table[5 * num_tensors + num_chunks + chunk];
  const int64_t n = min(chunk_size, numels[t] - start);
  float* p = reinterpret_cast<float*>(table[t]) + start;
  const float* g = reinterpret_cast<const float*>(table[num_tensors + t]) + start;
  float* m = reinterpret_cast<float*>(table[2 * num_tensors + t]) + start;
  float* v = reinterpret_cast<float*>(table[3 * num_tensors + t]) + start;
  int64_t done = 0;
  if (aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v)) {
    const int64_t n4 = n / 4;
    for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
      float4 P = reinterpret_cast<float4*>(p)[i];
      const float4 G = reinterpret_cast<const float4*>(g)[i];
      float4 M = reinterpret_cast<float4*>(m)[i];
      float4 V = reinterpret_cast<float4*>(v)[i];
      adam_one(P.x, G.x, M.x, V.x, a);
      adam_one(P.y, G.y, M.y, V.y, a);
      adam_one(P.z, G.z, M.z, V.z, a);
      adam_one(P.w, G.w, M.w, V.w, a);
      reinterpret_cast<float4*>(p)[i] = P;
      reinterpret_cast<float4*>(m)[i] = M;
      reinterpret_cast<float4*>(v)[i] = V;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    float P = p[i], M = m[i], V = v[i];
    adam_one(P, g[i], M, V, a);
    p[i] = P;
    m[i] = M;
    v[i] = V;
  }
}

}  // namespace

cudaError_t launch_multi_tensor_adam(const int64_t* table, int num_tensors, int num_chunks, int64_t chunk_size,
                                     const CudaAdamArgs& args, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  multi_tensor_adam_kernel<<<num_chunks, 256, 0, stream>>>(table, num_tensors, num_chunks, chunk_size, args);
  return cudaGetLastError();
}

}  // namespace zero_kernels
