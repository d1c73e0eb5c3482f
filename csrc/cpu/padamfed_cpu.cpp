// Op "padamfed" on CPU: pass 1 forms v, accumulates acc += G and the per-chunk sums of squares of
// v; the norm and each group's eta / max(norm, eps) follow in chunk order; pass 2 recomputes v and
// moves x. Bytes per element as SPEC §7: pass 1 reads G, D, acc (+H) and writes acc, pass 2 reads
// G, D, x (+H) and writes x.
#include <ATen/Parallel.h>

#include "cpu_ops.h"
#include "cpu_tile.h"

namespace fo {
namespace cpu {

namespace {

template <class A>
struct Bufs {
  alignas(64) A x[kTile], g[kTile], h[kTile], v[kTile];
};

// v = beta * G + D, or (G + D) - (1 - beta) * H with variance reduction (reference order)
template <class T, class A = Acc<T>>
const A* direction(const Entry& en, const PAdamHp& hp, int64_t off, int n, const A* G, Bufs<A>& b) {
  const A* D = static_cast<const A*>(en.ptr[padamfed_slot::D]) + off;
  if (hp.flags & kPadVarianceReduction) {
    const A* H = load<A>(static_cast<const T*>(en.ptr[padamfed_slot::H]) + off, n, b.h);
    add_sub_scaled(b.v, G, D, static_cast<A>(hp.one_minus_beta), H, n);
  } else {
    scaled_add(b.v, static_cast<A>(hp.beta), G, D, n);
  }
  return b.v;
}

template <class T, class L>
double norm_chunk(const Entry& en, const PAdamHp& hp, int64_t begin, int64_t end) {
  using A = Acc<T>;
  Bufs<A> b;
  L lanes[kLanes] = {};
  const T* Gs = static_cast<const T*>(en.ptr[padamfed_slot::G]);
  A* ACC = static_cast<A*>(en.ptr[padamfed_slot::ACC]);
  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* G = load<A>(Gs + off, n, b.g);
    sumsq<L>(direction<T>(en, hp, off, n, G, b), n, lanes);
    add(ACC + off, ACC + off, G, n);
  }
  return lanes_total(lanes);
}

template <class T>
void update_chunk(const Entry& en, const PAdamHp& hp, double scale, int64_t begin, int64_t end) {
  using A = Acc<T>;
  Bufs<A> b;
  const A s = static_cast<A>(scale);
  const T* Gs = static_cast<const T*>(en.ptr[padamfed_slot::G]);
  T* X = static_cast<T*>(en.ptr[padamfed_slot::X]);
  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* v = direction<T>(en, hp, off, n, load<A>(Gs + off, n, b.g), b);
    const A* x = load<A>(X + off, n, b.x);
    A* xo = out_ptr<A>(X + off, b.x);
    sub_times(xo, x, v, s, n);
    commit<A>(X + off, xo, n);
  }
}

}  // namespace

void padamfed(const std::vector<Entry>& entries, const std::vector<PAdamHp>& hps, bool norm_f64) {
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
  for (size_t g = 0; g < hps.size(); ++g) scale[g] = padamfed_scale(norm, hps[g], norm_f64);
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
