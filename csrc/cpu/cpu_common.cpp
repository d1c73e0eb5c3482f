// Run-time choice of the chunk code's ISA, and the fixed-order end of the per-segment norms.
#include <atomic>
#include <cmath>
#include <cstring>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace fo {
namespace cpu {

namespace {
// -1: automatic (CPU support), 0: baseline, 1: AVX2
std::atomic<int> g_isa{-1};

bool cpu_supports_avx2() {
#if FO_CPU_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");  // checks the OS saves AVX state too
#else
  return false;
#endif
}
}  // namespace

bool use_avx2() {
  static const bool supported = cpu_supports_avx2();
  const int forced = g_isa.load(std::memory_order_relaxed);
  return forced < 0 ? supported : (forced == 1 && supported);
}

bool set_isa(const char* name) {
  if (std::strcmp(name, "auto") == 0) { g_isa = -1; return true; }
  if (std::strcmp(name, "base") == 0) { g_isa = 0; return true; }
  if (std::strcmp(name, "avx2") == 0) { g_isa = 1; return cpu_supports_avx2(); }
  return false;
}

const char* active_isa() { return use_avx2() ? "avx2" : "base"; }

std::vector<double> segment_norms(const std::vector<Chunk>& chunks, const std::vector<Entry>& entries,
                                  const std::vector<double>& partials, int32_t segments) {
  std::vector<double> total(segments, 0.0);
  // chunk order, whatever the thread count; a segment's chunks are added in the order they come
  if (segments == 1) {
    for (double p : partials) total[0] += p;  // a per-client op: no lookup per chunk
  } else {
    for (size_t c = 0; c < chunks.size(); ++c) total[entries[chunks[c].entry].segment] += partials[c];
  }
  for (double& t : total) t = std::sqrt(t);
  return total;
}

NormReduceHook& norm_reduce_hook() {
  static thread_local NormReduceHook hook;
  return hook;
}

std::vector<double> reduced_norm(const std::vector<Chunk>& chunks, size_t n_entries, const std::vector<double>& partials,
                                 const NormReduceHook& hook) {
  std::vector<double> per_entry(n_entries, 0.0);
  for (size_t c = 0; c < chunks.size(); ++c) per_entry[chunks[c].entry] += partials[c];
  return {std::sqrt(hook.fn(hook.ctx, per_entry.data(), static_cast<int64_t>(n_entries)))};
}

}  // namespace cpu
}  // namespace fo
