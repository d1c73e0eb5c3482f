// Op "fednar" chunk code for one ISA (see cpu_common.h); included by fednar_cpu.cpp once per ISA.
#include "cpu_tile.h"

#include "../common/fo_hp.h"

namespace fo {
namespace cpu {
namespace FO_CPU_ISA {

template <class A>
struct NarBufs {
  alignas(64) A x[kTile], g[kTile], d[kTile], t[kTile];
};

// d = g + weight_decay * x + correction + prox_mu * (x - x0), as reference/fednar.py adds them
template <class T, class A = Acc<T>>
const A* nar_direction(const Entry& en, const FedNarHp& hp, int64_t off, int n, const A* x, NarBufs<A>& b) {
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

// pass 1: sum of squares of d over one chunk, in float64 lanes
template <class T>
double nar_norm_chunk(const Entry& en, const FedNarHp& hp, int64_t begin, int64_t end) {
  using A = Acc<T>;
  NarBufs<A> b;
  double lanes[kLanes] = {};
  const T* X = static_cast<const T*>(en.ptr[fednar_slot::X]);
  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* x = load<A>(X + off, n, b.x);
    sumsq<double>(nar_direction<T>(en, hp, off, n, x, b), n, lanes);
  }
  return lanes_total(lanes);
}

// pass 2: x -= scale * d
template <class T>
void nar_update_chunk(const Entry& en, const FedNarHp& hp, double scale, int64_t begin, int64_t end) {
  using A = Acc<T>;
  NarBufs<A> b;
  const A s = static_cast<A>(scale);
  T* X = static_cast<T*>(en.ptr[fednar_slot::X]);
  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* x = load<A>(X + off, n, b.x);
    const A* d = nar_direction<T>(en, hp, off, n, x, b);
    A* xo = out_ptr<A>(X + off, b.x);
    sub_scaled(xo, x, s, d, n);
    commit<A>(X + off, xo, n);
  }
}

inline void fednar_norm_chunks(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi,
                               const std::vector<Entry>& entries, const std::vector<FedNarHp>& hps, double* partial) {
  for (int64_t c = lo; c < hi; ++c) {
    const Chunk& ch = chunks[c];
    const Entry& en = entries[ch.entry];
    dispatch(en.dtype, [&](auto tag) {
      partial[c] = nar_norm_chunk<decltype(tag)>(en, hps[en.group], ch.begin, ch.end);
    });
  }
}

inline void fednar_update_chunks(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi,
                                 const std::vector<Entry>& entries, const std::vector<FedNarHp>& hps,
                                 const std::vector<double>& scale) {
  for (int64_t c = lo; c < hi; ++c) {
    const Chunk& ch = chunks[c];
    const Entry& en = entries[ch.entry];
    dispatch(en.dtype, [&](auto tag) {
      nar_update_chunk<decltype(tag)>(en, hps[en.group], scale[en.group], ch.begin, ch.end);
    });
  }
}

}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
