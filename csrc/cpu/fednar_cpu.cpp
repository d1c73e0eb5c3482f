// Op "fednar" on CPU: pass 1 computes d and its per-chunk sums of squares, the norm and each
// group's scale are formed from them in chunk order, pass 2 recomputes d and updates x.
// (Recomputing d reads x and g again: that is SPEC §7's 20 B/element, cheaper than storing d.)
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_ops.h"
#include "cpu_tile.h"

namespace fo {
namespace cpu {

namespace {

template <class A>
struct Bufs {
  alignas(64) A x[kTile], g[kTile], d[kTile], t[kTile];
};

// d = g + weight_decay * x + correction + prox_mu * (x - x0), as reference/fednar.py adds them
template <class T, class A = Acc<T>>
const A* direction(const Entry& en, const FedNarHp& hp, int64_t off, int n, const A* x, Bufs<A>& b) {
  const int f = hp.flags;
  const A* d = load<A>(static_cast<const T*>(en.ptr[fednar_slot::G]) + off, n, b.g);
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

template <class T, class L>
double norm_chunk(const Entry& en, const FedNarHp& hp, int64_t begin, int64_t end) {
  using A = Acc<T>;
  Bufs<A> b;
  L lanes[kLanes] = {};
  const T* X = static_cast<const T*>(en.ptr[fednar_slot::X]);
  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* x = load<A>(X + off, n, b.x);
    sumsq<L>(direction<T>(en, hp, off, n, x, b), n, lanes);
  }
  return lanes_total(lanes);
}

template <class T>
void update_chunk(const Entry& en, const FedNarHp& hp, double scale, int64_t begin, int64_t end) {
  using A = Acc<T>;
  Bufs<A> b;
  const A s = static_cast<A>(scale);
  T* X = static_cast<T*>(en.ptr[fednar_slot::X]);
  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* x = load<A>(X + off, n, b.x);
    const A* d = direction<T>(en, hp, off, n, x, b);
    A* xo = out_ptr<A>(X + off, b.x);
    sub_scaled(xo, x, s, d, n);
    commit<A>(X + off, xo, n);
  }
}

}  // namespace

double finish_norm(const std::vector<double>& partials) {
  double total = 0.0;
  for (double p : partials) total += p;
  return std::sqrt(total);
}

void fednar(const std::vector<Entry>& entries, const std::vector<FedNarHp>& hps, bool norm_f64) {
  const std::vector<Chunk> chunks = make_chunks(entries);
  const int64_t nc = static_cast<int64_t>(chunks.size());
  std::vector<double> partial(chunks.size(), 0.0);
  at::parallel_for(0, nc, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Chunk& ch = chunks[c];
      const Entry& en = entries[ch.entry];
      dispatch(en.dtype, [&](auto tag) {
        using T = decltype(tag);
        partial[c] = norm_f64 ? norm_chunk<T, double>(en, hps[en.group], ch.begin, ch.end)
                              : norm_chunk<T, Acc<T>>(en, hps[en.group], ch.begin, ch.end);
      });
    }
  });
  const double norm = finish_norm(partial);
  std::vector<double> scale(hps.size());
  for (size_t g = 0; g < hps.size(); ++g) scale[g] = fednar_scale(norm, hps[g], norm_f64);
  at::parallel_for(0, nc, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Chunk& ch = chunks[c];
      const Entry& en = entries[ch.entry];
      dispatch(en.dtype, [&](auto tag) {
        update_chunk<decltype(tag)>(en, hps[en.group], scale[en.group], ch.begin, ch.end);
      });
    }
  });
}

}  // namespace cpu
}  // namespace fo
