// The driver both global-norm ops (FedNAR, PAdaMFed) share on the CPU: pass 1 writes one sum of
// squares per fixed chunk, each segment's norm (a client of a batched op; the whole step of a
// per-client op, which is the one-segment case) and each group's scale are formed from them in
// chunk order on this thread (so the result does not depend on the thread count), pass 2 applies
// the scales.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace fo {
namespace cpu {

// norm_pass(chunks, lo, hi, partials) and update_pass(chunks, lo, hi, scales) run chunks [lo, hi);
// scale_of(norm, hp, norm_f64) gives one group's factor from the norm of the group's segment.
template <class Hp, class NormPass, class ScaleOf, class UpdatePass>
void two_pass_norm_step(const std::vector<Entry>& entries, const std::vector<Hp>& hps, bool norm_f64,
                        NormPass&& norm_pass, ScaleOf&& scale_of, UpdatePass&& update_pass) {
  const std::vector<Chunk> chunks = make_chunks(entries);
  std::vector<double> partial(chunks.size(), 0.0);
  for_chunks(chunks, [&](int64_t lo, int64_t hi) { norm_pass(chunks, lo, hi, partial.data()); });
  // a group's entries all belong to one segment (hp row b * C + c is client c's); groups without
  // entries get segment 0's norm, and their scale is never read
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
  std::vector<double> scale(hps.size());
  for (size_t g = 0; g < hps.size(); ++g) scale[g] = scale_of(norm[segment_of[g]], hps[g], norm_f64);
  for_chunks(chunks, [&](int64_t lo, int64_t hi) { update_pass(chunks, lo, hi, scale); });
}

}  // namespace cpu
}  // namespace fo
