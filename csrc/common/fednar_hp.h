// Op "fednar"'s hyperparameters (its switches, FedNarHp and the clip factor), as both the CPU
// and the CUDA kernels read them (conventions: common/fo_hp.h).
#pragma once

#include <cstdint>

#include "fo_hp.h"

namespace fo {

enum FedNarFlag : int32_t { kNarWeightDecay = 1, kNarCorrection = 2, kNarProx = 4, kNarUnscale = 8 };

struct FedNarHp {
  double lr, weight_decay, max_norm, eps, prox_mu, inv_scale;
  int32_t flags;
  FO_HD static FedNarHp of(const double* r, int32_t present, bool unscale, double inv);

  // the factor (common/fo_hp.h factor) in the norm dtype N: coef = clamp(max_norm / (s + eps),
  // max=1), factor = lr * coef; `q > 1 ? 1 : q` keeps NaN, like torch.clamp
  template <class N>
  FO_HD N factor_in(double norm) const {
    const N s = static_cast<N>(norm);
    const N q = (N(1) / (s + static_cast<N>(eps))) * static_cast<N>(max_norm);
    const N coef = q > N(1) ? N(1) : q;
    return static_cast<N>(lr) * coef;
  }
};

FO_HD FedNarHp FedNarHp::of(const double* r, int32_t present, bool unscale, double inv) {
  FedNarHp h{r[fednar_hp::LR], r[fednar_hp::WEIGHT_DECAY], r[fednar_hp::MAX_NORM], r[fednar_hp::EPS],
             r[fednar_hp::PROX_MU], inv, 0};
  if (h.weight_decay != 0) h.flags |= kNarWeightDecay;
  if (present & fednar_bit::X0) h.flags |= kNarProx;
  if (present & fednar_bit::CORR) h.flags |= kNarCorrection;
  if (unscale) h.flags |= kNarUnscale;
  return h;
}

}  // namespace fo
