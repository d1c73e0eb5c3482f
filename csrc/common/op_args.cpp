#include "op_args.h"

#include <c10/util/Exception.h>

#include <string>

namespace fo {

OpDesc describe(const char* name, const RoleDecl* roles, int nroles, const char* const* hps, int nhps) {
  OpDesc d{name, {}, {hps, hps + nhps}};
  for (int i = 0; i < nroles; ++i)
    d.slots.push_back({roles[i].name, roles[i].state_typed ? SlotKind::State : SlotKind::Param, roles[i].written,
                       roles[i].per_row, roles[i].bit});
  return d;
}

static void check_amp(const c10::optional<at::Tensor>& t, const char* name, const at::Device& dev, const char* op,
                      const char* backend) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1 && t->device() == dev, "fedopt_kernels ", backend, " ",
              op, ": ", name, " must be a float32 tensor with one element on ", dev, ", got ",
              dtype_name(t->scalar_type()), " ", t->sizes(), " on ", t->device());
}

StepScalars check_scalars(const OpDesc& op, const Gathered& gat, const at::Tensor& hp, const at::Tensor& k,
                          const at::Tensor& table, int64_t decay_every, const c10::optional<at::Tensor>& grad_scale,
                          const c10::optional<at::Tensor>& found_inf, const char* backend, int64_t clients,
                          const c10::optional<at::Tensor>& active) {
  const at::Device dev = gat.entries.empty() ? k.device() : gat.device;
  const int64_t cols = static_cast<int64_t>(op.hps.size());
  const bool hp_ok = clients > 0 ? (hp.dim() == 3 && hp.size(1) == clients && hp.size(2) == cols)
                                 : (hp.dim() == 2 && hp.size(1) == cols);
  TORCH_CHECK(hp.scalar_type() == at::kDouble && hp_ok && hp.size(0) == gat.ngroups() && hp.is_contiguous() &&
                  hp.device() == dev,
              "fedopt_kernels ", backend, " ", op.name, ": hp must be a contiguous float64 tensor [", gat.ngroups(),
              clients > 0 ? ", clients" : "", ", ", cols, "] on ", dev, ", got ", dtype_name(hp.scalar_type()), " ",
              hp.sizes(), " on ", hp.device());
  const int64_t nk = clients > 0 ? clients : 1;
  TORCH_CHECK(k.scalar_type() == at::kInt && k.numel() == nk && k.is_contiguous() && k.device() == dev,
              "fedopt_kernels ", backend, " ", op.name, ": k must be a contiguous int32 tensor [", nk, "] on ", dev);
  const bool has_active = active.has_value() && active->defined();
  if (has_active)
    TORCH_CHECK(clients > 0 && active->scalar_type() == at::kBool && active->numel() == clients &&
                    active->is_contiguous() && active->device() == dev,
                "fedopt_kernels ", backend, " ", op.name, ": active must be a contiguous bool tensor [", clients,
                "] on ", dev);
  TORCH_CHECK(table.scalar_type() == at::kDouble && table.dim() == 1 && table.numel() >= 1 && table.is_contiguous() &&
                  table.device() == dev,
              "fedopt_kernels ", backend, " ", op.name, ": the schedule table must be a contiguous non-empty float64 "
              "vector on ", dev);
  TORCH_CHECK(decay_every >= 1, "fedopt_kernels ", backend, " ", op.name, ": decay_every must be >= 1, got ",
              decay_every);
  check_amp(grad_scale, "grad_scale", dev, op.name, backend);
  check_amp(found_inf, "found_inf", dev, op.name, backend);
  StepScalars s{};
  s.hp = hp.data_ptr<double>();
  s.hp_cols = cols;
  s.k = const_cast<at::Tensor&>(k).data_ptr<int32_t>();
  s.table = table.data_ptr<double>();
  s.table_len = table.numel();
  s.decay_every = decay_every;
  s.grad_scale = grad_scale.has_value() && grad_scale->defined() ? grad_scale->data_ptr<float>() : nullptr;
  s.found_inf = found_inf.has_value() && found_inf->defined() ? found_inf->data_ptr<float>() : nullptr;
  s.clients = clients;
  s.active = has_active ? active->data_ptr<bool>() : nullptr;
  return s;
}

}  // namespace fo
