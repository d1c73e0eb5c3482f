// Element-wise tile loops of the CPU kernels, compiled once per ISA: the includer defines
// FO_CPU_ISA (the namespace: base / avx2) and, for avx2, has switched the target on.
//
// Inside a chunk, tiles of kTile elements are staged in L1-sized arrays and every optional term of
// an update is one tiny loop over the tile: each tensor still crosses memory once per pass, each
// loop is a plain element-wise loop the compiler vectorises, and there is no template instantiation
// per combination of options. float32 tensors are read and written in place (no staging);
// float16/bfloat16 are converted to float32 on load and rounded once on store.
//
// No include guard on purpose: included once per ISA namespace.

#include "cpu_common.h"

namespace fo {
namespace cpu {
namespace FO_CPU_ISA {

// Read n elements as compute type: the memory itself when no conversion is needed, else `buf`.
template <class A, class T>
inline const A* load(const T* src, int n, A* buf) {
  if constexpr (std::is_same<T, A>::value) {
    (void)n; (void)buf;
    return src;
  } else {
    FO_IVDEP for (int i = 0; i < n; ++i) buf[i] = static_cast<A>(src[i]);
    return buf;
  }
}

// Where to compute values destined for `dst`: `dst` itself when no conversion is needed, else `buf`.
template <class A, class T>
inline A* out_ptr(T* dst, A* buf) {
  if constexpr (std::is_same<T, A>::value) { (void)buf; return dst; }
  else { (void)dst; return buf; }
}

// Round the values computed at out_ptr(dst, buf) into dst (nothing to do without conversion).
template <class A, class T>
inline void commit(T* dst, const A* buf, int n) {
  if constexpr (!std::is_same<T, A>::value) {
    FO_IVDEP for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(buf[i]);
  } else {
    (void)dst; (void)buf; (void)n;
  }
}

// ---- element-wise steps; `out` may alias the first input (same index only) ----
// out = a * s  (GradScaler's unscaling)
template <class A>
inline void mul(A* out, const A* a, A s, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = a[i] * s;
}
template <class A>
inline void neg(A* out, const A* a, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = -a[i];
}
template <class A>
inline void add(A* out, const A* a, const A* b, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = a[i] + b[i];
}
// out = a + s * b
template <class A>
inline void add_scaled(A* out, const A* a, A s, const A* b, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = a[i] + s * b[i];
}
// out = a * s + t * b  (momentum: buf * momentum + (1 - dampening) * d)
template <class A>
inline void scale_add_scaled(A* out, const A* a, A s, A t, const A* b, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = a[i] * s + t * b[i];
}
// out = a + s * (x - y)  (FedProx term)
template <class A>
inline void add_scaled_diff(A* out, const A* a, A s, const A* x, const A* y, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = a[i] + s * (x[i] - y[i]);
}
// out = (a + b) - s * c  (PAdaMFed variance reduction)
template <class A>
inline void add_sub_scaled(A* out, const A* a, const A* b, A s, const A* c, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = (a[i] + b[i]) - s * c[i];
}
// out = s * a + b
template <class A>
inline void scaled_add(A* out, A s, const A* a, const A* b, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = s * a[i] + b[i];
}
// out = x - s * d
template <class A>
inline void sub_scaled(A* out, const A* x, A s, const A* d, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = x[i] - s * d[i];
}
// out = x - d * s  (PAdaMFed's operand order)
template <class A>
inline void sub_times(A* out, const A* x, const A* d, A s, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = x[i] - d[i] * s;
}
// out = x - s[i] * d
template <class A>
inline void sub_rowscaled(A* out, const A* x, const A* s, const A* d, int n) {
  FO_IVDEP for (int i = 0; i < n; ++i) out[i] = x[i] - s[i] * d[i];
}

// s[i] = lr * scale[row of element off + i]: rows of `row_len` elements.
template <class A>
inline void fill_rows(A* s, const A* scale, A lr, int64_t off, int64_t row_len, int n) {
  int64_t row = off / row_len, col = off - row * row_len;
  for (int i = 0; i < n; ++row, col = 0) {
    const A v = lr * scale[row];
    const int cnt = static_cast<int>(std::min<int64_t>(n - i, row_len - col));
    for (int j = 0; j < cnt; ++j) s[i + j] = v;
    i += cnt;
  }
}

// Sum of squares into kLanes fixed lanes: element i always goes to lane i % kLanes of its chunk,
// whatever the ISA's vector width, so the result is the same on every x86/ARM build. The lanes are
// float64 (squares of elements in [1e-30, 1e30] neither overflow nor underflow there).
template <class L, class A>
inline void sumsq(const A* v, int n, L* lanes) {
  int i = 0;
#if defined(__GNUC__)
  // kLanes lanes as 4-wide vectors: four elements are loaded and widened at once (vcvtps2pd under
  // AVX2, two SSE halves on the baseline build), element i still lands in lane i % kLanes
  typedef A VA __attribute__((vector_size(4 * sizeof(A)), aligned(alignof(A))));
  typedef L VL __attribute__((vector_size(4 * sizeof(L))));
  constexpr int kRegs = kLanes / 4;
  VL acc[kRegs];
  std::memcpy(acc, lanes, sizeof(acc));
  for (; i + kLanes <= n; i += kLanes) {
#pragma GCC unroll 4
    for (int r = 0; r < kRegs; ++r) {
      VA a;
      std::memcpy(&a, v + i + 4 * r, sizeof(a));
      const VL x = __builtin_convertvector(a, VL);
      acc[r] += x * x;
    }
  }
  std::memcpy(lanes, acc, sizeof(acc));
#else
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += static_cast<L>(v[i + j]) * static_cast<L>(v[i + j]);
#endif
  for (int j = 0; i + j < n; ++j) lanes[j] += static_cast<L>(v[i + j]) * static_cast<L>(v[i + j]);
}

template <class L>
inline double lanes_total(const L* lanes) {
  double s = 0.0;
  for (int j = 0; j < kLanes; ++j) s += static_cast<double>(lanes[j]);
  return s;
}

// Staging buffers of one tile of a two-pass op: the parameters, the gradients, the op's direction
// (FedNAR's d, PAdaMFed's v) and one more staged input (a correction, x0 or anchor gradient)
template <class A>
struct TileBufs {
  alignas(64) A x[kTile], g[kTile], d[kTile], t[kTile];
};

// f(tag, c, chunk, entry) for chunks [lo, hi) of one parallel_for range, `tag` of the entry's C++
// storage type
template <class F>
inline void each_chunk(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi, const std::vector<Entry>& entries,
                       F&& f) {
  for (int64_t c = lo; c < hi; ++c) {
    const Chunk& ch = chunks[c];
    const Entry& en = entries[ch.entry];
    dispatch(en.dtype, [&](auto tag) { f(tag, c, ch, en); });
  }
}

// The chunk loops of a two-pass op (two_pass.h), for its tile code K (CRTP: struct K : TwoPass<K>):
//   K::norm_tile<T>(en, hp, off, n, bufs) -> const A*   pass 1: the n values whose squares form
//                                                the norm (and the pass's writes, e.g. acc)
//   K::update_tile<T>(xo, X, factor, en, hp, off, n, bufs)  pass 2: the moved parameters into xo
//                                                (out_ptr of X) from the stored X and factor s
template <class K>
struct TwoPass {
  template <class T, class Hp>
  static double norm_chunk(const Entry& en, const Hp& hp, int64_t begin, int64_t end) {
    TileBufs<Acc<T>> b;
    double lanes[kLanes] = {};
    for (int64_t off = begin; off < end; off += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
      sumsq<double>(K::template norm_tile<T>(en, hp, off, n, b), n, lanes);
    }
    return lanes_total(lanes);
  }

  template <class T, class Hp>
  static void update_chunk(const Entry& en, const Hp& hp, double factor, int64_t begin, int64_t end) {
    using A = Acc<T>;
    TileBufs<A> b;
    T* X = static_cast<T*>(en.ptr[kParamSlot]);
    for (int64_t off = begin; off < end; off += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
      A* xo = out_ptr<A>(X + off, b.x);
      K::template update_tile<T>(xo, X + off, static_cast<A>(factor), en, hp, off, n, b);
      commit<A>(X + off, xo, n);
    }
  }

  template <class Hp>
  static void norm_chunks(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi, const std::vector<Entry>& entries,
                          const std::vector<Hp>& hps, double* partial) {
    each_chunk(chunks, lo, hi, entries, [&](auto tag, int64_t c, const Chunk& ch, const Entry& en) {
      partial[c] = norm_chunk<decltype(tag)>(en, hps[en.group], ch.begin, ch.end);
    });
  }

  template <class Hp>
  static void update_chunks(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi,
                            const std::vector<Entry>& entries, const std::vector<Hp>& hps,
                            const std::vector<double>& factors) {
    each_chunk(chunks, lo, hi, entries, [&](auto tag, int64_t, const Chunk& ch, const Entry& en) {
      update_chunk<decltype(tag)>(en, hps[en.group], factors[en.group], ch.begin, ch.end);
    });
  }
};


}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
