// Python module fedopt_kernels._C_cpu: the ops on CPU tensors (argument layout: common/op_args.h).
// pybind11 + tensor casters only: a fraction of torch/extension.h's compile time
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "../common/binding.h"
#include "clip_sum_cpu.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "step_rows.h"

namespace {

// The CPU device for common/binding.h: scalars are host memory, so they are read directly.
struct Cpu {
  static constexpr const char* kName = "cpu";
  static constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
  static constexpr const char* kElsewhere = "use backend='cuda' or 'triton' for CUDA tensors";

  // Per-client ops update every entry; batched ops their active clients' slices (step_rows.h). The
  // norms are summed on the stack: no scratch to hand back.
  template <class Spec, bool Batched>
  static at::Tensor run(fo::OpTag<Spec, Batched> op, fo::Gathered& gat, const fo::StepScalars& sc,
                        const c10::optional<at::Tensor>& /*scratch*/) {
    if (fo::cpu::skipped(sc)) return at::Tensor();
    if (Batched) fo::cpu::step<Spec>(fo::cpu::active_client_entries(gat, op.desc().slots, sc), gat, sc);
    else fo::cpu::step<Spec>(gat.entries, gat, sc);
    fo::cpu::advance_counters(sc);
    return at::Tensor();
  }
};

// Which copy of the chunk code runs: "auto" (default: AVX2 when the CPU has it), "base" or "avx2".
// Both give the same bits; tests use this to check that.
std::string set_isa(const std::string& name) {
  TORCH_CHECK(name == "auto" || name == "base" || name == "avx2", "isa must be 'auto', 'base' or 'avx2', got '",
              name, "'");
  TORCH_CHECK(fo::cpu::set_isa(name.c_str()), "isa '", name, "' is not available on this CPU / build");
  return fo::cpu::active_isa();
}

// fedopt_kernels/core/dtensor.py: run `body` (one op call) with `reduce` between the passes of its norm.
// `reduce(sums)` gets this rank's float64 sum of squares per entry and returns the sum over every
// rank as a one-element float64 CPU tensor.
double call_norm_reduce(void* ctx, const double* per_entry, int64_t n) {
  const py::function& reduce = *static_cast<const py::function*>(ctx);
  at::Tensor sums = at::empty({n}, at::kDouble);
  std::copy(per_entry, per_entry + n, sums.data_ptr<double>());
  const at::Tensor total = reduce(sums).cast<at::Tensor>();
  TORCH_CHECK(total.is_cpu() && total.scalar_type() == at::kDouble && total.numel() == 1,
              "fedopt_kernels cpu: the norm reduction must return one float64 CPU value");
  return total.contiguous().data_ptr<double>()[0];
}

void run_with_norm_reduce(const py::function& reduce, const py::function& body) {
  fo::cpu::NormReduceScope scope(&call_norm_reduce, const_cast<py::function*>(&reduce));
  body();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fedopt_kernels C++ CPU kernels (see csrc/)";
  fo::bind_ops<Cpu>(m);
  m.def("set_isa", &set_isa, "choose the kernels' instruction set; returns the active one", py::arg("name"));
  m.def("active_isa", []() { return std::string(fo::cpu::active_isa()); });
  m.def("run_with_norm_reduce", &run_with_norm_reduce,
        "call body() with reduce(per-entry sums of squares) -> total between the passes of its norm",
        py::arg("reduce"), py::arg("body"));
  m.attr("chunk_elements") = fo::cpu::kChunk;
  m.def("clip_sum", &fo::cpu::clip_sum, "a chunk of replies clipped and summed (fedopt_kernels/core/clip_sum.py)",
        py::arg("tensors"), py::arg("bound"), py::arg("active"), py::arg("out"));
}
