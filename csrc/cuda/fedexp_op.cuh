// FedExP's per-chunk math on CUDA (ops "fedexp", "fedexp_batched"; two_pass.cuh runs it): pass 1
// sums the squares of g in float64, pass 2 applies x -= factor * g with factor = lr * eta_g. A header
// of its own so that tests/cuda_host can compile the very same code on the host.
#pragma once

#include "../common/fedexp_hp.h"
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"
#include "two_pass_op.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

struct ExpOp : TwoPassOp<spec::fedexp, FedExpHp, 88> {  // two roles: 88 tensors fill the 4 KiB
  template <class T, bool kUpdate, bool kVector>
  __device__ static double chunk(const TableT& tab, const Where& w, const Hp& hp, acc_t<T> factor) {
    using A = acc_t<T>;
    const A inv = static_cast<A>(hp.inv_scale);  // 1 without GradScaler: x * 1 is exact
    T* X = static_cast<T*>(tab.ptr[fedexp_slot::X][w.i]) + w.begin;
    const T* G = static_cast<const T*>(tab.ptr[fedexp_slot::G][w.i]) + w.begin;
    double sq = 0.0;
    struct Regs {
      A x[kIlp][kVec], g[kIlp][kVec];
    };
    walk_chunk<Regs>(
        w.n,
        [&](Regs& r, int u, int j) {
          if (kUpdate) load4_any<kVector>(X + j, r.x[u]);
          load4_any<kVector>(G + j, r.g[u]);
        },
        [&](Regs& r, int u, int j) {
#pragma unroll
          for (int q = 0; q < kVec; ++q) {
            const A d = r.g[u][q] * inv;
            if (kUpdate) r.x[u][q] = r.x[u][q] - factor * d;
            else sq += static_cast<double>(d) * static_cast<double>(d);
          }
          if (kUpdate) store4_any<kVector>(X + j, r.x[u]);
        },
        [&](int j) {
          const A d = load1(G + j) * inv;
          if (kUpdate) store1(X + j, load1(X + j) - factor * d);
          else sq += static_cast<double>(d) * static_cast<double>(d);
        });
    return sq;
  }
};

}  // namespace cuda
}  // namespace fo
