// From a step's validated arguments to what the CPU kernels take, for per-client and client-batched
// ops alike: the entries to update, one hp struct per hp row, and the step counters to advance. A
// per-client op is the one-client case (hp row b, counter k[0], no mask).
//
// Batched ops (docs/client_batched.md): hp is [B, C, cols], i.e. row g = b * C + c is client c's row of row group b,
// and client c's entries carry group g and segment c (common/gather.h expand_clients). Inactive
// clients are dropped before any pass, so nothing of theirs is read or written.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/op_args.h"
#include "cpu_ops.h"

namespace fo {
namespace cpu {

// hp rows per row group: C for a batched op, 1 for a per-client op
inline int64_t clients_of(const StepScalars& sc) { return sc.clients > 0 ? sc.clients : 1; }

// GradScaler found an inf: the step does nothing at all (no client moves, no counter advances)
inline bool skipped(const StepScalars& sc) { return sc.found_inf && *sc.found_inf != 0.0f; }

inline bool takes_part(const StepScalars& sc, int64_t c) { return !sc.active || sc.active[c]; }

// A batched op's per-client entries (client-major), less those of inactive clients.
inline std::vector<Entry> active_client_entries(const Gathered& gat, const std::vector<SlotSpec>& slots,
                                                const StepScalars& sc) {
  std::vector<Entry> out = expand_clients(gat, slots, sc.clients);
  if (sc.active)
    out.erase(std::remove_if(out.begin(), out.end(), [&](const Entry& e) { return !takes_part(sc, e.segment); }),
              out.end());
  return out;
}

// One hp struct per hp row (common/<op>_hp.h Hp::of); a row's optional roles are its row group's (present mask
// of row group g / C).
template <class Hp>
std::vector<Hp> hp_rows(const Gathered& gat, const StepScalars& sc) {
  const bool unscale = sc.grad_scale != nullptr;
  const double inv = unscale ? inv_scale_of(*sc.grad_scale) : 1.0;
  const int64_t per = clients_of(sc), rows = gat.ngroups() * per;
  std::vector<Hp> out;
  out.reserve(static_cast<size_t>(rows));
  for (int64_t g = 0; g < rows; ++g) out.push_back(Hp::of(sc.hp + g * sc.hp_cols, gat.present[g / per], unscale, inv));
  return out;
}

// Every client that took part advances its counter by one.
inline void advance_counters(const StepScalars& sc) {
  for (int64_t c = 0; c < clients_of(sc); ++c)
    if (takes_part(sc, c)) ++sc.k[c];
}

}  // namespace cpu
}  // namespace fo
