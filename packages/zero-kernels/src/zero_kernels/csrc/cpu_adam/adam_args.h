// Scalars of one Adam step, computed once per tensor by the binding (in double, then cast, as torch does).
#pragma once

#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace zero_kernels {

struct AdamArgs {
  float grad_scale;             // multiplier applied to the gradient on the fly (1/loss_scale * clip coefficient)
  float weight_decay;           // L2 coefficient (Adam mode)
  float decay;                  // 1 - lr * weight_decay (AdamW mode)
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step), or 1 without bias correction
  float eps;
  float step_size;              // lr / (1 - beta1^step), or lr without bias correction
  bool adamw;
};

using AdamFn = void (*)(float* p, const float* g, float* m, float* v, uint16_t* bf16_out, int64_t n,
                        int num_threads, const AdamArgs& a);

// One per instruction set; each lives in its own translation unit compiled for that target.
void adam_avx512(float* p, const float* g, float* m, float* v, uint16_t* bf16_out, int64_t n, int num_threads,
                 const AdamArgs& a);
void adam_avx2(float* p, const float* g, float* m, float* v, uint16_t* bf16_out, int64_t n, int num_threads,
               const AdamArgs& a);
void adam_generic(float* p, const float* g, float* m, float* v, uint16_t* bf16_out, int64_t n, int num_threads,
                  const AdamArgs& a);

}  // namespace zero_kernels
