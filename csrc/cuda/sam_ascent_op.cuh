// FedSAM's ascent per chunk on CUDA (ops "sam_ascent", "sam_ascent_batched"; two_pass.cuh runs it):
// pass 1 forms d = w * g (w = |x| + eta with ASAM, else 1) and its float64 sum of squares, pass 2
// stores the saved x and applies x += factor * (w * d). A header of its own so that tests/cuda_host
// can compile the very same code on the host (tests/test_cuda_chunk_order.py).
#pragma once

#include "../common/sam_ascent_hp.h"
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"
#include "two_pass_op.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

template <class A>
__device__ __forceinline__ A sam_weight(bool adaptive, A eta, A x) {
  return adaptive ? (x < A(0) ? -x : x) + eta : A(1);
}

struct SamOp : TwoPassOp<spec::sam_ascent, SamHp, 70> {
  // pass 1 reads g (and x with ASAM); pass 2 reads x and g, writes the saved x and x
  template <class T, bool kUpdate, bool kVector>
  __device__ static double chunk(const TableT& tab, const Where& w, const Hp& hp, acc_t<T> factor) {
    using A = acc_t<T>;
    const bool adaptive = (hp.flags & kSamAdaptive) != 0;
    const bool unscale = (hp.flags & kSamUnscale) != 0;
    const A inv = static_cast<A>(hp.inv_scale), eta = static_cast<A>(hp.eta);
    T* X = static_cast<T*>(tab.ptr[sam_ascent_slot::X][w.i]) + w.begin;
    const T* G = static_cast<const T*>(tab.ptr[sam_ascent_slot::G][w.i]) + w.begin;
    T* S = static_cast<T*>(tab.ptr[sam_ascent_slot::SAVED][w.i]);  // null where the row group has none
    if (S) S += w.begin;
    double sq = 0.0;
    struct Regs {
      A x[kIlp][kVec], g[kIlp][kVec];
    };
    walk_chunk<Regs>(
        w.n,
        [&](Regs& r, int u, int j) {
          load4_any<kVector>(G + j, r.g[u]);
          if (kUpdate || adaptive) load4_any<kVector>(X + j, r.x[u]);
        },
        [&](Regs& r, int u, int j) {
          if (kUpdate && S) store4_any<kVector>(S + j, r.x[u]);  // x is exact in A: the stored bits
#pragma unroll
          for (int q = 0; q < kVec; ++q) {
            const A g = unscale ? r.g[u][q] * inv : r.g[u][q];
            if (adaptive) {
              const A wt = sam_weight(true, eta, r.x[u][q]);
              const A d = wt * g;
              if (kUpdate) r.x[u][q] = r.x[u][q] + factor * (wt * d);
              else sq += static_cast<double>(d) * static_cast<double>(d);
            } else {
              if (kUpdate) r.x[u][q] = r.x[u][q] + factor * g;
              else sq += static_cast<double>(g) * static_cast<double>(g);
            }
          }
          if (kUpdate) store4_any<kVector>(X + j, r.x[u]);
        },
        [&](int j) {
          const A g0 = load1(G + j);
          const A g = unscale ? g0 * inv : g0;
          const A x = (kUpdate || adaptive) ? load1(X + j) : A(0);
          const A wt = sam_weight(adaptive, eta, x);
          const A d = adaptive ? wt * g : g;
          if (kUpdate) {
            if (S) S[j] = X[j];
            store1(X + j, adaptive ? x + factor * (wt * d) : x + factor * g);
          } else {
            sq += static_cast<double>(d) * static_cast<double>(d);
          }
        });
    return sq;
  }
};

}  // namespace cuda
}  // namespace fo
