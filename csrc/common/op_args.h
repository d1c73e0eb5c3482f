// The op signatures both extensions expose, and the translation of their Python arguments
// (per group: tensor lists in slot order + a list of floats) into Entries and hp structs.
//
//   sgd(lists, hps, k, table, decay_every)
//       lists[g] = [params, grads, momentum_buffer, x0, correction, neuron_scale]  ([] = absent)
//       hps[g]   = [lr, momentum, dampening, weight_decay, prox_mu, nesterov, maximize]
//   fednar(lists, hps)
//       lists[g] = [params, grads, x0, correction];  hps[g] = [step_lr, weight_decay, max_norm, eps, prox_mu]
//   padamfed(lists, hps)
//       lists[g] = [params, grads, D, acc, anchor_grad];  hps[g] = [lr, beta, eps, variance_reduction]
#pragma once

#include <vector>

#include "fo_hp.h"
#include "gather.h"

namespace fo {

using HpLists = std::vector<std::vector<double>>;

const std::vector<SlotSpec>& sgd_slots();
const std::vector<SlotSpec>& fednar_slots();
const std::vector<SlotSpec>& padamfed_slots();

// Validate the hp lists against the gathered tensors and build the per-group structs.
std::vector<SgdHp> sgd_hps(const HpLists& hps, const Gathered& gat, const char* backend);
std::vector<FedNarHp> fednar_hps(const HpLists& hps, const Gathered& gat, const char* backend);
std::vector<PAdamHp> padamfed_hps(const HpLists& hps, const Gathered& gat, const char* backend);

}  // namespace fo
