// Op "fedadam" (and "fedadam_batched") on CPU (FedAdam / FedYogi / FedAdagrad): one pass, every tensor
// of every group (of every client), each hp row's factors formed once from its client's counter.
#include "../common/fedadam_hp.h"
#include "step_rows.h"
#define FO_CPU_TILES "fedadam_tiles.h"
#include "isa_copies.h"

namespace fo {
namespace cpu {

namespace {
// Base / Avx2: the two copies (FO_CPU_COPIES) of FedAdamKernel
template <class Base, class Avx2>
void fedadam_pass(const std::vector<Entry>& entries, const std::vector<FedAdamStep<float>>& f32,
                  const std::vector<FedAdamStep<double>>& f64) {
  const std::vector<Chunk> chunks = make_chunks(entries);
  const bool avx2 = use_avx2();
  for_chunks(chunks, [&](int64_t lo, int64_t hi) {
    if (avx2) Avx2::chunks(chunks, lo, hi, entries, f32, f64);
    else Base::chunks(chunks, lo, hi, entries, f32, f64);
  });
}
}  // namespace

template <>
void step<spec::fedadam>(const std::vector<Entry>& entries, const Gathered& gat, const StepScalars& sc) {
  const std::vector<FedAdamHp> hps = hp_rows<FedAdamHp>(gat, sc);
  const int64_t per = clients_of(sc);
  std::vector<FedAdamStep<float>> f32;
  std::vector<FedAdamStep<double>> f64;
  f32.reserve(hps.size());
  f64.reserve(hps.size());
  for (size_t g = 0; g < hps.size(); ++g) {
    const int32_t k = sc.k[static_cast<int64_t>(g) % per];
    f32.push_back(FedAdamStep<float>::at(hps[g], k));
    f64.push_back(FedAdamStep<double>::at(hps[g], k));
  }
  fedadam_pass<FO_CPU_COPIES(FedAdamKernel)>(entries, f32, f64);
}

}  // namespace cpu
}  // namespace fo
