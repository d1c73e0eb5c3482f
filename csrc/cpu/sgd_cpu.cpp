// Op "sgd" (and "sgd_batched") on CPU (FedDecaySGD / NeuronLRSGD): one pass, every tensor of every
// group (of every client).
#include "cpu_common.h"
#include "cpu_ops.h"

#define FO_CPU_ISA base
#include "sgd_tiles.h"
#undef FO_CPU_ISA

#if FO_CPU_AVX2
#pragma GCC push_options
#pragma GCC target("avx2")
#define FO_CPU_ISA avx2
#include "sgd_tiles.h"
#undef FO_CPU_ISA
#pragma GCC pop_options
#endif

namespace fo {
namespace cpu {

void sgd(const std::vector<Entry>& entries, const std::vector<SgdHp>& hps, const std::vector<double>& lr) {
  const std::vector<Chunk> chunks = make_chunks(entries);
  const bool avx2 = use_avx2();
  for_chunks(chunks, [&](int64_t lo, int64_t hi) {
#if FO_CPU_AVX2
    if (avx2) return avx2::sgd_chunks(chunks, lo, hi, entries, hps, lr);
#endif
    (void)avx2;
    base::sgd_chunks(chunks, lo, hi, entries, hps, lr);
  });
}

}  // namespace cpu
}  // namespace fo
