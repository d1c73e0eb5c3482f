// PAdaMFed's per-chunk math on CUDA (ops "padamfed", "padamfed_batched"; two_pass.cuh runs it):
// pass 1 forms v, acc += G and the float64 sum of squares of v, pass 2 applies x -= v * factor. A
// header of its own so that tests/cuda_host can compile the very same code on the host
// (tests/test_cuda_chunk_order.py).
#pragma once

#include "../common/padamfed_hp.h"
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"
#include "two_pass_op.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

template <class A>
__device__ __forceinline__ A pad_direction(bool vr, A beta, A omb, A g, A D, A h) {
  return vr ? (g + D) - omb * h : beta * g + D;
}

// D and acc are state-typed (op_table.h): float32, float64 for float64 params
struct PadOp : TwoPassOp<spec::padamfed, PAdamHp, 52> {
  // pass 1 reads G, D, acc, H and writes acc; pass 2 reads G, D, x, H and writes x
  template <class T, bool kUpdate, bool kVector>
  __device__ static double chunk(const TableT& tab, const Where& w, const Hp& hp, acc_t<T> factor) {
    using A = acc_t<T>;
    const bool vr = (hp.flags & kPadVarianceReduction) != 0;
    const bool unscale = (hp.flags & kPadUnscale) != 0;
    const A inv = static_cast<A>(hp.inv_scale);
    const A beta = static_cast<A>(hp.beta), omb = static_cast<A>(hp.one_minus_beta);
    T* X = static_cast<T*>(tab.ptr[padamfed_slot::X][w.i]) + w.begin;
    const T* G = static_cast<const T*>(tab.ptr[padamfed_slot::G][w.i]) + w.begin;
    const A* D = static_cast<const A*>(tab.ptr[padamfed_slot::D][w.i]) + w.begin;
    A* ACC = static_cast<A*>(tab.ptr[padamfed_slot::ACC][w.i]) + w.begin;
    const T* H = static_cast<const T*>(tab.ptr[padamfed_slot::H][w.i]);
    if (H) H += w.begin;
    double sq = 0.0;
    struct Regs {
      A g[kIlp][kVec], d[kIlp][kVec], h[kIlp][kVec], y[kIlp][kVec];  // y: acc (pass 1) or x (pass 2)
    };
    walk_chunk<Regs>(
        w.n,
        [&](Regs& r, int u, int j) {
          load4_any<kVector>(G + j, r.g[u]);
          load4_any<kVector>(D + j, r.d[u]);
          if (vr) load4_any<kVector>(H + j, r.h[u]);
          if (kUpdate) load4_any<kVector>(X + j, r.y[u]);
          else load4_any<kVector>(ACC + j, r.y[u]);
        },
        [&](Regs& r, int u, int j) {
#pragma unroll
          for (int q = 0; q < kVec; ++q) {
            const A gg = unscale ? r.g[u][q] * inv : r.g[u][q];
            const A vv = pad_direction(vr, beta, omb, gg, r.d[u][q], r.h[u][q]);
            if (kUpdate) {
              r.y[u][q] = r.y[u][q] - vv * factor;
            } else {
              sq += static_cast<double>(vv) * static_cast<double>(vv);
              r.y[u][q] = r.y[u][q] + gg;
            }
          }
          if (kUpdate) store4_any<kVector>(X + j, r.y[u]);
          else store4_any<kVector>(ACC + j, r.y[u]);
        },
        [&](int j) {
          const A g0 = load1(G + j);
          const A g = unscale ? g0 * inv : g0;
          const A vv = pad_direction(vr, beta, omb, g, D[j], vr ? load1(H + j) : A(0));
          if (kUpdate) {
            store1(X + j, load1(X + j) - vv * factor);
          } else {
            sq += static_cast<double>(vv) * static_cast<double>(vv);
            ACC[j] = ACC[j] + g;
          }
        });
    return sq;
  }
};

}  // namespace cuda
}  // namespace fo
