// Python module fedopt_kernels._C_cuda: the three ops on CUDA tensors (signatures: common/op_args.h).
// Everything a step needs stays on the device: no .item(), no device-to-host copy, no sync, so a
// step can be captured in a CUDA graph. Kernels run on the current stream of the tensors' device.
// pybind11 + tensor casters only: a fraction of torch/extension.h's compile time
#include <torch/csrc/utils/pybind.h>

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../common/op_args.h"
#include "cuda_ops.h"

namespace {

constexpr const char* kBackend = "cuda";

void check_cuda(const fo::Gathered& gat) {
  TORCH_CHECK(gat.entries.empty() || gat.device.is_cuda(), "fedopt_kernels cuda backend needs CUDA tensors, got ",
              gat.device, " (use backend='cpu' for CPU tensors)");
}

cudaStream_t stream_of(const fo::Gathered& gat) { return c10::cuda::getCurrentCUDAStream(gat.device.index()).stream(); }

// float64 scratch for the two-pass ops: per-chunk partials, the norm, one factor per group
at::Tensor scratch_for(const fo::Gathered& gat, size_t ngroups) {
  const int64_t n = fo::cuda::norm_slots(gat.entries.data(), static_cast<int>(gat.entries.size())) + 1 +
                    static_cast<int64_t>(ngroups);
  return at::empty({n}, at::TensorOptions().dtype(at::kDouble).device(gat.device));
}

void sgd(const fo::GroupLists& lists, const fo::HpLists& hps, const at::Tensor& k, const at::Tensor& table,
         int64_t decay_every) {
  fo::Gathered gat = fo::gather(lists, fo::sgd_slots(), kBackend);
  check_cuda(gat);
  const auto hp = fo::sgd_hps(hps, gat, kBackend);
  if (gat.entries.empty()) return gat.finish();
  TORCH_CHECK(k.device() == gat.device && k.scalar_type() == at::kInt && k.numel() == 1,
              "fedopt_kernels cuda sgd: k must be an int32 tensor [1] on ", gat.device);
  TORCH_CHECK(table.device() == gat.device && table.scalar_type() == at::kDouble && table.dim() == 1 &&
                  table.numel() >= 1 && table.is_contiguous(),
              "fedopt_kernels cuda sgd: the schedule table must be a contiguous float64 vector on ", gat.device);
  TORCH_CHECK(decay_every >= 1, "fedopt_kernels cuda sgd: decay_every must be >= 1, got ", decay_every);
  const c10::cuda::CUDAGuard guard(gat.device);
  C10_CUDA_CHECK(fo::cuda::sgd(gat.entries.data(), static_cast<int>(gat.entries.size()), hp.data(),
                               static_cast<int>(hp.size()), k.data_ptr<int32_t>(), table.data_ptr<double>(),
                               table.numel(), decay_every, stream_of(gat)));
  gat.finish();
}

void fednar(const fo::GroupLists& lists, const fo::HpLists& hps) {
  fo::Gathered gat = fo::gather(lists, fo::fednar_slots(), kBackend);
  check_cuda(gat);
  const auto hp = fo::fednar_hps(hps, gat, kBackend);
  if (gat.entries.empty()) return gat.finish();
  const c10::cuda::CUDAGuard guard(gat.device);
  at::Tensor scratch = scratch_for(gat, hp.size());
  C10_CUDA_CHECK(fo::cuda::fednar(gat.entries.data(), static_cast<int>(gat.entries.size()), hp.data(),
                                  static_cast<int>(hp.size()), gat.any_f64, scratch.data_ptr<double>(), stream_of(gat)));
  gat.finish();
}

void padamfed(const fo::GroupLists& lists, const fo::HpLists& hps) {
  fo::Gathered gat = fo::gather(lists, fo::padamfed_slots(), kBackend);
  check_cuda(gat);
  const auto hp = fo::padamfed_hps(hps, gat, kBackend);
  if (gat.entries.empty()) return gat.finish();
  const c10::cuda::CUDAGuard guard(gat.device);
  at::Tensor scratch = scratch_for(gat, hp.size());
  C10_CUDA_CHECK(fo::cuda::padamfed(gat.entries.data(), static_cast<int>(gat.entries.size()), hp.data(),
                                    static_cast<int>(hp.size()), gat.any_f64, scratch.data_ptr<double>(), stream_of(gat)));
  gat.finish();
}

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
  m.def("sgd", &sgd, "op sgd: FedDecaySGD / NeuronLRSGD step", py::arg("lists"), py::arg("hps"), py::arg("k"),
        py::arg("table"), py::arg("decay_every"));
  m.def("fednar", &fednar, "op fednar: FedNAR step", py::arg("lists"), py::arg("hps"));
  m.def("padamfed", &padamfed, "op padamfed: PAdaMFed client step", py::arg("lists"), py::arg("hps"));
  m.def("device_unsupported", &device_unsupported, py::arg("index"));
}
