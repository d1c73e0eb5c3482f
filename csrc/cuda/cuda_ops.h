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
  const double* hp;        // [nbatches, clients, hp_cols]
  int64_t hp_cols;
  int32_t* k;              // advanced by one after the step (not when found_inf is set)
  const double* table;
  int64_t table_len;
  int64_t decay_every;
  const float* grad_scale; // nullable
  const float* found_inf;  // nullable
  int64_t clients;         // C of a batched op (hp [nbatches, C, hp_cols], k [C]); 1 for a per-client op
  const bool* active;      // batched, nullable: [C], false leaves that client (and its k) untouched
};

// Number of per-chunk norm partial slots of one client for these entries.
int64_t norm_slots(const Entry* entries, int n);

// float64 scratch values a two-pass op needs: per (client, chunk) partials, each client's norm,
// each (batch, client)'s factor.
int64_t two_pass_scratch(const Entry* entries, int n, int nbatches, int64_t clients);

// present[b]: batch b's mask of optional roles (host memory: it is copied into the kernel tables).
// Per-client ops take s.clients = 1 and entries of whole tensors; the batched ops (docs/client_batched.md) take
// s.clients = C and one entry per stacked tensor [C, *shape] (numel and row_len per client, group
// = batch). Both run the same kernels.
cudaError_t sgd(const Entry* entries, int n, const int32_t* present, int nbatches, const DeviceScalars& s,
                cudaStream_t stream);
// as sgd, and a batch with the FRESH bit (op_table.h kFreshBit) gives a client at k == 0 buf = d
cudaError_t sgd_batched(const Entry* entries, int n, const int32_t* present, int nbatches, const DeviceScalars& s,
                        cudaStream_t stream);

// `scratch`: device float64 buffer of two_pass_scratch(entries, n, nbatches, s.clients) values.
// Global norms are per client.
cudaError_t fednar(const Entry* entries, int n, const int32_t* present, int nbatches, bool norm_f64,
                   const DeviceScalars& s, double* scratch, cudaStream_t stream);

cudaError_t padamfed(const Entry* entries, int n, const int32_t* present, int nbatches, bool norm_f64,
                     const DeviceScalars& s, double* scratch, cudaStream_t stream);

// k[c] += 1 for every active client unless found_inf is set (after every kernel that reads k).
cudaError_t advance(const DeviceScalars& s, cudaStream_t stream);

// cudaSuccess when this build has a kernel image the current device can run.
cudaError_t probe_current_device();

}  // namespace cuda
}  // namespace fo
