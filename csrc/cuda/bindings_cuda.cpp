// Python module fedopt_kernels._C_cuda: the ops on CUDA tensors (argument layout: common/op_args.h).
// Everything a step needs stays on the device: hyperparameters, k, the schedule, GradScaler's
// tensors are read by the kernels; no .item(), no device-to-host copy, no sync, so a step can be
// captured in a CUDA graph. Kernels run on the current stream of the tensors' device.
// pybind11 + tensor casters only: a fraction of torch/extension.h's compile time
#include <torch/csrc/utils/pybind.h>

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>

#include "../common/binding.h"
#include "clip_sum_cuda.h"
#include "cuda_ops.h"

namespace {

// The CUDA device for common/binding.h: scalars stay in device memory for the kernels to read.
struct Cuda {
  static constexpr const char* kName = "cuda";
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CUDA;
  static constexpr const char* kElsewhere = "use backend='cpu' for CPU tensors";

  // clients: C for a batched op (StepScalars.clients), 1 for a per-client op
  static fo::cuda::DeviceScalars device(const fo::StepScalars& s) {
    return {s.hp, s.hp_cols, s.k, s.table, s.table_len, s.decay_every, s.grad_scale, s.found_inf,
            s.clients > 0 ? s.clients : 1, s.active};
  }

  static cudaStream_t stream(const at::Device& d) { return c10::cuda::getCurrentCUDAStream(d.index()).stream(); }

  // float64 scratch for the two-pass ops: per (client, chunk) partials, each client's norm, one
  // factor per (row group, client). The caller's `given` one (a previous step's) when it is big enough: a
  // step that allocates moves the caching allocator's next gradients (core/replay.py).
  static at::Tensor scratch(const fo::Gathered& gat, const fo::cuda::DeviceScalars& ds,
                            const c10::optional<at::Tensor>& given) {
    const int64_t n = fo::cuda::two_pass_scratch(gat.entries.data(), static_cast<int>(gat.entries.size()),
                                                 static_cast<int>(gat.ngroups()), ds.clients);
    if (given.has_value() && given->defined() && given->device() == gat.device &&
        given->scalar_type() == at::kDouble && given->is_contiguous() && given->numel() >= n)
      return *given;
    return at::empty({n}, at::TensorOptions().dtype(at::kDouble).device(gat.device));
  }

  // Per-client and client-batched ops (docs/client_batched.md) run the same kernels: for a batched op
  // gat.entries are the stacked tensors (numel per client), which the kernels split into clients
  // arithmetically; sc.clients = C, sc.active the mask. Returns the scratch it used (norm ops).
  template <class Spec, bool Batched>
  static at::Tensor run(fo::OpTag<Spec, Batched>, fo::Gathered& gat, const fo::StepScalars& sc,
                        const c10::optional<at::Tensor>& given) {
    const c10::cuda::CUDAGuard guard(gat.device);
    const fo::cuda::DeviceScalars ds = device(sc);
    const cudaStream_t st = stream(gat.device);
    if (gat.entries.empty()) {
      C10_CUDA_CHECK(fo::cuda::advance(ds, st));
      return given.has_value() ? *given : at::Tensor();
    }
    const at::Tensor buf = Spec::kNorm ? scratch(gat, ds, given) : at::Tensor();
    const fo::cuda::Launch launch{gat.entries.data(), static_cast<int>(gat.entries.size()), gat.present.data(),
                                  static_cast<int>(gat.ngroups()), Batched, gat.any_f64, ds,
                                  Spec::kNorm ? buf.data_ptr<double>() : nullptr, st};
    C10_CUDA_CHECK(fo::cuda::step<Spec>(launch));
    return buf;
  }
};

// "" when this build's kernels can run on GPU `index`, else the reason (e.g. no image for its arch).
std::string device_unsupported(int64_t index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  const cudaError_t err = fo::cuda::probe_current_device();
  if (err == cudaSuccess) return "";
  cudaDeviceProp prop;
  std::string cc = "?";
  if (cudaGetDeviceProperties(&prop, static_cast<int>(index)) == cudaSuccess)
    cc = std::to_string(prop.major) + "." + std::to_string(prop.minor);
  (void)cudaGetLastError();
  return "the extension has no kernel image for this GPU (compute capability " + cc + ": " + cudaGetErrorString(err) +
         "); rebuild with TORCH_CUDA_ARCH_LIST=\"" + cc + "\" pip install -e . --no-build-isolation";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fedopt_kernels CUDA kernels (see csrc/cuda)";
  fo::bind_ops<Cuda>(m);
  m.def("device_unsupported", &device_unsupported, py::arg("index"));
  m.def("clip_sum", &fo::cuda::clip_sum, "a chunk of replies clipped and summed (fedopt_kernels/core/clip_sum.py)",
        py::arg("tensors"), py::arg("bound"), py::arg("active"), py::arg("out"));
}
