// Per-batch hyperparameters and the per-step scalars derived from them.
//
// Every function here is __host__ __device__: the CPU backend runs exactly the code the CUDA
// kernels run for lr_k, the GradScaler factor and the clip / normalisation factors, so CPU tests
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

// Structural switches of a batch: which optional tensors it has (from the op's `present` mask) and
// which terms are non-zero (a zero term is skipped, so 0 * inf never turns into NaN).
enum SgdFlag : int32_t {
  kSgdMaximize = 1, kSgdWeightDecay = 2, kSgdCorrection = 4, kSgdProx = 8,
  kSgdMomentum = 16, kSgdNesterov = 32, kSgdScale = 64, kSgdUnscale = 128,
};
enum FedNarFlag : int32_t { kNarWeightDecay = 1, kNarCorrection = 2, kNarProx = 4, kNarUnscale = 8 };
enum PAdamFlag : int32_t { kPadVarianceReduction = 1, kPadUnscale = 2 };

struct SgdHp {
  double lr, momentum, damp1 /* 1 - dampening */, weight_decay, prox_mu, inv_scale;
  int32_t flags;
};

struct FedNarHp {
  double step_lr, weight_decay, max_norm, eps, prox_mu, inv_scale;
  int32_t flags;
};

struct PAdamHp {
  double lr, beta, one_minus_beta, eps, inv_scale;
  int32_t flags;
};

// GradScaler: gradients are multiplied by the float32 reciprocal of the scale, formed in double and
// rounded once (torch.amp.GradScaler.unscale_: scale.double().reciprocal().float()).
FO_HD double inv_scale_of(float scale) { return static_cast<double>(static_cast<float>(1.0 / static_cast<double>(scale))); }

// Rows of the op's hp tensor -> the structs the kernels use. `present` is the batch's mask of
// optional roles (bit i = i-th optional role: sgd buf, x0, corr, scale; fednar x0, corr; padamfed
// D, acc, H).
FO_HD SgdHp sgd_hp_of(const double* r, int32_t present, bool unscale, double inv) {
  SgdHp h{};
  h.lr = r[sgd_hp::LR];
  h.momentum = r[sgd_hp::MOMENTUM];
  h.damp1 = 1.0 - r[sgd_hp::DAMPENING];
  h.weight_decay = r[sgd_hp::WEIGHT_DECAY];
  h.prox_mu = r[sgd_hp::PROX_MU];
  h.inv_scale = inv;
  int32_t f = 0;
  if (r[sgd_hp::MAXIMIZE] != 0) f |= kSgdMaximize;
  if (h.weight_decay != 0) f |= kSgdWeightDecay;
  if (present & 1) f |= kSgdMomentum;
  if ((present & 1) && r[sgd_hp::NESTEROV] != 0) f |= kSgdNesterov;
  if (present & 2) f |= kSgdProx;
  if (present & 4) f |= kSgdCorrection;
  if (present & 8) f |= kSgdScale;
  if (unscale) f |= kSgdUnscale;
  h.flags = f;
  return h;
}

FO_HD FedNarHp fednar_hp_of(const double* r, int32_t present, bool unscale, double inv) {
  FedNarHp h{};
  h.step_lr = r[fednar_hp::STEP_LR];
  h.weight_decay = r[fednar_hp::WEIGHT_DECAY];
  h.max_norm = r[fednar_hp::MAX_NORM];
  h.eps = r[fednar_hp::EPS];
  h.prox_mu = r[fednar_hp::PROX_MU];
  h.inv_scale = inv;
  int32_t f = 0;
  if (h.weight_decay != 0) f |= kNarWeightDecay;
  if (present & 1) f |= kNarProx;
  if (present & 2) f |= kNarCorrection;
  if (unscale) f |= kNarUnscale;
  h.flags = f;
  return h;
}

FO_HD PAdamHp padamfed_hp_of(const double* r, int32_t present, bool unscale, double inv) {
  PAdamHp h{};
  h.lr = r[padamfed_hp::LR];
  h.beta = r[padamfed_hp::BETA];
  h.one_minus_beta = 1.0 - h.beta;
  h.eps = r[padamfed_hp::EPS];
  h.inv_scale = inv;
  int32_t f = 0;
  if (present & 4) f |= kPadVarianceReduction;
  if (unscale) f |= kPadUnscale;
  h.flags = f;
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

// FedNAR: coef = clamp(max_norm / (s + eps), max=1); scale = step_lr * coef, in the norm dtype N.
// `q > 1 ? 1 : q` keeps NaN, like torch.clamp.
template <class N>
FO_HD N fednar_scale_in(double norm, const FedNarHp& hp) {
  const N s = static_cast<N>(norm);
  const N q = (N(1) / (s + static_cast<N>(hp.eps))) * static_cast<N>(hp.max_norm);
  const N coef = q > N(1) ? N(1) : q;
  return static_cast<N>(hp.step_lr) * coef;
}

// PAdaMFed: n = clamp(||v||, min=eps); scale = lr / n, in the norm dtype N (NaN kept).
template <class N>
FO_HD N padamfed_scale_in(double norm, const PAdamHp& hp) {
  const N s = static_cast<N>(norm);
  const N e = static_cast<N>(hp.eps);
  const N n = s < e ? e : s;
  return (N(1) / n) * static_cast<N>(hp.lr);
}

// The norm is always accumulated in float64 (no overflow / underflow for elements in
// [1e-30, 1e30]); the dtype it is *used* in is float64 when any parameter is float64, else float32,
// and each tensor rounds the factor to its compute type (torch's `.to(d.dtype)`).
FO_HD double fednar_scale(double norm, const FedNarHp& hp, bool norm_f64) {
  return norm_f64 ? fednar_scale_in<double>(norm, hp) : static_cast<double>(fednar_scale_in<float>(norm, hp));
}

FO_HD double padamfed_scale(double norm, const PAdamHp& hp, bool norm_f64) {
  return norm_f64 ? padamfed_scale_in<double>(norm, hp) : static_cast<double>(padamfed_scale_in<float>(norm, hp));
}

}  // namespace fo
