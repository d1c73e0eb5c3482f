// Op "sgd"'s hyperparameters (its switches, SgdHp and lr_k), as both the CPU
// and the CUDA kernels read them (conventions: common/fo_hp.h).
#pragma once

#include <cstdint>

#include "fo_hp.h"

namespace fo {

enum SgdFlag : int32_t {
  kSgdMaximize = 1, kSgdWeightDecay = 2, kSgdCorrection = 4, kSgdProx = 8,
  kSgdMomentum = 16, kSgdNesterov = 32, kSgdScale = 64, kSgdUnscale = 128,
};

struct SgdHp {
  double lr, momentum, damp1 /* 1 - dampening */, weight_decay, prox_mu, inv_scale;
  int32_t flags;
  FO_HD static SgdHp of(const double* r, int32_t present, bool unscale, double inv);
};

FO_HD SgdHp SgdHp::of(const double* r, int32_t present, bool unscale, double inv) {
  SgdHp h{r[sgd_hp::LR], r[sgd_hp::MOMENTUM], 1.0 - r[sgd_hp::DAMPENING], r[sgd_hp::WEIGHT_DECAY], r[sgd_hp::PROX_MU],
          inv, 0};
  if (r[sgd_hp::MAXIMIZE] != 0) h.flags |= kSgdMaximize;
  if (h.weight_decay != 0) h.flags |= kSgdWeightDecay;
  if (present & sgd_bit::BUF) h.flags |= kSgdMomentum;
  if ((present & sgd_bit::BUF) && r[sgd_hp::NESTEROV] != 0) h.flags |= kSgdNesterov;
  if (present & sgd_bit::X0) h.flags |= kSgdProx;
  if (present & sgd_bit::CORR) h.flags |= kSgdCorrection;
  if (present & sgd_bit::SCALE) h.flags |= kSgdScale;
  if (unscale) h.flags |= kSgdUnscale;
  return h;
}

// lr_k = lr * table[min(k // decay_every, len - 1)], in double, then rounded to the compute type.
template <class A>
FO_HD A sgd_lr(const SgdHp& hp, int32_t k, const double* table, int64_t table_len, int64_t decay_every) {
  int64_t j = static_cast<int64_t>(k) / decay_every;
  if (j > table_len - 1) j = table_len - 1;
  if (j < 0) j = 0;
  return static_cast<A>(hp.lr * table[j]);
}

}  // namespace fo
