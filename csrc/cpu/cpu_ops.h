// The CPU kernels: one parallel pass over all tensors per SPEC pass.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/fo_entry.h"
#include "../common/fo_hp.h"

namespace fo {
namespace cpu {

void sgd(const std::vector<Entry>& entries, const std::vector<SgdHp>& hps, int32_t k, const double* table,
         int64_t table_len, int64_t decay_every);

void fednar(const std::vector<Entry>& entries, const std::vector<FedNarHp>& hps, bool norm_f64);

void padamfed(const std::vector<Entry>& entries, const std::vector<PAdamHp>& hps, bool norm_f64);

// sqrt of the sum of the per-chunk partials, added in chunk order.
double finish_norm(const std::vector<double>& partials);

}  // namespace cpu
}  // namespace fo
