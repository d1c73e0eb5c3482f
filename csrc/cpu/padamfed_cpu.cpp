// Op "padamfed" (and "padamfed_batched") on CPU: pass 1 forms v, accumulates acc += G and the
// per-chunk sums of squares of v; each segment's (client's) norm and each group's eta / max(norm,
// eps) follow in chunk order; pass 2 recomputes v and moves x. Bytes per element as docs/benchmarks.md counts them:
// pass 1 reads G, D, acc (+H) and writes acc, pass 2 reads G, D, x (+H) and writes x.
#include "cpu_common.h"
#include "cpu_ops.h"
#include "two_pass.h"

#define FO_CPU_ISA base
#include "padamfed_tiles.h"
#undef FO_CPU_ISA

#if FO_CPU_AVX2
#pragma GCC push_options
#pragma GCC target("avx2")
#define FO_CPU_ISA avx2
#include "padamfed_tiles.h"
#undef FO_CPU_ISA
#pragma GCC pop_options
#endif

namespace fo {
namespace cpu {

void padamfed(const std::vector<Entry>& entries, const std::vector<PAdamHp>& hps, bool norm_f64) {
  const bool avx2 = use_avx2();
  (void)avx2;
  two_pass_norm_step(
      entries, hps, norm_f64,
      [&](const std::vector<Chunk>& chunks, int64_t lo, int64_t hi, double* partial) {
#if FO_CPU_AVX2
        if (avx2) return avx2::padamfed_norm_chunks(chunks, lo, hi, entries, hps, partial);
#endif
        base::padamfed_norm_chunks(chunks, lo, hi, entries, hps, partial);
      },
      [](double norm, const PAdamHp& hp, bool f64) { return padamfed_scale(norm, hp, f64); },
      [&](const std::vector<Chunk>& chunks, int64_t lo, int64_t hi, const std::vector<double>& scale) {
#if FO_CPU_AVX2
        if (avx2) return avx2::padamfed_update_chunks(chunks, lo, hi, entries, hps, scale);
#endif
        base::padamfed_update_chunks(chunks, lo, hi, entries, hps, scale);
      });
}

}  // namespace cpu
}  // namespace fo
