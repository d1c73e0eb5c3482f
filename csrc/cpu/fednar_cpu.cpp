// Op "fednar" (and "fednar_batched") on CPU: pass 1 computes d and its per-chunk sums of squares,
// each segment's norm (one per client) and each group's scale are formed from them in chunk order,
// pass 2 recomputes d and updates x.
// (Recomputing d reads x and g again: that is the 20 B/element counted in docs/benchmarks.md, cheaper than storing d.)
#include "cpu_common.h"
#include "cpu_ops.h"
#include "two_pass.h"

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
  const bool avx2 = use_avx2();
  (void)avx2;
  two_pass_norm_step(
      entries, hps, norm_f64,
      [&](const std::vector<Chunk>& chunks, int64_t lo, int64_t hi, double* partial) {
#if FO_CPU_AVX2
        if (avx2) return avx2::fednar_norm_chunks(chunks, lo, hi, entries, hps, partial);
#endif
        base::fednar_norm_chunks(chunks, lo, hi, entries, hps, partial);
      },
      [](double norm, const FedNarHp& hp, bool f64) { return fednar_scale(norm, hp, f64); },
      [&](const std::vector<Chunk>& chunks, int64_t lo, int64_t hi, const std::vector<double>& scale) {
#if FO_CPU_AVX2
        if (avx2) return avx2::fednar_update_chunks(chunks, lo, hi, entries, hps, scale);
#endif
        base::fednar_update_chunks(chunks, lo, hi, entries, hps, scale);
      });
}

}  // namespace cpu
}  // namespace fo
