// Op "fednar" on CPU: pass 1 computes d and its per-chunk sums of squares, the norm and each
// group's scale are formed from them in chunk order, pass 2 recomputes d and updates x.
// (Recomputing d reads x and g again: that is SPEC §7's 20 B/element, cheaper than storing d.)
#include <ATen/Parallel.h>

#include "cpu_common.h"
#include "cpu_ops.h"

#define FO_CPU_ISA base
#include "fednar_tiles.h"
#undef FO_CPU_ISA

#if FO_CPU_AVX2
#pragma GCC push_options
#pragma GCC target("avx2")
#define FO_CPU_ISA avx2
#include "fednar_tiles.h"
#undef FO_CPU_ISA
#pragma GCC pop_options
#endif

namespace fo {
namespace cpu {

void fednar(const std::vector<Entry>& entries, const std::vector<FedNarHp>& hps, bool norm_f64) {
  const std::vector<Chunk> chunks = make_chunks(entries);
  const int64_t nc = static_cast<int64_t>(chunks.size());
  const bool avx2 = use_avx2();
  (void)avx2;
  std::vector<double> partial(chunks.size(), 0.0);
  at::parallel_for(0, nc, kGrain, [&](int64_t lo, int64_t hi) {
#if FO_CPU_AVX2
    if (avx2) return avx2::fednar_norm_chunks(chunks, lo, hi, entries, hps, norm_f64, partial.data());
#endif
    base::fednar_norm_chunks(chunks, lo, hi, entries, hps, norm_f64, partial.data());
  });
  const double norm = finish_norm(partial);
  std::vector<double> scale(hps.size());
  for (size_t g = 0; g < hps.size(); ++g) scale[g] = fednar_scale(norm, hps[g], norm_f64);
  at::parallel_for(0, nc, kGrain, [&](int64_t lo, int64_t hi) {
#if FO_CPU_AVX2
    if (avx2) return avx2::fednar_update_chunks(chunks, lo, hi, entries, hps, scale);
#endif
    base::fednar_update_chunks(chunks, lo, hi, entries, hps, scale);
  });
}

}  // namespace cpu
}  // namespace fo
