// Op "sgd" (and "sgd_batched") on CPU (FedDecaySGD / NeuronLRSGD): one pass, every tensor of every
// group (of every client).
#include "../common/sgd_hp.h"
#include "step_rows.h"
#define FO_CPU_TILES "sgd_tiles.h"
#include "isa_copies.h"

namespace fo {
namespace cpu {

namespace {
// lr[g]: hp row g's learning rate of this step (lr_k, from the schedule and the row's client's k).
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

// SGD's rows and each row's lr_k from its client's counter. sgd_batched's first-step rule: in a
// row group flagged FRESH (new momentum buffers this round), a client at k == 0 takes dampening 0
// (buf = d), as the per-client optimizer does on its first step.
void sgd_rows(const Gathered& gat, const StepScalars& sc, std::vector<SgdHp>& hps, std::vector<double>& lr) {
  hps = hp_rows<SgdHp>(gat, sc);
  const int64_t per = clients_of(sc);
  lr.resize(hps.size());
  for (size_t g = 0; g < hps.size(); ++g) {
    const int32_t k = sc.k[static_cast<int64_t>(g) % per];
    lr[g] = sgd_lr<double>(hps[g], k, sc.table, sc.table_len, sc.decay_every);
    if (sc.clients > 0 && k == 0 && (gat.present[static_cast<int64_t>(g) / per] & kFreshBit)) hps[g].damp1 = 1.0;
  }
}
}  // namespace

template <>
void step<spec::sgd>(const std::vector<Entry>& entries, const Gathered& gat, const StepScalars& sc) {
  std::vector<SgdHp> hp;
  std::vector<double> lr;
  sgd_rows(gat, sc, hp, lr);
  sgd_pass<FO_CPU_COPIES(SgdKernel)>(entries, hp, lr);
}

}  // namespace cpu
}  // namespace fo
