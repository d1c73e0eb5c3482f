// What a two-pass op's struct (two_pass.cuh) takes from its generated spec (op_table.h spec::<op>:
// roles, state-typed slots) and its hp struct (common/<op>_hp.h: Hp::of, factor); the op adds
// its chunk code, which walks its chunk with walk_chunk. MaxTensors sizes its table to the 4 KiB
// kernel-argument limit.
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

// One thread's walk over a chunk of n elements, the same with and without vector accesses
// (norm_chunk.cuh): its vectors v = t, t + kBlock, ... in groups of kIlp, each group first loaded
// (load(regs, u, j) for vector u of the group, first element j = 4v) and then computed
// (math(regs, u, j)) with the group's registers Regs, then its tail elements j = 4 * (n / 4) + t,
// ... one by one (tail(j)).
template <class Regs, class Load, class Math, class Tail>
__device__ __forceinline__ void walk_chunk(int n, Load&& load, Math&& math, Tail&& tail) {
  const int nvec = n / kVec;
  for (int v0 = threadIdx.x; v0 < nvec; v0 += kBlock * kIlp) {
    Regs r;
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int v = v0 + u * kBlock;
      if (v < nvec) load(r, u, v * kVec);
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int v = v0 + u * kBlock;
      if (v < nvec) math(r, u, v * kVec);
    }
  }
  for (int j = nvec * kVec + threadIdx.x; j < n; j += kBlock) tail(j);
}

}  // namespace cuda
}  // namespace fo
