// Building blocks of the CPU kernels.
//
// Work is cut into fixed chunks of kChunk elements (never crossing a tensor), so the global norm's
// partial sums, one per chunk, do not depend on the number of threads. Inside a chunk, tiles of
// kTile elements are staged in L1-sized arrays and every optional term of the update is one tiny
// loop over the tile: each tensor still crosses memory once per pass, and each loop is a plain
// element-wise loop the compiler vectorises for whatever ISA it targets, without one template
// instantiation per combination of options. float32 tensors are read and written in place
// (no staging); float16/bfloat16 are converted to float32 on load and rounded once on store.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/fo_entry.h"

#if defined(__clang__)
#define FO_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define FO_IVDEP _Pragma("GCC ivdep")
#else
#define FO_IVDEP
#endif

namespace fo {
namespace cpu {

constexpr int64_t kChunk = 16384;  // elements per work item and per norm partial (fixed: determinism)
constexpr int kTile = 512;         // elements staged per step inside a chunk
constexpr int kLanes = 16;         // independent sum-of-squares accumulators (vector lanes)
constexpr int64_t kGrain = 4;      // chunks below which a pass stays on one thread

// Compute type: float32 for float32/float16/bfloat16, float64 for float64.
template <class T>
using Acc = typename std::conditional<std::is_same<T, double>::value, double, float>::type;

struct Chunk {
  int32_t entry;
  int64_t begin, end;
};

inline std::vector<Chunk> make_chunks(const std::vector<Entry>& entries) {
  std::vector<Chunk> out;
  for (size_t e = 0; e < entries.size(); ++e)
    for (int64_t b = 0; b < entries[e].numel; b += kChunk)
      out.push_back({static_cast<int32_t>(e), b, std::min(entries[e].numel, b + kChunk)});
  return out;
}

// Call f(T{}) with T the C++ storage type of `t`.
template <class F>
inline void dispatch(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F16: f(c10::Half{}); break;
    case DType::BF16: f(c10::BFloat16{}); break;
    case DType::F64: f(double{}); break;
  }
}

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
// whatever the ISA's vector width, so the result is the same on every x86/ARM build. Lanes are
// float32, or float64 when the step's norm is float64 (a float64 parameter is present: the
// reference then accumulates every tensor in float64).
template <class L, class A>
inline void sumsq(const A* v, int n, L* lanes) {
  L acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = lanes[j];
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += static_cast<L>(v[i + j]) * static_cast<L>(v[i + j]);
  for (int j = 0; i + j < n; ++j) acc[j] += static_cast<L>(v[i + j]) * static_cast<L>(v[i + j]);
  for (int j = 0; j < kLanes; ++j) lanes[j] = acc[j];
}

template <class L>
inline double lanes_total(const L* lanes) {
  double s = 0.0;
  for (int j = 0; j < kLanes; ++j) s += static_cast<double>(lanes[j]);
  return s;
}

}  // namespace cpu
}  // namespace fo
