// Ops "fednar" and "fednar_batched" on CUDA: the per-chunk math of both passes (two_pass.cuh runs
// them, with one norm per client). Pass 1: d and its float64 sum of squares; pass 2:
// x -= factor * d, with the (batch, client)'s step_lr * min(1, max_norm / (norm + eps)) formed once
// on the device (common/fo_hp.h, the code the CPU backend also runs).
// The per-chunk math is NarOp (fednar_op.cuh).
#include "cuda_ops.h"
#include "fednar_op.cuh"
#include "two_pass.cuh"

namespace fo {
namespace cuda {

cudaError_t fednar(const Entry* entries, int n, const int32_t* present, int nbatches, bool norm_f64,
                   const DeviceScalars& s, double* scratch, cudaStream_t stream) {
  return two_pass<NarOp>(entries, n, present, nbatches, norm_f64, s, scratch, stream);
}

}  // namespace cuda
}  // namespace fo
