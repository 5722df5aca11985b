// Python binding of the CPU Adam op: picks the instruction set at run time and runs one tensor's step.
// Only pybind11 is included (no torch/extension.h): the Python side validates tensors and passes raw pointers,
// which keeps the first-use JIT build to seconds.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_args.h"

// The loader passes the source hash as a bare token (quotes do not survive ninja); stringify it here.
#define ZERO_STR_(x) #x
#define ZERO_STR(x) ZERO_STR_(x)
#ifdef ZERO_OP_SOURCE_HASH
#define ZERO_SOURCE_HASH ZERO_STR(ZERO_OP_SOURCE_HASH)
#else
#define ZERO_SOURCE_HASH "unknown"
#endif

namespace py = pybind11;
using namespace zero_kernels;

namespace {

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    out.push_back("avx512");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back("avx2");
#endif
  out.push_back("generic");
  return out;
}

AdamFn kernel_for(const std::string& isa) {
  if (isa == "avx512") return adam_avx512;
  if (isa == "avx2") return adam_avx2;
  if (isa == "generic") return adam_generic;
  throw std::invalid_argument("cpu_adam: unknown isa '" + isa + "' (expected avx512, avx2 or generic)");
}

void adam_step(const std::string& isa, int num_threads, std::uintptr_t param, std::uintptr_t grad,
               std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::uintptr_t bf16_out, int64_t numel,
               int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
               bool bias_correction, double grad_scale) {
  if (step < 1) throw std::invalid_argument("cpu_adam: step must be >= 1, got " + std::to_string(step));
  if (numel < 0) throw std::invalid_argument("cpu_adam: numel must be >= 0");
  if (num_threads < 1) num_threads = 1;
  AdamFn fn = kernel_for(isa);
  AdamArgs a;
  a.grad_scale = static_cast<float>(grad_scale);
  a.weight_decay = static_cast<float>(weight_decay);
  a.decay = static_cast<float>(1.0 - lr * weight_decay);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  a.eps = static_cast<float>(eps);
  a.step_size = static_cast<float>(lr / bc1);
  a.adamw = adamw;
  py::gil_scoped_release release;
  fn(reinterpret_cast<float*>(param), reinterpret_cast<const float*>(grad), reinterpret_cast<float*>(exp_avg),
     reinterpret_cast<float*>(exp_avg_sq), reinterpret_cast<uint16_t*>(bf16_out), numel, num_threads, a);
}

// STREAM-style triad a = b + s * c over fp32, used by the benchmark to measure bandwidth with the same threads.
void triad(std::uintptr_t a, std::uintptr_t b, std::uintptr_t c, double s, int64_t n, int num_threads) {
  float* pa = reinterpret_cast<float*>(a);
  const float* pb = reinterpret_cast<const float*>(b);
  const float* pc = reinterpret_cast<const float*>(c);
  const float fs = static_cast<float>(s);
  py::gil_scoped_release release;
#pragma omp parallel for simd num_threads(num_threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) pa[i] = pb[i] + fs * pc[i];
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero_kernels CPU Adam/AdamW: one pass over fp32 params, grads and moments (raw pointers).";
  m.attr("source_hash") = ZERO_SOURCE_HASH;
  m.def("supported_isas", &supported_isas, "Instruction sets this CPU supports, best first.");
  m.def("adam_step", &adam_step, py::arg("isa"), py::arg("num_threads"), py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("bf16_out"), py::arg("numel"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adamw"), py::arg("bias_correction"), py::arg("grad_scale"),
        "One Adam/AdamW step over numel fp32 elements at the given addresses (bf16_out = 0 for none).");
  m.def("triad", &triad, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("s"), py::arg("n"),
        py::arg("num_threads"), "STREAM triad a = b + s*c over n fp32 elements.");
}
