// The CPU kernels: one parallel pass over all tensors per pass of the algorithm. An entry's `group` picks its hp
// row; FedNAR / PAdaMFed form one norm per `segment` (one client of a batched op).
#pragma once

#include <cstdint>
#include <vector>

#include "../common/fo_entry.h"
#include "../common/fo_hp.h"

namespace fo {
namespace cpu {

// lr[g]: hp row g's learning rate of this step (lr_k: the caller applies the schedule and k)
void sgd(const std::vector<Entry>& entries, const std::vector<SgdHp>& hps, const std::vector<double>& lr);

void fednar(const std::vector<Entry>& entries, const std::vector<FedNarHp>& hps, bool norm_f64);

void padamfed(const std::vector<Entry>& entries, const std::vector<PAdamHp>& hps, bool norm_f64);

}  // namespace cpu
}  // namespace fo
