// Host entry points of the CUDA kernels. Plain C++ (no torch headers), so nvcc compiles the .cu
// files quickly; bindings_cuda.cpp calls these with pointers gathered from torch tensors.
// Each returns the first CUDA error of its launches (cudaSuccess when all went out).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/fo_entry.h"
#include "../common/fo_hp.h"

namespace fo {
namespace cuda {

// Device pointers to an op's scalar arguments (common/op_args.h StepScalars, on the GPU).
struct DeviceScalars {
  const double* hp;        // [nbatches, hp_cols]
  int64_t hp_cols;
  int32_t* k;              // advanced by one after the step (not when found_inf is set)
  const double* table;
  int64_t table_len;
  int64_t decay_every;
  const float* grad_scale; // nullable
  const float* found_inf;  // nullable
};

// Number of per-chunk norm partial slots the two-pass ops need for these entries.
int64_t norm_slots(const Entry* entries, int n);

// present[b]: batch b's mask of optional roles (host memory: it is copied into the kernel tables).
cudaError_t sgd(const Entry* entries, int n, const int32_t* present, int nbatches, const DeviceScalars& s,
                cudaStream_t stream);

// `scratch`: device float64 buffer of norm_slots(entries, n) + 1 + nbatches values
// (per-chunk partials, the norm, each batch's factor).
cudaError_t fednar(const Entry* entries, int n, const int32_t* present, int nbatches, bool norm_f64,
                   const DeviceScalars& s, double* scratch, cudaStream_t stream);

cudaError_t padamfed(const Entry* entries, int n, const int32_t* present, int nbatches, bool norm_f64,
                     const DeviceScalars& s, double* scratch, cudaStream_t stream);

// k += 1 unless found_inf is set (for a step with no tensor to launch over).
cudaError_t advance(const DeviceScalars& s, cudaStream_t stream);

// cudaSuccess when this build has a kernel image the current device can run.
cudaError_t probe_current_device();

}  // namespace cuda
}  // namespace fo
