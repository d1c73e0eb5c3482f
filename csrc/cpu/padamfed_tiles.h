// Op "padamfed" chunk code for one ISA (see cpu_common.h); included by padamfed_cpu.cpp once per ISA
// (isa_copies.h).
#include "cpu_tile.h"

#include "../common/padamfed_hp.h"

namespace fo {
namespace cpu {
namespace FO_CPU_ISA {

// G as the kernels use it: unscaled by GradScaler's factor when one is given
template <class T, class A = Acc<T>>
const A* pad_grad(const Entry& en, const PAdamHp& hp, int64_t off, int n, TileBufs<A>& b) {
  const A* G = load<A>(static_cast<const T*>(en.ptr[padamfed_slot::G]) + off, n, b.g);
  if (hp.flags & kPadUnscale) { mul(b.g, G, static_cast<A>(hp.inv_scale), n); G = b.g; }
  return G;
}

// v = beta * G + D, or (G + D) - (1 - beta) * H with variance reduction (reference order)
template <class T, class A = Acc<T>>
const A* pad_direction(const Entry& en, const PAdamHp& hp, int64_t off, int n, const A* G, TileBufs<A>& b) {
  const A* D = static_cast<const A*>(en.ptr[padamfed_slot::D]) + off;
  if (hp.flags & kPadVarianceReduction) {
    const A* H = load<A>(static_cast<const T*>(en.ptr[padamfed_slot::H]) + off, n, b.t);
    add_sub_scaled(b.d, G, D, static_cast<A>(hp.one_minus_beta), H, n);
  } else {
    scaled_add(b.d, static_cast<A>(hp.beta), G, D, n);
  }
  return b.d;
}

// The chunk code of both passes (cpu_tile.h TwoPass)
struct PadKernel : TwoPass<PadKernel> {
  // pass 1: v, whose squares form the norm; acc += G (acc is not v's memory: same bits in either order)
  template <class T, class A = Acc<T>>
  static const A* norm_tile(const Entry& en, const PAdamHp& hp, int64_t off, int n, TileBufs<A>& b) {
    const A* G = pad_grad<T>(en, hp, off, n, b);
    const A* v = pad_direction<T>(en, hp, off, n, G, b);
    A* acc = static_cast<A*>(en.ptr[padamfed_slot::ACC]) + off;
    add(acc, acc, G, n);
    return v;
  }

  // pass 2: x -= v * factor
  template <class T, class A = Acc<T>>
  static void update_tile(A* xo, const T* X, A factor, const Entry& en, const PAdamHp& hp, int64_t off, int n,
                          TileBufs<A>& b) {
    const A* v = pad_direction<T>(en, hp, off, n, pad_grad<T>(en, hp, off, n, b), b);
    sub_times(xo, load<A>(X, n, b.x), v, factor, n);
  }
};

}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
