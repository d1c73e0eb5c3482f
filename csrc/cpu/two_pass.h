// The driver both global-norm ops (FedNAR, PAdaMFed) share on the CPU: pass 1 writes one sum of
// squares per fixed chunk, each segment's norm (a client of a batched op; the whole step of a
// per-client op, which is the one-segment case) and each group's factor (common/<op>_hp.h
// factor) are formed from them in chunk order on this thread (so the result does not depend on
// the thread count), pass 2 applies the factors.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "../common/fo_hp.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "step_rows.h"

namespace fo {
namespace cpu {

// Base / Avx2: the two copies (FO_CPU_COPIES) of the op's chunk code, a TwoPass<K> (cpu_tile.h).
template <class Base, class Avx2, class Hp>
void two_pass_norm_step(const std::vector<Entry>& entries, const std::vector<Hp>& hps, bool norm_f64) {
  const bool avx2 = use_avx2();
  const std::vector<Chunk> chunks = make_chunks(entries);
  std::vector<double> partial(chunks.size(), 0.0);
  for_chunks(chunks, [&](int64_t lo, int64_t hi) {
    if (avx2) Avx2::norm_chunks(chunks, lo, hi, entries, hps, partial.data());
    else Base::norm_chunks(chunks, lo, hi, entries, hps, partial.data());
  });
  // a group's entries all belong to one segment (hp row b * C + c is client c's); groups without
  // entries get segment 0's norm, and their factor is never read
  std::vector<int32_t> segment_of(hps.size(), 0);
  int32_t segments = 1;
  for (const Entry& e : entries) {
    segment_of[e.group] = e.segment;
    segments = std::max(segments, e.segment + 1);
  }
  const NormReduceHook& hook = norm_reduce_hook();
  TORCH_CHECK(!hook.fn || segments == 1, "fedopt_kernels cpu: a cross-rank norm needs a per-client op");
  const std::vector<double> norm =
      hook.fn ? reduced_norm(chunks, entries.size(), partial, hook) : segment_norms(chunks, entries, partial, segments);
  std::vector<double> factors(hps.size());
  for (size_t g = 0; g < hps.size(); ++g) factors[g] = factor(norm[segment_of[g]], hps[g], norm_f64);
  for_chunks(chunks, [&](int64_t lo, int64_t hi) {
    if (avx2) Avx2::update_chunks(chunks, lo, hi, entries, hps, factors);
    else Base::update_chunks(chunks, lo, hi, entries, hps, factors);
  });
}

}  // namespace cpu
}  // namespace fo

// Defines op NAME's entry point (cpu_ops.h) from its hp struct HP and the chunk code K of its tiles
// header (compiled per ISA by isa_copies.h, included before this macro).
#define FO_CPU_TWO_PASS_OP(NAME, HP, K)                                                                   \
  namespace fo {                                                                                          \
  namespace cpu {                                                                                         \
  template <>                                                                                             \
  void step<spec::NAME>(const std::vector<Entry>& entries, const Gathered& gat, const StepScalars& sc) { \
    two_pass_norm_step<FO_CPU_COPIES(K)>(entries, hp_rows<HP>(gat, sc), gat.any_f64);                   \
  }                                                                                                       \
  }                                                                                                       \
  }
