// The Adam loop compiled for AVX2 with FMA; chosen at run time by binding.cpp.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma")
#endif

#define ZERO_KERNELS_FMA 1
#include "adam_kernel.h"

namespace zero_kernels {

void adam_avx2(float* p, const float* g, float* m, float* v, uint16_t* bf16_out, int64_t n, int num_threads,
              const AdamArgs& a) {
  adam_dispatch(p, g, m, v, bf16_out, n, num_threads, a);
}

}  // namespace zero_kernels
