// Ops "fedexp" and "fedexp_batched" on CUDA: the per-chunk math of both passes (two_pass.cuh runs
// them, with one norm per client). Pass 1: g's float64 sum of squares; pass 2: x -= factor * g, with
// the (row group, client)'s lr * max(1, mean_sq_norm / (2 (norm^2 + eps))) formed once on the device
// (common/fedexp_hp.h, the code the CPU backend also runs). The per-chunk math is ExpOp (fedexp_op.cuh).
#include "fedexp_op.cuh"
#include "two_pass.cuh"

FO_CUDA_TWO_PASS_OP(fedexp, ExpOp)
