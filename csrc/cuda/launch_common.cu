// Host helpers shared by the ops: norm slot count, the step-counter kernel, the device probe.
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"

namespace fo {
namespace cuda {

namespace {
__global__ void probe_kernel() {}

// k[c] += 1 for every active client unless GradScaler skipped the step; launched after every
// kernel of the step that reads k
__global__ void advance_kernel(int32_t* k, const float* found_inf, const bool* active, int64_t clients) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= clients || (found_inf && *found_inf != 0.0f) || (active && !active[c])) return;
  k[c] += 1;
}
}  // namespace

int64_t norm_slots(const Entry* entries, int n) {
  int64_t s = 0;
  for (int e = 0; e < n; ++e) s += chunks_of(entries[e]);
  return s;
}

int64_t two_pass_scratch(const Entry* entries, int n, int ngroups, int64_t clients) {
  return clients * (norm_slots(entries, n) + 1 + ngroups);
}

cudaError_t advance(const DeviceScalars& s, cudaStream_t stream) {
  constexpr int64_t kThreads = 256;
  const int64_t threads = s.clients < kThreads ? s.clients : kThreads;
  const int64_t blocks = (s.clients + kThreads - 1) / kThreads;
  if (s.clients < 1 || blocks > INT_MAX) return cudaErrorInvalidValue;
  advance_kernel<<<static_cast<unsigned>(blocks), static_cast<unsigned>(threads), 0, stream>>>(
      s.k, s.found_inf, s.active, s.clients);
  return cudaGetLastError();
}

cudaError_t probe_current_device() {
  cudaFuncAttributes attr;
  const cudaError_t err = cudaFuncGetAttributes(&attr, probe_kernel);
  if (err != cudaSuccess) (void)cudaGetLastError();  // leave no error behind for the next launch
  return err;
}

}  // namespace cuda
}  // namespace fo
