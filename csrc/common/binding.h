// The one binding template both extensions use: every op of op_table.h (generated from
// fedopt_kernels/core/ops.py) becomes a Python function
// `_C_<device>.<op>(lists, row_of, present, hp, k, table, decay_every, grad_scale, found_inf, scratch=None)`,
// and its client-batched form `<op>_batched(..., active, scratch=None)`, that gathers the tensors, checks the scalars and
// hands both to the device's kernels (`Dev::run(OpTag<spec::<op>, batched>{}, gathered, scalars, scratch)`).
// `op_signature(op)` / `op_layout(op)` export each op's layout as the kernels index it, for the test
// that holds the built extension against fedopt_kernels/core/ops.py.
#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "grad_watch.h"
#include "op_args.h"

namespace fo {

// A device (Dev) names itself (kName), its tensors' device type (kDevice) and where else such
// tensors can go (kElsewhere, for the error message).
template <class Dev>
void check_device(const Gathered& gat, const at::Tensor& k) {
  TORCH_CHECK(gat.entries.empty() || gat.device.type() == Dev::kDevice, "fedopt_kernels ", Dev::kName,
              " backend needs ", c10::DeviceTypeName(Dev::kDevice), " tensors, got ", gat.device, " (",
              Dev::kElsewhere, ")");
  TORCH_CHECK(k.device().type() == Dev::kDevice, "fedopt_kernels ", Dev::kName, " backend: k must be a ",
              c10::DeviceTypeName(Dev::kDevice), " tensor");
}

// clients > 0: the batched form (hp [row groups, clients, cols], `active`). `scratch`: the device scratch
// a previous step returned (a norm op's float64 buffer), reused when it is big enough; returned is the
// scratch this step used (None where the device needs none), for the caller to hand back next time, so
// a step allocates nothing: an allocation per step moves where the caching allocator puts the next
// gradients, and a replayed step (fedopt_kernels/core/replay.py) needs them back at the same addresses.
template <class Dev, class Op>
c10::optional<at::Tensor> run_any(const RoleLists& lists, const std::vector<int64_t>& row_of,
                                  const std::vector<int64_t>& present, const at::Tensor& hp, const at::Tensor& k,
                                  const at::Tensor& table, int64_t decay_every,
                                  const c10::optional<at::Tensor>& grad_scale,
                                  const c10::optional<at::Tensor>& found_inf, int64_t clients,
                                  const c10::optional<at::Tensor>& active, const c10::optional<at::Tensor>& scratch) {
  const OpDesc& d = Op::desc();
  Gathered gat = gather(lists, row_of, present, d.slots, d.name, Dev::kName, clients);
  if (gat.entries.empty()) gat.device = k.device();  // nothing to update: k still advances
  check_device<Dev>(gat, k);
  const StepScalars sc = check_scalars(d, gat, hp, k, table, decay_every, grad_scale, found_inf, Dev::kName,
                                       clients, active);
  at::Tensor used = Dev::run(Op{}, gat, sc, scratch);
  gat.finish();
  if (!used.defined()) return c10::nullopt;
  return used;
}

template <class Dev, class Op>
c10::optional<at::Tensor> run_op(const RoleLists& lists, const std::vector<int64_t>& row_of,
                                 const std::vector<int64_t>& present, const at::Tensor& hp, const at::Tensor& k,
                                 const at::Tensor& table, int64_t decay_every,
                                 const c10::optional<at::Tensor>& grad_scale,
                                 const c10::optional<at::Tensor>& found_inf,
                                 const c10::optional<at::Tensor>& scratch) {
  return run_any<Dev, Op>(lists, row_of, present, hp, k, table, decay_every, grad_scale, found_inf, 0, c10::nullopt,
                          scratch);
}

// the batched form: one more argument (active), and the client count from the hp tensor [B, C, cols]
template <class Dev, class Op>
c10::optional<at::Tensor> run_batched_op(const RoleLists& lists, const std::vector<int64_t>& row_of,
                                         const std::vector<int64_t>& present, const at::Tensor& hp,
                                         const at::Tensor& k, const at::Tensor& table, int64_t decay_every,
                                         const c10::optional<at::Tensor>& grad_scale,
                                         const c10::optional<at::Tensor>& found_inf,
                                         const c10::optional<at::Tensor>& active,
                                         const c10::optional<at::Tensor>& scratch) {
  const OpDesc& d = Op::desc();
  TORCH_CHECK(hp.dim() == 3, "fedopt_kernels ", Dev::kName, " ", d.name, ": hp must be [row groups, clients, ",
              d.hps.size(), "], got ", hp.sizes());
  return run_any<Dev, Op>(lists, row_of, present, hp, k, table, decay_every, grad_scale, found_inf, hp.size(1), active,
                          scratch);
}

// (role names, hp names) as the kernels index them
using Signature = std::pair<std::vector<std::string>, std::vector<std::string>>;
// per role (name, state-typed, written, per-row, present bit: 0 for params and grads); hp names;
// FRESH's bit
using Layout = std::tuple<std::vector<std::tuple<std::string, bool, bool, bool, int64_t>>, std::vector<std::string>,
                          int64_t>;

template <class Spec>
Signature signature_of() {
  Signature s;
  for (const RoleDecl& r : Spec::kRoles) s.first.emplace_back(r.name);
  for (const char* h : Spec::kHpNames) s.second.emplace_back(h);
  return s;
}

template <class Spec>
Layout layout_of() {
  Layout out;
  for (const RoleDecl& r : Spec::kRoles)
    std::get<0>(out).emplace_back(r.name, r.state_typed, r.written, r.per_row, r.bit);
  std::get<1>(out) = signature_of<Spec>().second;
  std::get<2>(out) = kFreshBit;
  return out;
}

template <class Dev, class Spec>
void bind_op(pybind11::module& m) {
  namespace py = pybind11;
  const auto args = std::make_tuple(py::arg("lists"), py::arg("row_of"), py::arg("present"), py::arg("hp"),
                                    py::arg("k"), py::arg("table"), py::arg("decay_every"), py::arg("grad_scale"),
                                    py::arg("found_inf"));
  std::apply([&](auto... a) {
    m.def(Spec::kName, &run_op<Dev, OpTag<Spec, false>>,
          "one step of this op (argument layout: fedopt_kernels/core/ops.py); returns its device scratch",
          a..., py::arg("scratch") = py::none());
    m.def(Spec::kBatchedName, &run_batched_op<Dev, OpTag<Spec, true>>,
          "one step of this client-batched op (argument layout: fedopt_kernels/core/ops.py); returns its device "
          "scratch", a..., py::arg("active"), py::arg("scratch") = py::none());
  }, args);
}

// f(spec::<op>{}) for the op named `name` (or its batched form); ValueError for an unknown name
template <class F>
auto with_spec(const std::string& name, F&& f) {
#define FO_MATCH_OP(NAME) \
  if (name == spec::NAME::kName || name == spec::NAME::kBatchedName) return f(spec::NAME{});
  FO_FOR_EACH_OP(FO_MATCH_OP)
#undef FO_MATCH_OP
  throw pybind11::value_error("unknown op '" + name + "'");
}

// Every op of op_table.h and its batched form, for a device that implements Dev::run for each.
template <class Dev>
void bind_ops(pybind11::module& m) {
  namespace py = pybind11;
#define FO_BIND_OP(NAME) bind_op<Dev, spec::NAME>(m);
  FO_FOR_EACH_OP(FO_BIND_OP)
#undef FO_BIND_OP
  // the loader refuses a build made for another torch (its ABI and ops may differ)
  m.attr("built_for_torch") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                              std::to_string(TORCH_VERSION_PATCH);
  m.def("op_signature", [](const std::string& op) {
    return with_spec(op, [](auto s) { return signature_of<decltype(s)>(); });
  }, "(role names, hp names) of an op as the kernels index them", py::arg("op"));
  // the step plan's per-step check of the tensors it does not own (grad_watch.h)
  // module_local: _C_cpu and _C_cuda both bind it, and pybind11 types are process-global otherwise
  py::class_<GradWatch>(m, "GradWatch", py::module_local())
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>>(), py::arg("parameters"), py::arg("order"))
      .def("check", &GradWatch::check,
           "id of the gradients' address set when nothing the plan depends on changed, else -1")
      .def("accept", &GradWatch::accept, "take the current gradients and storages as seen; their address set id");
  m.def("op_layout", [](const std::string& op) {
    return with_spec(op, [](auto s) { return layout_of<decltype(s)>(); });
  }, "([(role, state_typed, written, per_row, present bit)], hp names, FRESH bit) of an op as this build's "
     "generated op_table.h declares it", py::arg("op"));
}

}  // namespace fo
