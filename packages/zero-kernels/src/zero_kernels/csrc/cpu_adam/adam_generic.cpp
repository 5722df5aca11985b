// The Adam loop compiled for the compiler's baseline ISA (portable); chosen at run time by binding.cpp.
// No target pragma: the baseline ISA of the compiler (SSE2 on x86-64, NEON on aarch64).

#include "adam_kernel.h"

namespace zero_kernels {

void adam_generic(float* p, const float* g, float* m, float* v, uint16_t* bf16_out, int64_t n, int num_threads,
                 const AdamArgs& a) {
  adam_dispatch(p, g, m, v, bf16_out, n, num_threads, a);
}

}  // namespace zero_kernels
