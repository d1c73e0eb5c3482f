// Deterministic block sum: a fixed butterfly inside each warp, then warp 0 adds the warp sums in
// the same butterfly. The same inputs always give the same bits (no atomics, no timing effects).
#pragma once

#include <cuda_runtime.h>

namespace fo {
namespace cuda {

template <int Threads, class A>
__device__ __forceinline__ A block_sum(A v) {
  static_assert(Threads % 32 == 0 && Threads <= 1024, "whole warps, at most 32 of them");
  __shared__ A warp_sums[Threads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = A(0);
  if (warp == 0) {
    v = lane < Threads / 32 ? warp_sums[lane] : A(0);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;  // the block's sum in warp 0
}

}  // namespace cuda
}  // namespace fo
