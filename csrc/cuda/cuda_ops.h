// Host entry points of the CUDA kernels. Plain C++ (no torch headers), so nvcc compiles the .cu
// files quickly; bindings_cuda.cpp calls these with pointers gathered from torch tensors.
// Each returns the first CUDA error of its launches (cudaSuccess when all went out). No op is named
// here: every op's step<spec::<op>> is declared from op_table.h's list.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../common/fo_entry.h"
#include "../common/fo_hp.h"

namespace fo {
namespace cuda {

// Device pointers to an op's scalar arguments (common/op_args.h StepScalars, on the GPU).
struct DeviceScalars {
  const double* hp;        // [ngroups, clients, hp_cols]
  int64_t hp_cols;
  int32_t* k;              // advanced by one after the step (not when found_inf is set)
  const double* table;
  int64_t table_len;
  int64_t decay_every;
  const float* grad_scale; // nullable
  const float* found_inf;  // nullable
  int64_t clients;         // C of a batched op (hp [ngroups, C, hp_cols], k [C]); 1 for a per-client op
  const bool* active;      // batched, nullable: [C], false leaves that client (and its k) untouched
};

// Number of per-chunk norm partial slots of one client for these entries.
int64_t norm_slots(const Entry* entries, int n);

// float64 scratch values a two-pass op needs: per (client, chunk) partials, each client's norm,
// each (row group, client)'s factor.
int64_t two_pass_scratch(const Entry* entries, int n, int ngroups, int64_t clients);

// One step's launch of any op. Per-client ops take s.clients = 1 and entries of whole tensors; the
// batched ops (docs/client_batched.md) take s.clients = C and one entry per stacked tensor
// [C, *shape] (numel and row_len per client, group = row group). Both run the same kernels.
struct Launch {
  const Entry* entries;
  int n;
  const int32_t* present;  // [ngroups]: row group b's optional roles (host memory: copied into the kernel tables)
  int ngroups;
  bool batched;            // the client-batched form (the only one that reads op_table.h kFreshBit)
  bool norm_f64;           // a norm op uses its norm in float64 (some parameter is float64)
  DeviceScalars s;
  double* scratch;         // a norm op (spec kNorm): device float64 buffer of two_pass_scratch(entries, n,
                           // ngroups, s.clients) values; null otherwise. Global norms are per client.
  cudaStream_t stream;
};

// The CUDA entry point of every op: fo::cuda::step<spec::<op>>(launch). Each op's own <op>.cu
// defines its specialisation; bindings_cuda.cpp calls it for every op op_table.h lists.
template <class Spec>
cudaError_t step(const Launch& l);

#define FO_CUDA_DECLARE_STEP(NAME) \
  template <>                      \
  cudaError_t step<spec::NAME>(const Launch& l);
FO_FOR_EACH_OP(FO_CUDA_DECLARE_STEP)
#undef FO_CUDA_DECLARE_STEP

// k[c] += 1 for every active client unless found_inf is set (after every kernel that reads k).
cudaError_t advance(const DeviceScalars& s, cudaStream_t stream);

// cudaSuccess when this build has a kernel image the current device can run.
cudaError_t probe_current_device();

}  // namespace cuda
}  // namespace fo
