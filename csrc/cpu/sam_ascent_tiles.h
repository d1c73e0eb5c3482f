// Op "sam_ascent" chunk code for one ISA (see cpu_common.h); included by sam_ascent_cpu.cpp once per
// ISA (isa_copies.h).
#include "cpu_tile.h"

#include "../common/sam_ascent_hp.h"

namespace fo {
namespace cpu {
namespace FO_CPU_ISA {

// w = |x| + eta (ASAM), into w
template <class A>
inline void sam_weight(A* w, const A* x, A eta, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) w[i] = std::abs(x[i]) + eta;
}

// out = x + s * (w * d)
template <class A>
inline void add_scaled_product(A* out, const A* x, A s, const A* w, const A* d, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = x[i] + s * (w[i] * d[i]);
}

// g as the kernels use it: unscaled by GradScaler's factor when one is given
template <class T, class A = Acc<T>>
const A* sam_grad(const Entry& en, const SamHp& hp, int64_t off, int n, TileBufs<A>& b) {
  const A* g = load<A>(static_cast<const T*>(en.ptr[sam_ascent_slot::G]) + off, n, b.g);
  if (hp.flags & kSamUnscale) { mul(b.g, g, static_cast<A>(hp.inv_scale), n); g = b.g; }
  return g;
}

// The chunk code of both passes (cpu_tile.h TwoPass), in reference/sam_ascent.py's order
struct SamKernel : TwoPass<SamKernel> {
  // pass 1: d = w * g (g when not adaptive), whose squares form the norm
  template <class T, class A = Acc<T>>
  static const A* norm_tile(const Entry& en, const SamHp& hp, int64_t off, int n, TileBufs<A>& b) {
    const A* g = sam_grad<T>(en, hp, off, n, b);
    if (!(hp.flags & kSamAdaptive)) return g;
    const A* x = load<A>(static_cast<const T*>(en.ptr[sam_ascent_slot::X]) + off, n, b.x);
    sam_weight(b.t, x, static_cast<A>(hp.eta), n);
    FO_IVDEP for (int i = 0; i < n; ++i) b.d[i] = b.t[i] * g[i];
    return b.d;
  }

  // pass 2: saved = x (the stored bits), then x += factor * (w * d)
  template <class T, class A = Acc<T>>
  static void update_tile(A* xo, const T* X, A factor, const Entry& en, const SamHp& hp, int64_t off, int n,
                          TileBufs<A>& b) {
    T* saved = static_cast<T*>(en.ptr[sam_ascent_slot::SAVED]);  // null where the row group has none
    if (saved) std::memcpy(saved + off, X, sizeof(T) * static_cast<size_t>(n));  // before xo (may be X) is written
    const A* x = load<A>(X, n, b.x);
    const A* g = sam_grad<T>(en, hp, off, n, b);
    if (hp.flags & kSamAdaptive) {
      sam_weight(b.t, x, static_cast<A>(hp.eta), n);
      FO_IVDEP for (int i = 0; i < n; ++i) b.d[i] = b.t[i] * g[i];
      add_scaled_product(xo, x, factor, b.t, b.d, n);
    } else {
      add_scaled(xo, x, factor, g, n);
    }
  }
};

}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
