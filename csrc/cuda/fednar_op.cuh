// FedNAR's per-chunk math on CUDA (ops "fednar", "fednar_batched"; two_pass.cuh runs it): pass 1
// forms d and its float64 sum of squares, pass 2 applies x -= factor * d. A header of its own so
// that tests/cuda_host can compile the very same code on the host (tests/test_cuda_chunk_order.py).
#pragma once

#include "../common/fednar_hp.h"
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"
#include "two_pass_op.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

// d = g * inv_scale + weight_decay * x + correction + prox_mu * (x - x0), in the reference's order
template <class A>
__device__ __forceinline__ A nar_direction(int f, A inv, A wd, A mu, A x, A g, A c, A x0) {
  A d = g;
  if (f & kNarUnscale) d = d * inv;
  if (f & kNarWeightDecay) d = d + wd * x;
  if (f & kNarCorrection) d = d + c;
  if (f & kNarProx) d = d + mu * (x - x0);
  return d;
}

struct NarOp : TwoPassOp<spec::fednar, FedNarHp, 60> {
  template <class T, bool kUpdate, bool kVector>
  __device__ static double chunk(const TableT& tab, const Where& w, const Hp& hp, acc_t<T> factor) {
    using A = acc_t<T>;
    const int f = hp.flags;
    const A inv = static_cast<A>(hp.inv_scale), wd = static_cast<A>(hp.weight_decay), mu = static_cast<A>(hp.prox_mu);
    T* X = static_cast<T*>(tab.ptr[fednar_slot::X][w.i]) + w.begin;
    const T* G = static_cast<const T*>(tab.ptr[fednar_slot::G][w.i]) + w.begin;
    const T* X0 = static_cast<const T*>(tab.ptr[fednar_slot::X0][w.i]);
    const T* C = static_cast<const T*>(tab.ptr[fednar_slot::CORR][w.i]);
    if (X0) X0 += w.begin;
    if (C) C += w.begin;
    double sq = 0.0;
    struct Regs {
      A x[kIlp][kVec], g[kIlp][kVec], c[kIlp][kVec], x0[kIlp][kVec];
    };
    walk_chunk<Regs>(
        w.n,
        [&](Regs& r, int u, int j) {
          load4_any<kVector>(X + j, r.x[u]);
          load4_any<kVector>(G + j, r.g[u]);
          if (f & kNarCorrection) load4_any<kVector>(C + j, r.c[u]);
          if (f & kNarProx) load4_any<kVector>(X0 + j, r.x0[u]);
        },
        [&](Regs& r, int u, int j) {
#pragma unroll
          for (int q = 0; q < kVec; ++q) {
            const A d = nar_direction(f, inv, wd, mu, r.x[u][q], r.g[u][q], r.c[u][q], r.x0[u][q]);
            if (kUpdate) r.x[u][q] = r.x[u][q] - factor * d;
            else sq += static_cast<double>(d) * static_cast<double>(d);
          }
          if (kUpdate) store4_any<kVector>(X + j, r.x[u]);
        },
        [&](int j) {
          const A x = load1(X + j);
          const A c = (f & kNarCorrection) ? load1(C + j) : A(0);
          const A x0 = (f & kNarProx) ? load1(X0 + j) : A(0);
          const A d = nar_direction(f, inv, wd, mu, x, load1(G + j), c, x0);
          if (kUpdate) store1(X + j, x - factor * d);
          else sq += static_cast<double>(d) * static_cast<double>(d);
        });
    return sq;
  }
};

}  // namespace cuda
}  // namespace fo
