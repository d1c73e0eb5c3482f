// Op "fednar" chunk code for one ISA (see cpu_common.h); included by fednar_cpu.cpp once per ISA
// (isa_copies.h).
#include "cpu_tile.h"

#include "../common/fednar_hp.h"

namespace fo {
namespace cpu {
namespace FO_CPU_ISA {

// d = g + weight_decay * x + correction + prox_mu * (x - x0), as reference/fednar.py adds them
template <class T, class A = Acc<T>>
const A* nar_direction(const Entry& en, const FedNarHp& hp, int64_t off, int n, const A* x, TileBufs<A>& b) {
  const int f = hp.flags;
  const A* d = load<A>(static_cast<const T*>(en.ptr[fednar_slot::G]) + off, n, b.g);
  if (f & kNarUnscale) { mul(b.d, d, static_cast<A>(hp.inv_scale), n); d = b.d; }
  if (f & kNarWeightDecay) { add_scaled(b.d, d, static_cast<A>(hp.weight_decay), x, n); d = b.d; }
  if (f & kNarCorrection) {
    add(b.d, d, load<A>(static_cast<const T*>(en.ptr[fednar_slot::CORR]) + off, n, b.t), n);
    d = b.d;
  }
  if (f & kNarProx) {
    add_scaled_diff(b.d, d, static_cast<A>(hp.prox_mu), x,
                    load<A>(static_cast<const T*>(en.ptr[fednar_slot::X0]) + off, n, b.t), n);
    d = b.d;
  }
  return d;
}

// The chunk code of both passes (cpu_tile.h TwoPass)
struct NarKernel : TwoPass<NarKernel> {
  // pass 1: d, whose squares form the norm
  template <class T, class A = Acc<T>>
  static const A* norm_tile(const Entry& en, const FedNarHp& hp, int64_t off, int n, TileBufs<A>& b) {
    const A* x = load<A>(static_cast<const T*>(en.ptr[fednar_slot::X]) + off, n, b.x);
    return nar_direction<T>(en, hp, off, n, x, b);
  }

  // pass 2: x -= factor * d
  template <class T, class A = Acc<T>>
  static void update_tile(A* xo, const T* X, A factor, const Entry& en, const FedNarHp& hp, int64_t off, int n,
                          TileBufs<A>& b) {
    const A* x = load<A>(X, n, b.x);
    sub_scaled(xo, x, factor, nar_direction<T>(en, hp, off, n, x, b), n);
  }
};

}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
