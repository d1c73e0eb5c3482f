// Python module fedopt_kernels._C_cpu: the ops on CPU tensors (argument layout: common/op_args.h).
// pybind11 + tensor casters only: a fraction of torch/extension.h's compile time
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "../common/binding.h"
#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

// The CPU device for common/binding.h: scalars are host memory, so they are read directly.
struct Cpu {
  static constexpr const char* kName = "cpu";

  static void check_device(const fo::Gathered& gat, const at::Tensor& k) {
    TORCH_CHECK(gat.entries.empty() || gat.device.is_cpu(), "fedopt_kernels cpu backend needs CPU tensors, got ",
                gat.device, " (use backend='cuda' or 'triton' for CUDA tensors)");
    TORCH_CHECK(k.is_cpu(), "fedopt_kernels cpu backend: k must be a CPU tensor");
  }

  // the per-batch hp structs, or false when GradScaler found an inf (the step then does nothing)
  template <class Hp, class Make>
  static bool rows(const fo::Gathered& gat, const fo::StepScalars& sc, Make make, std::vector<Hp>& out) {
    if (sc.found_inf && *sc.found_inf != 0.0f) return false;
    const bool unscale = sc.grad_scale != nullptr;
    const double inv = unscale ? fo::inv_scale_of(*sc.grad_scale) : 1.0;
    out.clear();
    for (int64_t b = 0; b < gat.nbatches(); ++b) out.push_back(make(sc.hp + b * sc.hp_cols, gat.present[b], unscale, inv));
    return true;
  }

  static void run(fo::SgdOp, fo::Gathered& gat, const fo::StepScalars& sc) {
    std::vector<fo::SgdHp> hp;
    if (!rows(gat, sc, fo::sgd_hp_of, hp)) return;
    fo::cpu::sgd(gat.entries, hp, *sc.k, sc.table, sc.table_len, sc.decay_every);
    ++*sc.k;
  }
  static void run(fo::FedNarOp, fo::Gathered& gat, const fo::StepScalars& sc) {
    std::vector<fo::FedNarHp> hp;
    if (!rows(gat, sc, fo::fednar_hp_of, hp)) return;
    fo::cpu::fednar(gat.entries, hp, gat.any_f64);
    ++*sc.k;
  }
  static void run(fo::PAdamOp, fo::Gathered& gat, const fo::StepScalars& sc) {
    std::vector<fo::PAdamHp> hp;
    if (!rows(gat, sc, fo::padamfed_hp_of, hp)) return;
    fo::cpu::padamfed(gat.entries, hp, gat.any_f64);
    ++*sc.k;
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fedopt_kernels C++ CPU kernels (see csrc/)";
  fo::bind_ops<Cpu>(m);
  m.def("set_isa", &set_isa, "choose the kernels' instruction set; returns the active one", py::arg("name"));
  m.def("active_isa", []() { return std::string(fo::cpu::active_isa()); });
  m.attr("chunk_elements") = fo::cpu::kChunk;
}
