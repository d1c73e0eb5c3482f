// Host helpers shared by the ops: norm slot count, the step-counter kernel, the device probe.
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"

namespace fo {
namespace cuda {

namespace {
__global__ void probe_kernel() {}

// k += 1 unless GradScaler skipped the step; launched after every kernel of the step that reads k
__global__ void advance_kernel(int32_t* k, const float* found_inf) {
  if (!(found_inf && *found_inf != 0.0f)) *k += 1;
}
}  // namespace

int64_t norm_slots(const Entry* entries, int n) {
  int64_t s = 0;
  for (int e = 0; e < n; ++e) s += chunks_of(entries[e]);
  return s;
}

cudaError_t advance(const DeviceScalars& s, cudaStream_t stream) {
  advance_kernel<<<1, 1, 0, stream>>>(s.k, s.found_inf);
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
