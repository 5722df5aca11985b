// One pass of Adam/AdamW over a flat fp32 range: optional gradient multiplier (loss unscale x clip coefficient),
// L2 or decoupled weight decay, moment updates, parameter update and optional bf16 copy-out.
//
// This header is included by one translation unit per instruction set (adam_avx512.cpp, adam_avx2.cpp,
// adam_generic.cpp), each of which sets `#pragma GCC target` first, so the same loop is vectorised for that ISA and
// the binding picks one at run time. No torch headers: raw pointers keep the compile to a few seconds.
//
// Arithmetic mirrors torch.optim.Adam/AdamW (single-tensor path): exp_avg.lerp_(g, 1-b1),
// exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2), denom = sqrt(v)/sqrt(bc2) + eps, p.addcdiv_(m, denom, -lr/bc1).
// sqrt and division stay IEEE (no -ffast-math, no rsqrt approximations) so results agree with torch to ~1 ulp.
#pragma once

#include <cstdint>
#include <cstring>

#include "adam_args.h"

namespace zero_kernels {

// Round-to-nearest-even fp32 -> bf16, NaN -> 0x7FC0 (the same rule as c10::BFloat16).
static inline uint16_t fp32_to_bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

template <bool kAdamW, bool kBf16Out>
static inline void adam_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                              float* __restrict v, uint16_t* __restrict out, int64_t begin, int64_t end,
                              const AdamArgs& a) {
  const float gs = a.grad_scale, wd = a.weight_decay, decay = a.decay;
  const float b1c = a.one_minus_beta1, b2 = a.beta2, b2c = a.one_minus_beta2;
  const float bc2s = a.bias_correction2_sqrt, eps = a.eps, neg_step = -a.step_size;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float grad = g[i] * gs;
    float param = p[i];
    if (kAdamW) {
      param = param * decay;
    } else {
      grad = grad + wd * param;
    }
    // Rounding as torch's vectorised CPU kernels: lerp_ is fma(w, end - self, self); addcmul_ is
    // fma(value * t1, t2, self). The portable build has no FMA and rounds each operation.
#if ZERO_KERNELS_FMA
    const float mi = __builtin_fmaf(b1c, grad - m[i], m[i]);
    const float vi = __builtin_fmaf(b2c * grad, grad, v[i] * b2);
#else
    const float mi = m[i] + b1c * (grad - m[i]);
    const float vi = v[i] * b2 + b2c * grad * grad;
#endif
    const float denom = __builtin_sqrtf(vi) / bc2s + eps;
    param = param + neg_step * mi / denom;  // torch's addcdiv order: (value * t1) / t2
    m[i] = mi;
    v[i] = vi;
    p[i] = param;
    if (kBf16Out) out[i] = fp32_to_bf16_bits(param);
  }
}

// Split [0, n) into per-thread ranges aligned to 16 floats (one 64-byte cache line) and run the loop.
template <bool kAdamW, bool kBf16Out>
static void adam_parallel(float* p, const float* g, float* m, float* v, uint16_t* out, int64_t n, int num_threads,
                          const AdamArgs& a) {
  // Below this size a parallel region costs more than it saves.
  constexpr int64_t kMinParallel = 1 << 15;
  const int nt = n < kMinParallel ? 1 : num_threads;
#pragma omp parallel num_threads(nt)
  {
#ifdef _OPENMP
    const int tid = omp_get_thread_num();
    const int cnt = omp_get_num_threads();
#else
    const int tid = 0;
    const int cnt = 1;
#endif
    int64_t per = (n + cnt - 1) / cnt;
    per = (per + 15) & ~int64_t(15);
    const int64_t begin = per * tid < n ? per * tid : n;
    const int64_t end = begin + per < n ? begin + per : n;
    if (begin < end) adam_range<kAdamW, kBf16Out>(p, g, m, v, out, begin, end, a);
  }
}

static inline void adam_dispatch(float* p, const float* g, float* m, float* v, uint16_t* out, int64_t n,
                                 int num_threads, const AdamArgs& a) {
  if (a.adamw) {
    if (out) adam_parallel<true, true>(p, g, m, v, out, n, num_threads, a);
    else adam_parallel<true, false>(p, g, m, v, out, n, num_threads, a);
  } else {
    if (out) adam_parallel<false, true>(p, g, m, v, out, n, num_threads, a);
    else adam_parallel<false, false>(p, g, m, v, out, n, num_threads, a);
  }
}

}  // namespace zero_kernels
