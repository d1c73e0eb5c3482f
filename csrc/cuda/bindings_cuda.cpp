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
  // factor per (batch, client)
  static at::Tensor scratch(const fo::Gathered& gat, const fo::cuda::DeviceScalars& ds) {
    const int64_t n = fo::cuda::two_pass_scratch(gat.entries.data(), static_cast<int>(gat.entries.size()),
                                                 static_cast<int>(gat.nbatches()), ds.clients);
    return at::empty({n}, at::TensorOptions().dtype(at::kDouble).device(gat.device));
  }

  template <class Launch>
  static void go(fo::Gathered& gat, const fo::StepScalars& sc, const at::Device& dev, Launch&& launch) {
    const c10::cuda::CUDAGuard guard(dev);
    const fo::cuda::DeviceScalars ds = device(sc);
    if (gat.entries.empty()) {
      C10_CUDA_CHECK(fo::cuda::advance(ds, stream(dev)));
      return;
    }
    C10_CUDA_CHECK(launch(ds, stream(dev)));
  }

  static int count(const fo::Gathered& gat) { return static_cast<int>(gat.entries.size()); }
  static int batches(const fo::Gathered& gat) { return static_cast<int>(gat.nbatches()); }

  // sgd / sgd_batched: `fn` is fo::cuda::sgd or fo::cuda::sgd_batched (which honours FRESH)
  template <class Fn>
  static void sgd_like(Fn fn, fo::Gathered& gat, const fo::StepScalars& sc) {
    go(gat, sc, gat.device, [&](const fo::cuda::DeviceScalars& ds, cudaStream_t st) {
      return fn(gat.entries.data(), count(gat), gat.present.data(), batches(gat), ds, st);
    });
  }

  // the two-pass ops: `fn` is fo::cuda::fednar or fo::cuda::padamfed (one norm per client)
  template <class Fn>
  static void two_pass(Fn fn, fo::Gathered& gat, const fo::StepScalars& sc) {
    go(gat, sc, gat.device, [&](const fo::cuda::DeviceScalars& ds, cudaStream_t st) {
      at::Tensor buf = scratch(gat, ds);
      return fn(gat.entries.data(), count(gat), gat.present.data(), batches(gat), gat.any_f64, ds,
                buf.data_ptr<double>(), st);
    });
  }

  // Per-client and client-batched ops (docs/client_batched.md) run the same kernels: for a batched op
  // gat.entries are the stacked tensors (numel per client), which the kernels split into clients
  // arithmetically; sc.clients = C, sc.active the mask. sgd_batched honours FRESH.
  template <bool Batched>
  static void run(fo::OpTag<fo::spec::sgd, Batched>, fo::Gathered& gat, const fo::StepScalars& sc) {
    sgd_like(Batched ? fo::cuda::sgd_batched : fo::cuda::sgd, gat, sc);
  }
  template <bool Batched>
  static void run(fo::OpTag<fo::spec::fednar, Batched>, fo::Gathered& gat, const fo::StepScalars& sc) {
    two_pass(fo::cuda::fednar, gat, sc);
  }
  template <bool Batched>
  static void run(fo::OpTag<fo::spec::padamfed, Batched>, fo::Gathered& gat, const fo::StepScalars& sc) {
    two_pass(fo::cuda::padamfed, gat, sc);
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
}
