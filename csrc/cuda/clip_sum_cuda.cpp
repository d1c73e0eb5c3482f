// The clipped sum's tensors to csrc/cuda/clip_sum.cu's launches, on the tensors' current stream.
#include "clip_sum_cuda.h"

#include <algorithm>

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "clip_sum_launch.h"

namespace fo {
namespace cuda {

namespace {

ClipDtype clip_dtype(const at::Tensor& t, size_t j) {
  switch (t.scalar_type()) {
    case at::kFloat: return ClipDtype::kFloat;
    case at::kDouble: return ClipDtype::kDouble;
    case at::kHalf: return ClipDtype::kHalf;
    case at::kBFloat16: return ClipDtype::kBFloat16;
    default: TORCH_CHECK(false, "fedopt_kernels cuda clip_sum: tensors[", j, "] must be float16/bfloat16/float32/float64");
  }
  return ClipDtype::kFloat;  // not reached
}

}  // namespace

std::vector<at::Tensor> clip_sum(const std::vector<at::Tensor>& tensors, double max_norm,
                                 const c10::optional<at::Tensor>& active, const std::vector<at::Tensor>& out) {
  TORCH_CHECK(!tensors.empty() && out.size() == tensors.size(),
              "fedopt_kernels cuda clip_sum: one float64 sum per tensor, at least one tensor");
  const at::Tensor& x0 = tensors[0];
  TORCH_CHECK(x0.is_cuda() && x0.dim() >= 1, "fedopt_kernels cuda clip_sum: tensors[0] must be a CUDA tensor [C, ...]");
  const int64_t C = x0.size(0);
  TORCH_CHECK(C <= kClipMaxClients, "fedopt_kernels cuda clip_sum: at most ", kClipMaxClients, " clients, got ", C);
  const c10::cuda::CUDAGuard guard(x0.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x0.device().index()).stream();
  std::vector<int64_t> sizes, chunks;
  int64_t per_client = 0;
  for (size_t j = 0; j < tensors.size(); ++j) {
    const at::Tensor& t = tensors[j];
    TORCH_CHECK(t.device() == x0.device() && t.dim() >= 1 && t.size(0) == C, "fedopt_kernels cuda clip_sum: tensors[",
                j, "] must be [C, *shape] on ", x0.device(), " with C = ", C);
    TORCH_CHECK(C == 0 || t.select(0, 0).is_contiguous(), "fedopt_kernels cuda clip_sum: tensors[", j,
                "] rows must be contiguous");
    int64_t n = 1;  // per row (also when C is 0)
    for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
    const at::Tensor& o = out[j];
    TORCH_CHECK(o.device() == x0.device() && o.scalar_type() == at::kDouble && o.is_contiguous() && o.numel() == n,
                "fedopt_kernels cuda clip_sum: out[", j, "] must be a contiguous float64 tensor of ", n,
                " elements on ", x0.device());
    clip_dtype(t, j);
    sizes.push_back(n);
    chunks.push_back((n + kClipChunk - 1) / kClipChunk);
    per_client += chunks.back();
  }
  at::Tensor act;
  if (active.has_value()) {
    act = active->contiguous();
    TORCH_CHECK(act.device() == x0.device() && act.scalar_type() == at::kBool && act.numel() == C,
                "fedopt_kernels cuda clip_sum: active must be a bool tensor of ", C, " elements on ", x0.device());
  }
  const auto f64 = x0.options().dtype(at::kDouble);
  at::Tensor norms = at::empty({C}, f64), factors = at::empty({C}, f64);
  at::Tensor below = at::empty({C}, x0.options().dtype(at::kBool));
  if (C == 0) return {norms, factors, below};
  at::Tensor partial = at::empty({std::max<int64_t>(C * per_client, 1)}, f64);
  const bool* on = act.defined() ? act.data_ptr<bool>() : nullptr;
  int64_t first = 0;
  for (size_t j = 0; j < tensors.size(); ++j) {
    if (sizes[j] > 0)
      C10_CUDA_CHECK(clip_squares(clip_dtype(tensors[j], j), tensors[j].data_ptr(), tensors[j].stride(0), sizes[j], C,
                                  partial.data_ptr<double>(), per_client, first, stream));
    first += chunks[j];
  }
  C10_CUDA_CHECK(clip_factors(partial.data_ptr<double>(), per_client, C, max_norm, on, norms.data_ptr<double>(),
                              factors.data_ptr<double>(), below.data_ptr<bool>(), stream));
  for (size_t j = 0; j < tensors.size(); ++j) {
    if (sizes[j] > 0)
      C10_CUDA_CHECK(clip_add(clip_dtype(tensors[j], j), tensors[j].data_ptr(), tensors[j].stride(0), sizes[j], C,
                              factors.data_ptr<double>(), on, out[j].data_ptr<double>(), stream));
  }
  return {norms, factors, below};
}

}  // namespace cuda
}  // namespace fo
