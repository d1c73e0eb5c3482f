// The ops as the C++ bindings see them: each op's roles (slots) and hp columns, from the generated
// op_table.h (fedopt_kernels/core/ops.py), and the check of the scalar arguments every op takes (hp
// rows, the step counter k, the schedule table, GradScaler's grad_scale / found_inf). The argument
// layout is fedopt_kernels/core/ops.py's schema:
//
//   op(params, grads, <optional roles, compacted>..., row_of, present, hp, k, table, decay_every,
//      grad_scale, found_inf)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "fo_hp.h"
#include "gather.h"

namespace fo {

struct OpDesc {
  const char* name;
  std::vector<SlotSpec> slots;
  std::vector<const char*> hps;
};

// The description of a generated op spec (op_table.h spec::<op>), or of its client-batched form
// (docs/client_batched.md: the same roles and hp columns, named "<op>_batched").
OpDesc describe(const char* name, const RoleDecl* roles, int nroles, const char* const* hps, int nhps);

// An op as the bindings and devices see it: Spec is op_table.h's spec::<op>, Batched its
// client-batched form.
template <class Spec, bool Batched>
struct OpTag {
  static const OpDesc& desc() {
    static const OpDesc d = describe(Batched ? Spec::kBatchedName : Spec::kName, Spec::kRoles, Spec::kSlots,
                                     Spec::kHpNames, Spec::kHps);
    return d;
  }
};

// Pointers to the validated scalar arguments (host pointers for CPU tensors, device pointers for
// CUDA tensors: the CUDA kernels read them on the device, so nothing is copied to the host).
struct StepScalars {
  const double* hp;        // [ngroups, hp_cols], row-major
  int64_t hp_cols;
  int32_t* k;              // within-round step counter, advanced by one unless found_inf
  const double* table;     // within-round schedule s(j)
  int64_t table_len;
  int64_t decay_every;
  const float* grad_scale; // nullable: gradients are divided by it
  const float* found_inf;  // nullable: non-zero skips the step
  int64_t clients = 0;     // batched ops: C (hp is [row groups, C, cols], k and active are [C])
  const bool* active = nullptr;  // batched ops, nullable: false leaves that client untouched
};

// `clients` > 0 checks the batched layout and `active`.
StepScalars check_scalars(const OpDesc& op, const Gathered& gat, const at::Tensor& hp, const at::Tensor& k,
                          const at::Tensor& table, int64_t decay_every, const c10::optional<at::Tensor>& grad_scale,
                          const c10::optional<at::Tensor>& found_inf, const char* backend, int64_t clients = 0,
                          const c10::optional<at::Tensor>& active = c10::nullopt);

}  // namespace fo
