// Op "fedexp" chunk code for one ISA (see cpu_common.h); included by fedexp_cpu.cpp once per ISA
// (isa_copies.h).
#include "cpu_tile.h"

#include "../common/fedexp_hp.h"

namespace fo {
namespace cpu {
namespace FO_CPU_ISA {

// g as the kernels use it: unscaled by GradScaler's factor (x * 1 is exact without one)
template <class T, class A = Acc<T>>
const A* fedexp_grad(const Entry& en, const FedExpHp& hp, int64_t off, int n, TileBufs<A>& b) {
  const A* g = load<A>(static_cast<const T*>(en.ptr[fedexp_slot::G]) + off, n, b.g);
  if (hp.inv_scale != 1.0) { mul(b.g, g, static_cast<A>(hp.inv_scale), n); g = b.g; }
  return g;
}

// The chunk code of both passes (cpu_tile.h TwoPass): pass 1 reads g only, pass 2 x and g
struct FedExpKernel : TwoPass<FedExpKernel> {
  template <class T, class A = Acc<T>>
  static const A* norm_tile(const Entry& en, const FedExpHp& hp, int64_t off, int n, TileBufs<A>& b) {
    return fedexp_grad<T>(en, hp, off, n, b);
  }

  // x -= s * g, s = lr * eta_g
  template <class T, class A = Acc<T>>
  static void update_tile(A* xo, const T* X, A s, const Entry& en, const FedExpHp& hp, int64_t off, int n,
                          TileBufs<A>& b) {
    sub_scaled(xo, load<A>(X, n, b.x), s, fedexp_grad<T>(en, hp, off, n, b), n);
  }
};

}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
