// Op "fedexp"'s hyperparameters (FedExP: FedExpHp and its step factor), as both the CPU and the CUDA
// kernels read them (conventions: common/fo_hp.h).
#pragma once

#include <cstdint>

#include "fo_hp.h"

namespace fo {

struct FedExpHp {
  double lr, eps, mean_sq_norm, inv_scale;
  FO_HD static FedExpHp of(const double* r, int32_t present, bool unscale, double inv);

  // the factor (common/fo_hp.h factor) in the norm dtype N: lr * eta_g with
  // eta_g = max(1, mean_sq_norm / (2 (s^2 + eps))) formed in double from the double norm and rounded
  // once (reference/fedexp.py); `q < 1 ? 1 : q` keeps a NaN, like torch.clamp
  template <class N>
  FO_HD N factor_in(double norm) const {
    const double q = mean_sq_norm / (2.0 * (norm * norm + eps));
    const double eta = q < 1.0 ? 1.0 : q;
    return static_cast<N>(lr * eta);
  }
};

FO_HD FedExpHp FedExpHp::of(const double* r, int32_t present, bool unscale, double inv) {
  (void)present;  // no optional role
  return FedExpHp{r[fedexp_hp::LR], r[fedexp_hp::EPS], r[fedexp_hp::MEAN_SQ_NORM], unscale ? inv : 1.0};
}

}  // namespace fo
