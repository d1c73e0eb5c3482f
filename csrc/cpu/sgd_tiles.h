// Op "sgd" chunk code for one ISA (see cpu_common.h); included by sgd_cpu.cpp once per ISA.
// Operation order = fedopt_kernels/reference/sgd.py, so float32 results match it bit for bit.
#include "cpu_tile.h"

#include "../common/fo_hp.h"

namespace fo {
namespace cpu {
namespace FO_CPU_ISA {

template <class T>
void sgd_chunk(const Entry& en, const SgdHp& hp, double lr_k, int64_t begin, int64_t end) {
  using A = Acc<T>;
  alignas(64) A gbuf[kTile], xbuf[kTile], dbuf[kTile], tbuf[kTile], bbuf[kTile], nbuf[kTile], sbuf[kTile];
  const int f = hp.flags;
  const A lr = static_cast<A>(lr_k), wd = static_cast<A>(hp.weight_decay), mu = static_cast<A>(hp.prox_mu);
  const A mom = static_cast<A>(hp.momentum), damp1 = static_cast<A>(hp.damp1);
  T* X = static_cast<T*>(en.ptr[sgd_slot::X]);
  const T* G = static_cast<const T*>(en.ptr[sgd_slot::G]);
  T* B = static_cast<T*>(en.ptr[sgd_slot::BUF]);
  const T* X0 = static_cast<const T*>(en.ptr[sgd_slot::X0]);
  const T* C = static_cast<const T*>(en.ptr[sgd_slot::CORR]);
  const A* R = static_cast<const A*>(en.ptr[sgd_slot::SCALE]);

  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* x = load<A>(X + off, n, xbuf);
    const A* d = load<A>(G + off, n, gbuf);
    if (f & kSgdMaximize) { neg(dbuf, d, n); d = dbuf; }
    if (f & kSgdWeightDecay) { add_scaled(dbuf, d, wd, x, n); d = dbuf; }
    if (f & kSgdCorrection) { add(dbuf, d, load<A>(C + off, n, tbuf), n); d = dbuf; }
    if (f & kSgdProx) { add_scaled_diff(dbuf, d, mu, x, load<A>(X0 + off, n, tbuf), n); d = dbuf; }
    if (f & kSgdMomentum) {
      // the update uses the new buffer before it is rounded to the storage dtype, as the reference does
      A* nb = out_ptr<A>(B + off, nbuf);
      scale_add_scaled(nb, load<A>(B + off, n, bbuf), mom, damp1, d, n);
      commit<A>(B + off, nb, n);
      if (f & kSgdNesterov) { add_scaled(dbuf, d, mom, nb, n); d = dbuf; }
      else d = nb;
    }
    A* xo = out_ptr<A>(X + off, xbuf);
    if (f & kSgdScale) {
      fill_rows(sbuf, R, lr, off, en.row_len, n);
      sub_rowscaled(xo, x, sbuf, d, n);
    } else {
      sub_scaled(xo, x, lr, d, n);
    }
    commit<A>(X + off, xo, n);
  }
}

// chunks [lo, hi) of one parallel_for range
inline void sgd_chunks(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi, const std::vector<Entry>& entries,
                       const std::vector<SgdHp>& hps, const std::vector<double>& lr) {
  for (int64_t c = lo; c < hi; ++c) {
    const Chunk& ch = chunks[c];
    const Entry& en = entries[ch.entry];
    dispatch(en.dtype, [&](auto tag) { sgd_chunk<decltype(tag)>(en, hps[en.group], lr[en.group], ch.begin, ch.end); });
  }
}

}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
