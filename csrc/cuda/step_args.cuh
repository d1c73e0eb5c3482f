// Device-side reading of an op's scalars (cuda_ops.h DeviceScalars): whether the step is skipped,
// and GradScaler's factor. Nothing is read on the host.
#pragma once

#include <cuda_runtime.h>

#include "cuda_ops.h"

namespace fo {
namespace cuda {

// GradScaler found an inf/NaN gradient: the step changes nothing (a whole block leaves together)
__device__ __forceinline__ bool skipped(const DeviceScalars& s) { return s.found_inf && *s.found_inf != 0.0f; }

__device__ __forceinline__ double inv_scale(const DeviceScalars& s) {
  return s.grad_scale ? inv_scale_of(*s.grad_scale) : 1.0;
}

// this batch's row of the hp tensor
__device__ __forceinline__ const double* hp_row(const DeviceScalars& s, int batch) { return s.hp + batch * s.hp_cols; }

}  // namespace cuda
}  // namespace fo
