// Op "sgd" chunk code for one ISA (see cpu_common.h); included by sgd_cpu.cpp once per ISA (isa_copies.h).
// Operation order = fedopt_kernels/core/reference/sgd.py, so float32 results match it bit for bit.
#include "cpu_tile.h"

#include "../common/sgd_hp.h"

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
    if (f & kSgdUnscale) { mul(dbuf, d, static_cast<A>(hp.inv_scale), n); d = dbuf; }
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

// Fast path for the common configurations (float32/float64 storage; optional weight decay, momentum /
// Nesterov and neuron scales, nothing else): one loop per scale row, no staging, so the compiler
// vectorises it with the row's rate as a constant. Same operations in the same order as sgd_chunk
// (rate = lr * scale[row], then x - rate * d), so the same bits.
template <class T, bool kWd, bool kMom, bool kNest, bool kScale>
void sgd_fused_chunk(const Entry& en, const SgdHp& hp, double lr_k, int64_t begin, int64_t end) {
  const T lr = static_cast<T>(lr_k), wd = static_cast<T>(hp.weight_decay);
  const T mom = static_cast<T>(hp.momentum), damp1 = static_cast<T>(hp.damp1);
  T* X = static_cast<T*>(en.ptr[sgd_slot::X]);
  const T* G = static_cast<const T*>(en.ptr[sgd_slot::G]);
  T* B = static_cast<T*>(en.ptr[sgd_slot::BUF]);
  const auto span = [&](int64_t lo, int64_t hi, const T rate) {
    FO_IVDEP for (int64_t i = lo; i < hi; ++i) {
      const T x = X[i];
      T d = G[i];
      if constexpr (kWd) d = d + wd * x;
      if constexpr (kMom) {
        const T b = B[i] * mom + damp1 * d;
        B[i] = b;
        d = kNest ? d + mom * b : b;
      }
      X[i] = x - rate * d;
    }
  };
  if constexpr (!kScale) {
    span(begin, end, lr);
  } else {
    const T* R = static_cast<const T*>(en.ptr[sgd_slot::SCALE]);
    for (int64_t lo = begin, row = begin / en.row_len; lo < end; ++row) {
      const int64_t hi = std::min(end, (row + 1) * en.row_len);
      span(lo, hi, lr * R[row]);
      lo = hi;
    }
  }
}

// The fast-path instantiation for these flags, or nullptr (then sgd_chunk handles it).
using SgdChunkFn = void (*)(const Entry&, const SgdHp&, double, int64_t, int64_t);

template <class T, bool kScale>
SgdChunkFn sgd_fast_path_of(int f) {
  const bool wd = f & kSgdWeightDecay, mom = f & kSgdMomentum, nest = f & kSgdNesterov;
  if (!mom) return wd ? sgd_fused_chunk<T, true, false, false, kScale> : sgd_fused_chunk<T, false, false, false, kScale>;
  if (nest) return wd ? sgd_fused_chunk<T, true, true, true, kScale> : sgd_fused_chunk<T, false, true, true, kScale>;
  return wd ? sgd_fused_chunk<T, true, true, false, kScale> : sgd_fused_chunk<T, false, true, false, kScale>;
}

template <class T>
SgdChunkFn sgd_fast_path(int f) {
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value) {
    if (f & (kSgdMaximize | kSgdCorrection | kSgdProx | kSgdUnscale)) return nullptr;
    return (f & kSgdScale) ? sgd_fast_path_of<T, true>(f) : sgd_fast_path_of<T, false>(f);
  } else {
    (void)f;
    return nullptr;
  }
}

// chunks [lo, hi) of one parallel_for range
struct SgdKernel {
  static void chunks(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi, const std::vector<Entry>& entries,
                     const std::vector<SgdHp>& hps, const std::vector<double>& lr) {
    each_chunk(chunks, lo, hi, entries, [&](auto tag, int64_t, const Chunk& ch, const Entry& en) {
      using T = decltype(tag);
      const SgdHp& hp = hps[en.group];
      if (const SgdChunkFn fast = sgd_fast_path<T>(hp.flags)) fast(en, hp, lr[en.group], ch.begin, ch.end);
      else sgd_chunk<T>(en, hp, lr[en.group], ch.begin, ch.end);
    });
  }
};

}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
