// What the CPU kernels share regardless of the instruction set they are compiled for.
//
// Work is cut into fixed chunks of kChunk elements (never crossing a tensor), so the global norm's
// partial sums, one per chunk, do not depend on the number of threads. Each op's chunk code
// (<op>_tiles.h) is compiled twice: for the baseline ISA of the build (SSE2 on x86-64) and, with
// GCC on x86-64, for AVX2 via `#pragma GCC target`; use_avx2() picks one at run time, so the
// library runs on any x86-64 CPU. Both give the same bits: the loops are element-wise, the sums
// of squares use fixed lanes, and FMA contraction is off.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/fo_entry.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FO_CPU_AVX2 1  // build an AVX2 copy of the chunk code
#else
#define FO_CPU_AVX2 0
#endif

// The copies of chunk code K (isa_copies.h) as template arguments <base::K, avx2::K>, for the
// drivers that pick one with use_avx2() at run time.
#if FO_CPU_AVX2
#define FO_CPU_COPIES(K) base::K, avx2::K
#else
#define FO_CPU_COPIES(K) base::K, base::K
#endif

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
constexpr int kParamSlot = 0;      // every op's first role is its parameters (fedopt_kernels/core/ops.py)
// A pass over fewer elements than this stays on the calling thread: waking a second thread costs
// more than the work (and, on a machine where other processes hold the cores, a scheduler
// quantum: milliseconds for a microsecond step).
constexpr int64_t kSerialElements = int64_t(1) << 16;

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

// Sharded parameters (fedopt_kernels/core/dtensor.py): a per-client norm op's rank holds only its
// shards, so its sum of squares is reduced over the ranks between the two passes. The hook gets
// this rank's float64 sum of squares of each entry (in entry order) and returns the sum over every
// rank; it is set for one op call on the calling thread (NormReduceScope), and null otherwise.
using NormReduce = double (*)(void* ctx, const double* per_entry, int64_t n);
struct NormReduceHook {
  NormReduce fn = nullptr;
  void* ctx = nullptr;
};
NormReduceHook& norm_reduce_hook();

class NormReduceScope {
 public:
  NormReduceScope(NormReduce fn, void* ctx) : saved_(norm_reduce_hook()) { norm_reduce_hook() = {fn, ctx}; }
  ~NormReduceScope() { norm_reduce_hook() = saved_; }
  NormReduceScope(const NormReduceScope&) = delete;
  NormReduceScope& operator=(const NormReduceScope&) = delete;

 private:
  NormReduceHook saved_;
};

// The one norm of a per-client op whose sums are reduced by `hook`: entry sums in chunk order,
// then the hook.
std::vector<double> reduced_norm(const std::vector<Chunk>& chunks, size_t n_entries, const std::vector<double>& partials,
                                 const NormReduceHook& hook);

// Norm of each segment (index = Entry::segment < segments): sqrt of the sum of its chunks'
// partials, added in chunk order on the calling thread.
std::vector<double> segment_norms(const std::vector<Chunk>& chunks, const std::vector<Entry>& entries,
                                  const std::vector<double>& partials, int32_t segments);

// f(lo, hi) over chunk ranges: on this thread for small passes, else at::parallel_for. The
// chunks are the same either way, so the results (and the norm's partials) are too.
template <class F>
inline void for_chunks(const std::vector<Chunk>& chunks, F&& f) {
  const int64_t nc = static_cast<int64_t>(chunks.size());
  int64_t numel = 0;
  for (const Chunk& c : chunks) numel += c.end - c.begin;
  if (numel < kSerialElements) {
    if (nc > 0) f(int64_t(0), nc);
    return;
  }
  at::parallel_for(0, nc, kGrain, f);
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

// Run the AVX2 copy of the chunk code? (CPU support, unless set_isa() forced a choice)
bool use_avx2();
// "auto" (default), "base" or "avx2"; returns false when the request cannot be honoured.
bool set_isa(const char* name);
const char* active_isa();

}  // namespace cpu
}  // namespace fo
