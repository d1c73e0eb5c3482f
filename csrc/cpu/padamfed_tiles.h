// Op "padamfed" chunk code for one ISA (see cpu_common.h); included by padamfed_cpu.cpp once per ISA.
#include "cpu_tile.h"

#include "../common/fo_hp.h"

namespace fo {
namespace cpu {
namespace FO_CPU_ISA {

template <class A>
struct PadBufs {
  alignas(64) A x[kTile], g[kTile], h[kTile], v[kTile];
};

// v = beta * G + D, or (G + D) - (1 - beta) * H with variance reduction (reference order)
template <class T, class A = Acc<T>>
const A* pad_direction(const Entry& en, const PAdamHp& hp, int64_t off, int n, const A* G, PadBufs<A>& b) {
  const A* D = static_cast<const A*>(en.ptr[padamfed_slot::D]) + off;
  if (hp.flags & kPadVarianceReduction) {
    const A* H = load<A>(static_cast<const T*>(en.ptr[padamfed_slot::H]) + off, n, b.h);
    add_sub_scaled(b.v, G, D, static_cast<A>(hp.one_minus_beta), H, n);
  } else {
    scaled_add(b.v, static_cast<A>(hp.beta), G, D, n);
  }
  return b.v;
}

// G as the kernels use it: unscaled by GradScaler's factor when one is given
template <class T, class A = Acc<T>>
const A* pad_grad(const Entry& en, const PAdamHp& hp, int64_t off, int n, PadBufs<A>& b) {
  const A* G = load<A>(static_cast<const T*>(en.ptr[padamfed_slot::G]) + off, n, b.g);
  if (hp.flags & kPadUnscale) { mul(b.g, G, static_cast<A>(hp.inv_scale), n); G = b.g; }
  return G;
}

// pass 1: acc += G and the sum of squares of v over one chunk, in float64 lanes
template <class T>
double pad_norm_chunk(const Entry& en, const PAdamHp& hp, int64_t begin, int64_t end) {
  using A = Acc<T>;
  PadBufs<A> b;
  double lanes[kLanes] = {};
  A* ACC = static_cast<A*>(en.ptr[padamfed_slot::ACC]);
  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* G = pad_grad<T>(en, hp, off, n, b);
    sumsq<double>(pad_direction<T>(en, hp, off, n, G, b), n, lanes);
    add(ACC + off, ACC + off, G, n);
  }
  return lanes_total(lanes);
}

// pass 2: x -= v * scale
template <class T>
void pad_update_chunk(const Entry& en, const PAdamHp& hp, double scale, int64_t begin, int64_t end) {
  using A = Acc<T>;
  PadBufs<A> b;
  const A s = static_cast<A>(scale);
  T* X = static_cast<T*>(en.ptr[padamfed_slot::X]);
  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* v = pad_direction<T>(en, hp, off, n, pad_grad<T>(en, hp, off, n, b), b);
    const A* x = load<A>(X + off, n, b.x);
    A* xo = out_ptr<A>(X + off, b.x);
    sub_times(xo, x, v, s, n);
    commit<A>(X + off, xo, n);
  }
}

inline void padamfed_norm_chunks(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi,
                                 const std::vector<Entry>& entries, const std::vector<PAdamHp>& hps, double* partial) {
  for (int64_t c = lo; c < hi; ++c) {
    const Chunk& ch = chunks[c];
    const Entry& en = entries[ch.entry];
    dispatch(en.dtype, [&](auto tag) {
      partial[c] = pad_norm_chunk<decltype(tag)>(en, hps[en.group], ch.begin, ch.end);
    });
  }
}

inline void padamfed_update_chunks(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi,
                                   const std::vector<Entry>& entries, const std::vector<PAdamHp>& hps,
                                   const std::vector<double>& scale) {
  for (int64_t c = lo; c < hi; ++c) {
    const Chunk& ch = chunks[c];
    const Entry& en = entries[ch.entry];
    dispatch(en.dtype, [&](auto tag) {
      pad_update_chunk<decltype(tag)>(en, hps[en.group], scale[en.group], ch.begin, ch.end);
    });
  }
}

}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
