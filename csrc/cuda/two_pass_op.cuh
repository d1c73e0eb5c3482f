// What a two-pass op's struct (two_pass.cuh) takes from its generated spec (op_table.h spec::<op>:
// roles, state-typed slots) and its hp struct (common/fo_hp.h: Hp::of, norm_factor); the op adds
// its chunk code. MaxTensors sizes its table to the 4 KiB kernel-argument limit.
#pragma once

#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"

namespace fo {
namespace cuda {

template <class Spec, class HpT, int MaxTensors>
struct TwoPassOp {
  using TableT = Table<Spec::kSlots, MaxTensors, 16>;
  using Hp = HpT;
  static constexpr const bool* kStateSlot = Spec::kStateSlot;
};

}  // namespace cuda
}  // namespace fo
