// Op "fedadam"'s hyperparameters (FedAdam / FedYogi / FedAdagrad: FedAdamHp and the per-step factors),
// as both the CPU and the CUDA kernels read them (conventions: common/fo_hp.h).
#pragma once

#include <cstdint>

#include "fo_hp.h"

namespace fo {

// the "rule" column's values: how v is updated (Reddi et al., Algorithm 2)
enum FedAdamRule : int32_t { kRuleAdam = 0, kRuleYogi = 1, kRuleAdagrad = 2 };

struct FedAdamHp {
  double lr, beta1, beta2, tau, inv_scale;
  int32_t rule;
  bool bias_correction;
  FO_HD static FedAdamHp of(const double* r, int32_t present, bool unscale, double inv);
};

FO_HD FedAdamHp FedAdamHp::of(const double* r, int32_t present, bool unscale, double inv) {
  (void)present;  // m and v are always there
  FedAdamHp h{r[fedadam_hp::LR],
              r[fedadam_hp::BETA1],
              r[fedadam_hp::BETA2],
              r[fedadam_hp::TAU],
              unscale ? inv : 1.0,  // x * 1 is exact: no branch per element
              static_cast<int32_t>(r[fedadam_hp::RULE]),
              r[fedadam_hp::BIAS_CORRECTION] != 0};
  return h;
}

// The per-step factors at step t = k + 1 in the compute type A, rounded once from double as the
// reference (a Python float meeting a float32 tensor) rounds them:
//   step = lr * c1, c1 = 1 / (1 - beta1^t); c2 = 1 / sqrt(1 - beta2^t) (Adagrad: 1); both 1 without
//   bias correction.
template <class A>
struct FedAdamStep {
  A step, beta1, one_minus_beta1, beta2, one_minus_beta2, tau, c2, inv;
  int32_t rule;

  FO_HD static FedAdamStep at(const FedAdamHp& h, int32_t k) {
    double c1 = 1.0, c2 = 1.0;
    if (h.bias_correction) {
      const double t = static_cast<double>(k) + 1.0;
      c1 = 1.0 / (1.0 - pow(h.beta1, t));
      if (h.rule != kRuleAdagrad) c2 = 1.0 / sqrt(1.0 - pow(h.beta2, t));
    }
    return FedAdamStep{static_cast<A>(h.lr * c1), static_cast<A>(h.beta1), static_cast<A>(1.0 - h.beta1),
                       static_cast<A>(h.beta2),   static_cast<A>(1.0 - h.beta2), static_cast<A>(h.tau),
                       static_cast<A>(c2),        static_cast<A>(h.inv_scale), h.rule};
  }
};

// IEEE square root in the compute type itself (a float never goes through double)
FO_HD float fo_sqrt(float v) { return sqrtf(v); }
FO_HD double fo_sqrt(double v) { return sqrt(v); }

// One element: g unscaled, m and v updated in place, the new x returned (reference/fedadam.py's order).
template <int32_t kRule, class A>
FO_HD A fedadam_element(const FedAdamStep<A>& s, A x, A g, A& m, A& v) {
  g = g * s.inv;
  const A g2 = g * g;
  m = m * s.beta1 + s.one_minus_beta1 * g;
  if (kRule == kRuleAdam) {
    v = v * s.beta2 + s.one_minus_beta2 * g2;
  } else if (kRule == kRuleYogi) {
    const A d = v - g2;
    const A sign = static_cast<A>((A(0) < d) - (d < A(0)));  // torch.sign: 0 for 0 (and NaN)
    v = v - s.one_minus_beta2 * g2 * sign;
  } else {
    v = v + g2;
  }
  return x - s.step * (m / (fo_sqrt(v) * s.c2 + s.tau));
}

}  // namespace fo
