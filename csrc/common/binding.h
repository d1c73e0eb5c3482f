// The one binding template both extensions use: every op of the package becomes a Python function
// `_C_<device>.<op>(lists, batch, present, hp, k, table, decay_every, grad_scale, found_inf)` that
// gathers the tensors, checks the scalars and hands both to the device's kernels (`Dev::run`).
// `op_signature(op)` exports each op's role and hp names for the test that holds them against
// fedopt_kernels/_ops.py.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <vector>

#include "op_args.h"

namespace fo {

template <class Dev, class Op>
void run_op(const RoleLists& lists, const std::vector<int64_t>& batch, const std::vector<int64_t>& present,
            const at::Tensor& hp, const at::Tensor& k, const at::Tensor& table, int64_t decay_every,
            const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
  const OpDesc& d = Op::desc();
  Gathered gat = gather(lists, batch, present, d.slots, d.name, Dev::kName);
  if (gat.entries.empty()) gat.device = k.device();  // nothing to update: k still advances
  Dev::check_device(gat, k);
  const StepScalars sc = check_scalars(d, gat, hp, k, table, decay_every, grad_scale, found_inf, Dev::kName);
  Dev::run(Op{}, gat, sc);
  gat.finish();
}

// the batched form: one more argument (active), and the client count from the hp tensor [B, C, cols]
template <class Dev, class Op>
void run_batched_op(const RoleLists& lists, const std::vector<int64_t>& batch, const std::vector<int64_t>& present,
                    const at::Tensor& hp, const at::Tensor& k, const at::Tensor& table, int64_t decay_every,
                    const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf,
                    const c10::optional<at::Tensor>& active) {
  const OpDesc& d = Op::desc();
  TORCH_CHECK(hp.dim() == 3, "fedopt_kernels ", Dev::kName, " ", d.name, ": hp must be [batches, clients, ",
              d.hps.size(), "], got ", hp.sizes());
  const int64_t clients = hp.size(1);
  Gathered gat = gather(lists, batch, present, d.slots, d.name, Dev::kName, clients);
  if (gat.entries.empty()) gat.device = k.device();
  Dev::check_device(gat, k);
  const StepScalars sc = check_scalars(d, gat, hp, k, table, decay_every, grad_scale, found_inf, Dev::kName,
                                       clients, active);
  Dev::run(Op{}, gat, sc);
  gat.finish();
}

template <class Op>
std::pair<std::vector<std::string>, std::vector<std::string>> signature_of() {
  std::vector<std::string> roles, hps;
  for (const auto& s : Op::desc().slots) roles.emplace_back(s.name);
  for (const char* h : Op::desc().hps) hps.emplace_back(h);
  return {roles, hps};
}

template <class Dev>
void bind_ops(pybind11::module& m) {
  namespace py = pybind11;
  auto def = [&](auto fn, const char* name) {
    m.def(name, fn, "one step of this op (argument layout: fedopt_kernels/_ops.py)", py::arg("lists"),
          py::arg("batch"), py::arg("present"), py::arg("hp"), py::arg("k"), py::arg("table"),
          py::arg("decay_every"), py::arg("grad_scale"), py::arg("found_inf"));
  };
  def(&run_op<Dev, SgdOp>, SgdOp::desc().name);
  def(&run_op<Dev, FedNarOp>, FedNarOp::desc().name);
  def(&run_op<Dev, PAdamOp>, PAdamOp::desc().name);
  m.def("op_signature", [](const std::string& op) {
    if (op == SgdBatchedOp::desc().name) return signature_of<SgdBatchedOp>();
    if (op == FedNarBatchedOp::desc().name) return signature_of<FedNarBatchedOp>();
    if (op == PAdamBatchedOp::desc().name) return signature_of<PAdamBatchedOp>();
    if (op == SgdOp::desc().name) return signature_of<SgdOp>();
    if (op == FedNarOp::desc().name) return signature_of<FedNarOp>();
    if (op == PAdamOp::desc().name) return signature_of<PAdamOp>();
    throw py::value_error("unknown op '" + op + "'");
  }, "(role names, hp names) of an op as the kernels index them", py::arg("op"));
}

// The batched ops, for a device that implements Dev::run for SgdBatchedOp, FedNarBatchedOp and
// PAdamBatchedOp (call after bind_ops).
template <class Dev>
void bind_batched_ops(pybind11::module& m) {
  namespace py = pybind11;
  auto def = [&](auto fn, const char* name) {
    m.def(name, fn, "one step of this client-batched op (argument layout: fedopt_kernels/_ops.py)", py::arg("lists"),
          py::arg("batch"), py::arg("present"), py::arg("hp"), py::arg("k"), py::arg("table"),
          py::arg("decay_every"), py::arg("grad_scale"), py::arg("found_inf"), py::arg("active"));
  };
  def(&run_batched_op<Dev, SgdBatchedOp>, SgdBatchedOp::desc().name);
  def(&run_batched_op<Dev, FedNarBatchedOp>, FedNarBatchedOp::desc().name);
  def(&run_batched_op<Dev, PAdamBatchedOp>, PAdamBatchedOp::desc().name);
}

}  // namespace fo
