// Python module fedopt_kernels._C_cpu: the three ops on CPU tensors (signatures: common/op_args.h).
// pybind11 + tensor casters only: a fraction of torch/extension.h's compile time
#include <torch/csrc/utils/pybind.h>

#include "../common/op_args.h"
#include "cpu_ops.h"
#include "cpu_common.h"

namespace {

constexpr const char* kBackend = "cpu";

void check_cpu(const fo::Gathered& gat) {
  TORCH_CHECK(gat.entries.empty() || gat.device.is_cpu(), "fedopt_kernels cpu backend needs CPU tensors, got ",
              gat.device, " (use backend='cuda' or 'triton' for CUDA tensors)");
}

void sgd(const fo::GroupLists& lists, const fo::HpLists& hps, const at::Tensor& k, const at::Tensor& table,
         int64_t decay_every) {
  fo::Gathered gat = fo::gather(lists, fo::sgd_slots(), kBackend);
  check_cpu(gat);
  const auto hp = fo::sgd_hps(hps, gat, kBackend);
  TORCH_CHECK(k.is_cpu() && k.scalar_type() == at::kInt && k.numel() == 1, "fedopt_kernels cpu sgd: k must be a CPU int32 tensor [1]");
  TORCH_CHECK(table.is_cpu() && table.scalar_type() == at::kDouble && table.dim() == 1 && table.numel() >= 1,
              "fedopt_kernels cpu sgd: the schedule table must be a non-empty CPU float64 vector");
  TORCH_CHECK(decay_every >= 1, "fedopt_kernels cpu sgd: decay_every must be >= 1, got ", decay_every);
  const at::Tensor tab = table.contiguous();
  fo::cpu::sgd(gat.entries, hp, k.item<int32_t>(), tab.data_ptr<double>(), tab.numel(), decay_every);
  gat.finish();
}

void fednar(const fo::GroupLists& lists, const fo::HpLists& hps) {
  fo::Gathered gat = fo::gather(lists, fo::fednar_slots(), kBackend);
  check_cpu(gat);
  const auto hp = fo::fednar_hps(hps, gat, kBackend);
  fo::cpu::fednar(gat.entries, hp, gat.any_f64);
  gat.finish();
}

void padamfed(const fo::GroupLists& lists, const fo::HpLists& hps) {
  fo::Gathered gat = fo::gather(lists, fo::padamfed_slots(), kBackend);
  check_cpu(gat);
  const auto hp = fo::padamfed_hps(hps, gat, kBackend);
  fo::cpu::padamfed(gat.entries, hp, gat.any_f64);
  gat.finish();
}

// Which copy of the chunk code runs: "auto" (default: AVX2 when the CPU has it), "base" or "avx2".
// Both give the same bits; tests use this to check that.
std::string set_isa(const std::string& name) {
  TORCH_CHECK(name == "auto" || name == "base" || name == "avx2", "isa must be 'auto', 'base' or 'avx2', got '",
              name, "'");
  TORCH_CHECK(fo::cpu::set_isa(name.c_str()), "isa '", name, "' is not available on this CPU / build");
  return fo::cpu::active_isa();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fedopt_kernels C++ CPU kernels (see csrc/)";
  m.def("sgd", &sgd, "op sgd: FedDecaySGD / NeuronLRSGD step", py::arg("lists"), py::arg("hps"), py::arg("k"),
        py::arg("table"), py::arg("decay_every"));
  m.def("fednar", &fednar, "op fednar: FedNAR step", py::arg("lists"), py::arg("hps"));
  m.def("padamfed", &padamfed, "op padamfed: PAdaMFed client step", py::arg("lists"), py::arg("hps"));
  m.def("set_isa", &set_isa, "choose the kernels' instruction set; returns the active one", py::arg("name"));
  m.def("active_isa", []() { return std::string(fo::cpu::active_isa()); });
  m.attr("chunk_elements") = fo::cpu::kChunk;
}
