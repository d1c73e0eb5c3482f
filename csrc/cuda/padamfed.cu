// Ops "padamfed" and "padamfed_batched" on CUDA: the per-chunk math of both passes (two_pass.cuh
// runs them, with one norm per client). Pass 1: G = g * inv_scale, v = beta*G + D
// (VR: (G + D) - (1-beta)*H), acc += G, the float64 sum of squares of v; pass 2:
// x -= v * (eta / max(norm, eps)), the factor formed once on the device.
// The per-chunk math is PadOp (padamfed_op.cuh).
#include "padamfed_op.cuh"
#include "two_pass.cuh"

FO_CUDA_TWO_PASS_OP(padamfed, PadOp)
