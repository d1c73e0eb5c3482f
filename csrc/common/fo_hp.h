// Per-row-group hyperparameters and the per-step scalars derived from them: what every op shares (FO_HD,
// GradScaler's factor) and the conventions of each op's own common/<op>_hp.h.
//
// Every function here and there is __host__ __device__: the CPU backend runs exactly the code the
// CUDA kernels run for lr_k, the GradScaler factor and the clip / normalisation factors, so CPU tests
// cover it. The rounding follows the reference (torch) step by step: Python floats meet float32
// tensors as float32, and ``scalar / tensor`` is ``tensor.reciprocal() * scalar`` in torch.
#pragma once

#include <cmath>
#include <cstdint>

#include "fo_entry.h"

#if defined(__CUDACC__)
#define FO_HD __host__ __device__ __forceinline__
#else
#define FO_HD inline
#endif

namespace fo {

// An op's common/<op>_hp.h holds its structural switches (which optional tensors a row group has, which
// terms are non-zero: a zero term is skipped, so 0 * inf never turns into NaN) and its struct, built
// from one float64 hp row (columns: op_table.h <op>_hp) by `of(row, present, unscale, inv)`, with
// `present` the row group's mask of optional roles (op_table.h <op>_bit) and `inv` GradScaler's factor
// when `unscale`. A norm op's struct adds `factor_in<N>(norm)`, its per-row-group factor in the dtype N
// (`factor` below).

// GradScaler: gradients are multiplied by the float32 reciprocal of the scale, formed in double and
// rounded once (torch.amp.GradScaler.unscale_: scale.double().reciprocal().float()).
FO_HD double inv_scale_of(float scale) { return static_cast<double>(static_cast<float>(1.0 / static_cast<double>(scale))); }

// A norm op's per-row-group factor. The norm is always accumulated in float64 (no overflow / underflow
// for elements in [1e-30, 1e30]); the dtype it is *used* in is float64 when any parameter is
// float64, else float32, and each tensor rounds the factor to its compute type (torch's
// `.to(d.dtype)`).
template <class Hp>
FO_HD double factor(double norm, const Hp& hp, bool norm_f64) {
  return norm_f64 ? hp.template factor_in<double>(norm) : static_cast<double>(hp.template factor_in<float>(norm));
}

}  // namespace fo
