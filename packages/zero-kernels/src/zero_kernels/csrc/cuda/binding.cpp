// Torch binding of the CUDA ops (built only on machines with CUDA): validates tensors, builds the multi-tensor
// chunk table, and calls the raw-pointer launchers of kernels.h on the current stream.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

#define ZERO_STR_(x) #x
#define ZERO_STR(x) ZERO_STR_(x)

namespace {

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "zero_kernels ", what, ": ", cudaGetErrorString(err));
}

void check_list(const std::vector<at::Tensor>& ts, const at::Tensor& like0, size_t n, const char* name) {
  TORCH_CHECK(ts.size() == n, "fused_adam: ", name, " has ", ts.size(), " tensors, expected ", n);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(ts[i].is_cuda() && ts[i].scalar_type() == at::kFloat && ts[i].is_contiguous(), "fused_adam: ",
                name, "[", i, "] must be a contiguous CUDA float32 tensor, got ", ts[i].scalar_type(), " on ",
                ts[i].device());
    TORCH_CHECK(ts[i].device() == like0.device(), "fused_adam: ", name, "[", i, "] is on ", ts[i].device(),
                ", params on ", like0.device());
  }
}

void fused_adam(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step, bool adamw,
                bool bias_correction, double grad_scale) {
  const size_t n = params.size();
  if (n == 0) return;
  TORCH_CHECK(step >= 1, "fused_adam: step must be >= 1, got ", step);
  check_list(params, params[0], n, "params");
  check_list(grads, params[0], n, "grads");
  check_list(exp_avgs, params[0], n, "exp_avgs");
  check_list(exp_avg_sqs, params[0], n, "exp_avg_sqs");
  // a multiple of 4, so float4 chunks stay aligned; small enough that the last wave of blocks is a small share
  constexpr int64_t kChunk = 16384;
  std::vector<int64_t> chunk_tensor, chunk_start;
  std::vector<int64_t> head(5 * n);
  for (size_t t = 0; t < n; ++t) {
    TORCH_CHECK(grads[t].numel() == params[t].numel() && exp_avgs[t].numel() == params[t].numel() &&
                    exp_avg_sqs[t].numel() == params[t].numel(),
                "fused_adam: tensor ", t, " has mismatched numel across params/grads/moments");
    head[t] = reinterpret_cast<int64_t>(params[t].data_ptr<float>());
    head[n + t] = reinterpret_cast<int64_t>(grads[t].data_ptr<float>());
    head[2 * n + t] = reinterpret_cast<int64_t>(exp_avgs[t].data_ptr<float>());
    head[3 * n + t] = reinterpret_cast<int64_t>(exp_avg_sqs[t].data_ptr<float>());
    head[4 * n + t] = params[t].numel();
    for (int64_t s = 0; s < params[t].numel(); s += kChunk) {
      chunk_tensor.push_back(static_cast<int64_t>(t));
      chunk_start.push_back(s);
    }
  }
  const int64_t table_size = static_cast<int64_t>(head.size() + 2 * chunk_tensor.size());
  // pinned, so the copy is queued without stalling the host; the caching host allocator keeps the block until
  // the copy has run
  auto host_table = at::empty({table_size}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* out = host_table.data_ptr<int64_t>();
  out = std::copy(head.begin(), head.end(), out);
  out = std::copy(chunk_tensor.begin(), chunk_tensor.end(), out);
  std::copy(chunk_start.begin(), chunk_start.end(), out);
  auto dev_table = host_table.to(params[0].device(), /*non_blocking=*/true);
  zero_kernels::CudaAdamArgs a;
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
  check_cuda(zero_kernels::launch_multi_tensor_adam(dev_table.data_ptr<int64_t>(), static_cast<int>(n),
                                                    static_cast<int>(chunk_tensor.size()), kChunk, a,
                                                    c10::cuda::getCurrentCUDAStream().stream()),
             "multi_tensor_adam");
}

std::vector<at::Tensor> quantize(const at::Tensor& x, int64_t bits, int64_t block) {
  TORCH_CHECK(x.is_cuda() && x.is_floating_point(), "quantize: x must be a floating CUDA tensor, got ",
              x.scalar_type(), " on ", x.device());
  TORCH_CHECK(bits == 4 || bits == 8, "quantize: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(block >= 1 && (bits == 8 || block % 2 == 0), "quantize: block must be positive (even for int4), got ",
              block);
  auto xf = x.reshape(-1).to(at::kFloat).contiguous();
  const int64_t numel = xf.numel();
  const int64_t num_blocks = std::max<int64_t>(1, (numel + block - 1) / block);
  const int64_t padded = num_blocks * block;
  auto opts = x.options();
  auto data = bits == 8 ? at::empty({padded}, opts.dtype(at::kChar)) : at::empty({padded / 2}, opts.dtype(at::kByte));
  auto scales = at::empty({num_blocks}, opts.dtype(at::kFloat));
  check_cuda(zero_kernels::launch_quantize(xf.data_ptr<float>(), numel, static_cast<int>(bits), block, num_blocks,
                                           data.data_ptr(), scales.data_ptr<float>(),
                                           c10::cuda::getCurrentCUDAStream().stream()),
             "quantize");
  return {data, scales};
}

at::Tensor dequantize(const at::Tensor& data, const at::Tensor& scales, int64_t numel, int64_t bits, int64_t block) {
  TORCH_CHECK(data.is_cuda() && scales.is_cuda() && scales.scalar_type() == at::kFloat,
              "dequantize: data and fp32 scales must be CUDA tensors");
  TORCH_CHECK(bits == 4 || bits == 8, "dequantize: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(data.numel() * (bits == 4 ? 2 : 1) == scales.numel() * block && numel <= scales.numel() * block,
              "dequantize: data of ", data.numel(), " bytes and ", scales.numel(), " scales do not fit block ",
              block, " bits ", bits, " numel ", numel);
  auto out = at::empty({numel}, scales.options());
  auto d = data.contiguous();
  check_cuda(zero_kernels::launch_dequantize(d.data_ptr(), scales.contiguous().data_ptr<float>(), numel,
                                             static_cast<int>(bits), block, out.data_ptr<float>(),
                                             c10::cuda::getCurrentCUDAStream().stream()),
             "dequantize");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_hash") = ZERO_STR(ZERO_OP_SOURCE_HASH);
  m.def("fused_adam", &fused_adam, "Multi-tensor Adam/AdamW over lists of CUDA fp32 tensors (in place).");
  m.def("quantize", &quantize, "Blockwise symmetric int8/int4 quantize: returns [data, scales].");
  m.def("dequantize", &dequantize, "Blockwise dequantize to a flat fp32 tensor of numel elements.");
}
