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

// One op's float64 hp row (columns: op_table.h <op>_hp) -> the struct its kernels use: `of(row,
// present, unscale, inv)`, with `present` the batch's mask of optional roles (op_table.h <op>_bit)
// and `inv` GradScaler's factor when `unscale`.
struct SgdHp {
  double lr, momentum, damp1 /* 1 - dampening */, weight_decay, prox_mu, inv_scale;
  int32_t flags;
  FO_HD static SgdHp of(const double* r, int32_t present, bool unscale, double inv);
};

struct FedNarHp {
  double step_lr, weight_decay, max_norm, eps, prox_mu, inv_scale;
  int32_t flags;
  FO_HD static FedNarHp of(const double* r, int32_t present, bool unscale, double inv);
};

struct PAdamHp {
  double lr, beta, one_minus_beta, eps, inv_scale;
  int32_t flags;
  FO_HD static PAdamHp of(const double* r, int32_t present, bool unscale, double inv);
};

// GradScaler: gradients are multiplied by the float32 reciprocal of the scale, formed in double and
// rounded once (torch.amp.GradScaler.unscale_: scale.double().reciprocal().float()).
FO_HD double inv_scale_of(float scale) { return static_cast<double>(static_cast<float>(1.0 / static_cast<double>(scale))); }

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

FO_HD FedNarHp FedNarHp::of(const double* r, int32_t present, bool unscale, double inv) {
  FedNarHp h{r[fednar_hp::STEP_LR], r[fednar_hp::WEIGHT_DECAY], r[fednar_hp::MAX_NORM], r[fednar_hp::EPS],
             r[fednar_hp::PROX_MU], inv, 0};
  if (h.weight_decay != 0) h.flags |= kNarWeightDecay;
  if (present & fednar_bit::X0) h.flags |= kNarProx;
  if (present & fednar_bit::CORR) h.flags |= kNarCorrection;
  if (unscale) h.flags |= kNarUnscale;
  return h;
}

FO_HD PAdamHp PAdamHp::of(const double* r, int32_t present, bool unscale, double inv) {
  const double beta = r[padamfed_hp::BETA];
  PAdamHp h{r[padamfed_hp::LR], beta, 1.0 - beta, r[padamfed_hp::EPS], inv, 0};
  if (present & padamfed_bit::H) h.flags |= kPadVarianceReduction;
  if (unscale) h.flags |= kPadUnscale;
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
// norm_factor(norm, hp, norm_f64): a two-pass op's factor, overloaded on the op's hp struct.
FO_HD double norm_factor(double norm, const FedNarHp& hp, bool norm_f64) {
  return norm_f64 ? fednar_scale_in<double>(norm, hp) : static_cast<double>(fednar_scale_in<float>(norm, hp));
}

FO_HD double norm_factor(double norm, const PAdamHp& hp, bool norm_f64) {
  return norm_f64 ? padamfed_scale_in<double>(norm, hp) : static_cast<double>(padamfed_scale_in<float>(norm, hp));
}

}  // namespace fo
