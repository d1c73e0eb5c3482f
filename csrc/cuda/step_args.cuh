// Device-side reading of an op's scalars (cuda_ops.h DeviceScalars): whether the step is skipped,
// GradScaler's factor, a client's hp row, counter and active flag. Nothing is read on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_ops.h"

namespace fo {
namespace cuda {

// GradScaler found an inf/NaN gradient: the step changes nothing (a whole block leaves together)
__device__ __forceinline__ bool skipped(const DeviceScalars& s) { return s.found_inf && *s.found_inf != 0.0f; }

// client c sits this step out (batched ops' active mask)
__device__ __forceinline__ bool inactive(const DeviceScalars& s, int c) { return s.active && !s.active[c]; }

__device__ __forceinline__ double inv_scale(const DeviceScalars& s) {
  return s.grad_scale ? inv_scale_of(*s.grad_scale) : 1.0;
}

// client c's row of the hp tensor for this row group: hp viewed as [ngroups * clients, cols]
__device__ __forceinline__ const double* hp_row(const DeviceScalars& s, int group, int c) {
  return s.hp + (static_cast<int64_t>(group) * s.clients + c) * s.hp_cols;
}

}  // namespace cuda
}  // namespace fo
