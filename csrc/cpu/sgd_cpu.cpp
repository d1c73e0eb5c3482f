// Op "sgd" (and "sgd_batched") on CPU (FedDecaySGD / NeuronLRSGD): one pass, every tensor of every
// group (of every client).
#include "cpu_ops.h"
#define FO_CPU_TILES "sgd_tiles.h"
#include "isa_copies.h"

namespace fo {
namespace cpu {

namespace {
// Base / Avx2: the two copies (FO_CPU_COPIES) of SgdKernel
template <class Base, class Avx2>
void sgd_pass(const std::vector<Entry>& entries, const std::vector<SgdHp>& hps, const std::vector<double>& lr) {
  const std::vector<Chunk> chunks = make_chunks(entries);
  const bool avx2 = use_avx2();
  for_chunks(chunks, [&](int64_t lo, int64_t hi) {
    if (avx2) Avx2::chunks(chunks, lo, hi, entries, hps, lr);
    else Base::chunks(chunks, lo, hi, entries, hps, lr);
  });
}
}  // namespace

void sgd(const std::vector<Entry>& entries, const std::vector<SgdHp>& hps, const std::vector<double>& lr) {
  sgd_pass<FO_CPU_COPIES(SgdKernel)>(entries, hps, lr);
}

}  // namespace cpu
}  // namespace fo
