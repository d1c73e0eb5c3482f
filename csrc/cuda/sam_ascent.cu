// Ops "sam_ascent" and "sam_ascent_batched" on CUDA, FedSAM's ascent: the per-chunk math of both
// passes (two_pass.cuh runs them, with one norm per client). Pass 1: d = w * g and its float64 sum
// of squares; pass 2: saved = x, x += (rho / (norm + eps)) * (w * d), the factor formed once on the
// device (common/sam_ascent_hp.h, the code the CPU backend also runs). The per-chunk math is SamOp
// (sam_ascent_op.cuh).
#include "sam_ascent_op.cuh"
#include "two_pass.cuh"

FO_CUDA_TWO_PASS_OP(sam_ascent, SamOp)
