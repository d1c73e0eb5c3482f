// Per-group hyperparameters and the per-step scalars derived from them on the device.
//
// Every function here is __host__ __device__: the CPU backend runs exactly the code the CUDA
// kernels run for lr_k and the clip / normalisation factors, so CPU tests cover it.
// The rounding follows the reference (torch) step by step: Python floats meet float32 tensors as
// float32, and ``scalar / tensor`` is ``tensor.reciprocal() * scalar`` in torch.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FO_HD __host__ __device__ __forceinline__
#else
#define FO_HD inline
#endif

namespace fo {

enum SgdFlag : int32_t {
  kSgdMaximize = 1, kSgdWeightDecay = 2, kSgdCorrection = 4, kSgdProx = 8,
  kSgdMomentum = 16, kSgdNesterov = 32, kSgdScale = 64,
};
enum FedNarFlag : int32_t { kNarWeightDecay = 1, kNarCorrection = 2, kNarProx = 4 };
enum PAdamFlag : int32_t { kPadVarianceReduction = 1 };

struct SgdHp {
  double lr, momentum, damp1 /* 1 - dampening */, weight_decay, prox_mu;
  int32_t flags;
};

struct FedNarHp {
  double step_lr, weight_decay, max_norm, eps, prox_mu;
  int32_t flags;
};

struct PAdamHp {
  double lr, beta, one_minus_beta, eps;
  int32_t flags;
};

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

// The norm dtype is float64 when any parameter of the step is float64, else float32; the result
// goes back as double and each tensor rounds it to its compute type (torch's `.to(d.dtype)`).
FO_HD double fednar_scale(double norm, const FedNarHp& hp, bool norm_f64) {
  return norm_f64 ? fednar_scale_in<double>(norm, hp) : static_cast<double>(fednar_scale_in<float>(norm, hp));
}

FO_HD double padamfed_scale(double norm, const PAdamHp& hp, bool norm_f64) {
  return norm_f64 ? padamfed_scale_in<double>(norm, hp) : static_cast<double>(padamfed_scale_in<float>(norm, hp));
}

}  // namespace fo
