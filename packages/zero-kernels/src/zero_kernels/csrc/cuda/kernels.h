// Launchers of the CUDA ops, on raw device pointers: the .cu files include no torch headers, so they compile
// with plain `nvcc -c` (the compile test) and quickly; binding.cpp adapts torch tensors to these.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace zero_kernels {

// Scalars of one Adam step (computed by the binding in double, cast to float as torch does).
struct CudaAdamArgs {
  float grad_scale, weight_decay, decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
      step_size;
  bool adamw;
};

// Multi-tensor Adam/AdamW over fp32 tensors. `table` (device, int64) holds, for T tensors and C chunks:
// param ptrs[T], grad ptrs[T], exp_avg ptrs[T], exp_avg_sq ptrs[T], numels[T], chunk tensor index[C],
// chunk start element[C]. One CUDA block per chunk of `chunk_size` elements.
cudaError_t launch_multi_tensor_adam(const int64_t* table, int num_tensors, int num_chunks, int64_t chunk_size,
                                     const CudaAdamArgs& args, cudaStream_t stream);

// Symmetric blockwise quantization in zero_comm's layout: x (fp32, numel elements, zero-padded logically to
// num_blocks * block) -> scales[num_blocks] = absmax / qmax and q = rint(x / scale) clamped to [-qmax, qmax];
// bits 8: int8 data[num_blocks * block]; bits 4: uint8 data[num_blocks * block / 2], value + 8, element 2i in the
// low nibble and 2i+1 in the high nibble. An all-zero block has scale 0 and quantizes to zeros.
cudaError_t launch_quantize(const float* x, int64_t numel, int bits, int64_t block, int64_t num_blocks,
                            void* data, float* scales, cudaStream_t stream);

// Inverse: out[i] = q[i] * scales[i / block] for i < numel (fp32).
cudaError_t launch_dequantize(const void* data, const float* scales, int64_t numel, int bits, int64_t block,
                              float* out, cudaStream_t stream);

}  // namespace zero_kernels
