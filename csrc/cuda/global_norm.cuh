// Second phase of the deterministic global norm, and the per-group factors that depend on it.
//
// One block adds the per-chunk partials (float64 slots written by an op's norm pass) in a fixed
// order, takes the square root, and evaluates each group's clip / normalisation factor with the
// same __host__ __device__ function the CPU backend uses (common/fo_hp.h). The update pass then
// just reads its group's factor: no host sync, and no division in the streaming kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "block_reduce.cuh"
#include "multi_tensor_apply.cuh"

namespace fo {
namespace cuda {

constexpr int kFinalThreads = 512;

template <class Hp>
struct FinalizeArgs {
  static constexpr int kMaxGroups = 64;
  Hp hp[kMaxGroups];
  int32_t ngroups;    // groups in this launch
  int32_t first;      // op group index of hp[0]
  int32_t norm_f64;   // evaluate in float64 (some parameter is float64) or float32
};

// Scale: functor double(double norm, const Hp&, bool norm_f64)
template <class Hp, class Scale>
__global__ void __launch_bounds__(kFinalThreads) finalize_kernel(const double* partials, int64_t n, double* norm_out,
                                                                  double* scales, const __grid_constant__ FinalizeArgs<Hp> a) {
  __shared__ double norm;
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kFinalThreads) s += partials[i];  // thread t: slots t, t+512, ...
  s = block_sum<kFinalThreads>(s);
  if (threadIdx.x == 0) {
    norm = sqrt(s);
    if (a.first == 0) *norm_out = norm;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < a.ngroups; g += kFinalThreads) scales[a.first + g] = Scale()(norm, a.hp[g], a.norm_f64 != 0);
}

// scratch layout: [partials: slots][norm: 1][scales: ngroups]
template <class Hp, class Scale>
cudaError_t finalize(double* scratch, int64_t slots, const Hp* hps, int ngroups, bool norm_f64, cudaStream_t stream) {
  FinalizeArgs<Hp> a;
  a.norm_f64 = norm_f64 ? 1 : 0;
  for (int first = 0; first == 0 || first < ngroups; first += FinalizeArgs<Hp>::kMaxGroups) {
    a.first = first;
    a.ngroups = ngroups - first < FinalizeArgs<Hp>::kMaxGroups ? ngroups - first : FinalizeArgs<Hp>::kMaxGroups;
    for (int g = 0; g < a.ngroups; ++g) a.hp[g] = hps[first + g];
    finalize_kernel<Hp, Scale><<<1, kFinalThreads, 0, stream>>>(scratch, slots, scratch + slots, scratch + slots + 1, a);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace fo
