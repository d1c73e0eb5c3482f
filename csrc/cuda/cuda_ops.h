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

// Number of per-chunk norm partial slots the two-pass ops need for these entries.
int64_t norm_slots(const Entry* entries, int n);

cudaError_t sgd(const Entry* entries, int n, const SgdHp* hps, int ngroups, const int32_t* k, const double* table,
                int64_t table_len, int64_t decay_every, cudaStream_t stream);

// `scratch`: device float64 buffer of norm_slots(entries, n) + 1 + ngroups values
// (per-chunk partials, the norm, each group's factor).
cudaError_t fednar(const Entry* entries, int n, const FedNarHp* hps, int ngroups, bool norm_f64, double* scratch,
                   cudaStream_t stream);

cudaError_t padamfed(const Entry* entries, int n, const PAdamHp* hps, int ngroups, bool norm_f64, double* scratch,
                     cudaStream_t stream);

// cudaSuccess when this build has a kernel image the current device can run.
cudaError_t probe_current_device();

}  // namespace cuda
}  // namespace fo
