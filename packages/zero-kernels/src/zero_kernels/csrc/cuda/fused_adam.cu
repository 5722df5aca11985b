// Fused multi-tensor Adam/AdamW: one launch for every tensor of a parameter group (as torch's fused AdamW and
// apex/DeepSpeed's multi_tensor_adam), each CUDA block taking one chunk of one tensor. Same arithmetic as the CPU
// op and torch.optim.AdamW: lerp for exp_avg, mul+addcmul for exp_avg_sq, sqrt(v)/sqrt(bc2)+eps, addcdiv.
#include "kernels.h"

namespace zero_kernels {
namespace {

__global__ void multi_tensor_adam_kernel(const int64_t* __restrict__ table, int num_tensors, int num_chunks,
                                         int64_t chunk_size, CudaAdamArgs a) {
  const int chunk = blockIdx.x;
  if (chunk >= num_chunks) return;
  const int64_t* numels = table + 4 * num_tensors;
  const int t = static_cast<int>(table[5 * num_tensors + chunk]);
  const int64_t start = table[5 * num_tensors + num_chunks + chunk];
  float* p = reinterpret_cast<float*>(table[t]);
  const float* g = reinterpret_cast<const float*>(table[num_tensors + t]);
  float* m = reinterpret_cast<float*>(table[2 * num_tensors + t]);
  float* v = reinterpret_cast<float*>(table[3 * num_tensors + t]);
  const int64_t end = min(start + chunk_size, numels[t]);
  for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    float grad = g[i] * a.grad_scale;
    float param = p[i];
    if (a.adamw) {
      param = param * a.decay;
    } else {
      grad = grad + a.weight_decay * param;
    }
    const float mi = fmaf(a.one_minus_beta1, grad - m[i], m[i]);
    const float vi = fmaf(a.one_minus_beta2 * grad, grad, v[i] * a.beta2);
    const float denom = __fdiv_rn(sqrtf(vi), a.bias_correction2_sqrt) + a.eps;
    param = param + __fdiv_rn(-a.step_size * mi, denom);
    m[i] = mi;
    v[i] = vi;
    p[i] = param;
  }
}

}  // namespace

cudaError_t launch_multi_tensor_adam(const int64_t* table, int num_tensors, int num_chunks, int64_t chunk_size,
                                     const CudaAdamArgs& args, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  multi_tensor_adam_kernel<<<num_chunks, 512, 0, stream>>>(table, num_tensors, num_chunks, chunk_size, args);
  return cudaGetLastError();
}

}  // namespace zero_kernels
