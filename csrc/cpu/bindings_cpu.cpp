// Python module fedopt_kernels._C_cpu: the ops on CPU tensors (argument layout: common/op_args.h).
// pybind11 + tensor casters only: a fraction of torch/extension.h's compile time
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "../common/binding.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "step_rows.h"

namespace {

// The CPU device for common/binding.h: scalars are host memory, so they are read directly.
struct Cpu {
  static constexpr const char* kName = "cpu";

  static void check_device(const fo::Gathered& gat, const at::Tensor& k) {
    TORCH_CHECK(gat.entries.empty() || gat.device.is_cpu(), "fedopt_kernels cpu backend needs CPU tensors, got ",
                gat.device, " (use backend='cuda' or 'triton' for CUDA tensors)");
    TORCH_CHECK(k.is_cpu(), "fedopt_kernels cpu backend: k must be a CPU tensor");
  }

  // Per-client ops update every entry; batched ops their active clients' slices (step_rows.h).
  static void run(fo::SgdOp, fo::Gathered& gat, const fo::StepScalars& sc) {
    if (!fo::cpu::skipped(sc)) sgd(gat.entries, gat, sc);
  }
  static void run(fo::SgdBatchedOp, fo::Gathered& gat, const fo::StepScalars& sc) {
    if (!fo::cpu::skipped(sc)) sgd(fo::cpu::active_client_entries(gat, fo::SgdBatchedOp::desc().slots, sc), gat, sc);
  }
  static void run(fo::FedNarOp, fo::Gathered& gat, const fo::StepScalars& sc) {
    if (!fo::cpu::skipped(sc)) fednar(gat.entries, gat, sc);
  }
  static void run(fo::FedNarBatchedOp, fo::Gathered& gat, const fo::StepScalars& sc) {
    if (!fo::cpu::skipped(sc))
      fednar(fo::cpu::active_client_entries(gat, fo::FedNarBatchedOp::desc().slots, sc), gat, sc);
  }
  static void run(fo::PAdamOp, fo::Gathered& gat, const fo::StepScalars& sc) {
    if (!fo::cpu::skipped(sc)) padamfed(gat.entries, gat, sc);
  }
  static void run(fo::PAdamBatchedOp, fo::Gathered& gat, const fo::StepScalars& sc) {
    if (!fo::cpu::skipped(sc))
      padamfed(fo::cpu::active_client_entries(gat, fo::PAdamBatchedOp::desc().slots, sc), gat, sc);
  }

  static void sgd(const std::vector<fo::Entry>& entries, const fo::Gathered& gat, const fo::StepScalars& sc) {
    std::vector<fo::SgdHp> hp;
    std::vector<double> lr;
    fo::cpu::sgd_rows(gat, sc, hp, lr);
    fo::cpu::sgd(entries, hp, lr);
    fo::cpu::advance_counters(sc);
  }
  static void fednar(const std::vector<fo::Entry>& entries, const fo::Gathered& gat, const fo::StepScalars& sc) {
    fo::cpu::fednar(entries, fo::cpu::hp_rows<fo::FedNarHp>(gat, sc, fo::fednar_hp_of), gat.any_f64);
    fo::cpu::advance_counters(sc);
  }
  static void padamfed(const std::vector<fo::Entry>& entries, const fo::Gathered& gat, const fo::StepScalars& sc) {
    fo::cpu::padamfed(entries, fo::cpu::hp_rows<fo::PAdamHp>(gat, sc, fo::padamfed_hp_of), gat.any_f64);
    fo::cpu::advance_counters(sc);
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

// fedopt_kernels/_dtensor.py: run `body` (one op call) with `reduce` between the passes of its norm.
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
  fo::bind_batched_ops<Cpu>(m);
  m.def("set_isa", &set_isa, "choose the kernels' instruction set; returns the active one", py::arg("name"));
  m.def("active_isa", []() { return std::string(fo::cpu::active_isa()); });
  m.def("run_with_norm_reduce", &run_with_norm_reduce,
        "call body() with reduce(per-entry sums of squares) -> total between the passes of its norm",
        py::arg("reduce"), py::arg("body"));
  m.attr("chunk_elements") = fo::cpu::kChunk;
}
