// Blockwise symmetric int8/int4 quantize/dequantize in zero_comm's layout (see kernels.h), for ZeRO++'s qwZ/qgZ.
// One CUDA block per quantization block: a block-wide absmax reduction, then each thread quantizes its elements.
// Division and rounding are IEEE (rint = round half to even, as torch.round), so results equal the torch reference.
#include "kernels.h"

namespace zero_kernels {
namespace {

constexpr int kThreads = 256;

__device__ inline float block_absmax(float local) {
  __shared__ float warp_max[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) local = fmaxf(local, __shfl_xor_sync(0xffffffffu, local, off));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_max[warp] = local;
  __syncthreads();
  float r = lane < kThreads / 32 ? warp_max[lane] : 0.0f;
  if (warp == 0) {
    for (int off = 16; off > 0; off >>= 1) r = fmaxf(r, __shfl_xor_sync(0xffffffffu, r, off));
    if (lane == 0) warp_max[0] = r;
  }
  __syncthreads();
  return warp_max[0];
}

__device__ inline int quant_one(float x, float scale, int qmax) {
  if (scale == 0.0f) return 0;
  const float q = rintf(__fdiv_rn(x, scale));
  return static_cast<int>(fminf(fmaxf(q, -static_cast<float>(qmax)), static_cast<float>(qmax)));
}

__global__ void quantize_kernel(const float* __restrict__ x, int64_t numel, int bits, int64_t block,
                                void* __restrict__ data, float* __restrict__ scales) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * block;
  float local = 0.0f;
  for (int64_t j = threadIdx.x; j < block; j += blockDim.x) {
    const int64_t i = base + j;
    if (i < numel) local = fmaxf(local, fabsf(x[i]));
  }
  const int qmax = (1 << (bits - 1)) - 1;
  const float scale = __fdiv_rn(block_absmax(local), static_cast<float>(qmax));
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  if (bits == 8) {
    int8_t* out = static_cast<int8_t*>(data);
    for (int64_t j = threadIdx.x; j < block; j += blockDim.x) {
      const int64_t i = base + j;
      out[i] = static_cast<int8_t>(i < numel ? quant_one(x[i], scale, qmax) : 0);
    }
  } else {
    uint8_t* out = static_cast<uint8_t*>(data);
    for (int64_t j = 2 * threadIdx.x; j < block; j += 2 * blockDim.x) {
      const int64_t i = base + j;
      const int lo = (i < numel ? quant_one(x[i], scale, qmax) : 0) + 8;
      const int hi = (i + 1 < numel ? quant_one(x[i + 1], scale, qmax) : 0) + 8;
      out[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

__global__ void dequantize_kernel(const void* __restrict__ data, const float* __restrict__ scales, int64_t numel,
                                  int bits, int64_t block, float* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int q;
    if (bits == 8) {
      q = static_cast<const int8_t*>(data)[i];
    } else {
      const uint8_t byte = static_cast<const uint8_t*>(data)[i / 2];
      q = ((i & 1) ? (byte >> 4) : (byte & 0x0F)) - 8;
    }
    out[i] = static_cast<float>(q) * scales[i / block];
  }
}

}  // namespace

cudaError_t launch_quantize(const float* x, int64_t numel, int bits, int64_t block, int64_t num_blocks, void* data,
                            float* scales, cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  quantize_kernel<<<static_cast<unsigned>(num_blocks), kThreads, 0, stream>>>(x, numel, bits, block, data, scales);
  return cudaGetLastError();
}

cudaError_t launch_dequantize(const void* data, const float* scales, int64_t numel, int bits, int64_t block,
                              float* out, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  const int64_t want = (numel + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(want < 65535 * 8 ? want : 65535 * 8);
  dequantize_kernel<<<grid, kThreads, 0, stream>>>(data, scales, numel, bits, block, out);
  return cudaGetLastError();
}

}  // namespace zero_kernels
