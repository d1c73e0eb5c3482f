// Op "padamfed"'s hyperparameters (its switches, PAdamHp and the normalisation factor), as both the CPU
// and the CUDA kernels read them (conventions: common/fo_hp.h).
#pragma once

#include <cstdint>

#include "fo_hp.h"

namespace fo {

enum PAdamFlag : int32_t { kPadVarianceReduction = 1, kPadUnscale = 2 };


struct PAdamHp {
  double lr, beta, one_minus_beta, eps, inv_scale;
  int32_t flags;
  FO_HD static PAdamHp of(const double* r, int32_t present, bool unscale, double inv);

  // the factor (common/fo_hp.h factor) in the norm dtype N: n = clamp(||v||, min=eps),
  // factor = lr / n (NaN kept)
  template <class N>
  FO_HD N factor_in(double norm) const {
    const N s = static_cast<N>(norm);
    const N e = static_cast<N>(eps);
    const N n = s < e ? e : s;
    return (N(1) / n) * static_cast<N>(lr);
  }
};

FO_HD PAdamHp PAdamHp::of(const double* r, int32_t present, bool unscale, double inv) {
  const double beta = r[padamfed_hp::BETA];
  PAdamHp h{r[padamfed_hp::LR], beta, 1.0 - beta, r[padamfed_hp::EPS], inv, 0};
  if (present & padamfed_bit::H) h.flags |= kPadVarianceReduction;
  if (unscale) h.flags |= kPadUnscale;
  return h;
}

}  // namespace fo
