// Run-time choice of the chunk code's ISA, and the fixed-order end of the norm.
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

double finish_norm(const std::vector<double>& partials) {
  double total = 0.0;
  for (double p : partials) total += p;  // chunk order, whatever the thread count
  return std::sqrt(total);
}

}  // namespace cpu
}  // namespace fo
