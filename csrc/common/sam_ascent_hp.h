// Op "sam_ascent"'s hyperparameters (FedSAM's ascent: its switches, SamHp and the ascent factor),
// as both the CPU and the CUDA kernels read them (conventions: common/fo_hp.h).
#pragma once

#include <cstdint>

#include "fo_hp.h"

namespace fo {

enum SamFlag : int32_t { kSamAdaptive = 1, kSamUnscale = 2 };

struct SamHp {
  double rho, eta, eps, inv_scale;
  int32_t flags;
  FO_HD static SamHp of(const double* r, int32_t present, bool unscale, double inv);

  // the factor (common/fo_hp.h factor) in the norm dtype N: rho / (s + eps), formed as torch
  // forms `scalar / tensor` (reciprocal, then multiply)
  template <class N>
  FO_HD N factor_in(double norm) const {
    const N s = static_cast<N>(norm);
    return (N(1) / (s + static_cast<N>(eps))) * static_cast<N>(rho);
  }
};

FO_HD SamHp SamHp::of(const double* r, int32_t present, bool unscale, double inv) {
  (void)present;  // the saved x is always there
  SamHp h{r[sam_ascent_hp::RHO], r[sam_ascent_hp::ETA], r[sam_ascent_hp::EPS], inv, 0};
  if (r[sam_ascent_hp::ADAPTIVE] != 0) h.flags |= kSamAdaptive;
  if (unscale) h.flags |= kSamUnscale;
  return h;
}

}  // namespace fo
