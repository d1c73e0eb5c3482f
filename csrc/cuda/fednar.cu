// Ops "fednar" and "fednar_batched" on CUDA: the per-chunk math of both passes (two_pass.cuh runs
// them, with one norm per client). Pass 1: d and its float64 sum of squares; pass 2:
// x -= factor * d, with the (row group, client)'s lr * min(1, max_norm / (norm + eps)) formed once
// on the device (common/fednar_hp.h, the code the CPU backend also runs).
// The per-chunk math is NarOp (fednar_op.cuh).
#include "fednar_op.cuh"
#include "two_pass.cuh"

FO_CUDA_TWO_PASS_OP(fednar, NarOp)
