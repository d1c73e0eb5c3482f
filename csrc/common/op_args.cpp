#include "op_args.h"

#include <c10/util/Exception.h>

namespace fo {

const std::vector<SlotSpec>& sgd_slots() {
  static const std::vector<SlotSpec> s = {
      {"params", SlotKind::Param, true, false},   {"grads", SlotKind::Param, false, false},
      {"momentum_buffer", SlotKind::Param, true, false}, {"x0", SlotKind::Param, false, false},
      {"correction", SlotKind::Param, false, false}, {"neuron_scale", SlotKind::State, false, true}};
  return s;
}

const std::vector<SlotSpec>& fednar_slots() {
  static const std::vector<SlotSpec> s = {
      {"params", SlotKind::Param, true, false}, {"grads", SlotKind::Param, false, false},
      {"x0", SlotKind::Param, false, false}, {"correction", SlotKind::Param, false, false}};
  return s;
}

const std::vector<SlotSpec>& padamfed_slots() {
  static const std::vector<SlotSpec> s = {
      {"params", SlotKind::Param, true, false}, {"grads", SlotKind::Param, false, false},
      {"D", SlotKind::State, false, false}, {"acc", SlotKind::State, true, false},
      {"anchor_grad", SlotKind::Param, false, false}};
  return s;
}

static void check_len(const HpLists& hps, const Gathered& gat, size_t want, const char* op, const char* backend) {
  TORCH_CHECK(hps.size() * kMaxSlots == gat.slot_present.size(), "fedopt_kernels ", backend, " ", op, ": got ",
              hps.size(), " hyperparameter lists for ", gat.slot_present.size() / kMaxSlots, " batch groups");
  for (const auto& h : hps)
    TORCH_CHECK(h.size() == want, "fedopt_kernels ", backend, " ", op, ": expected ", want,
                " hyperparameters per group, got ", h.size());
}

std::vector<SgdHp> sgd_hps(const HpLists& hps, const Gathered& gat, const char* backend) {
  check_len(hps, gat, 7, "sgd", backend);
  std::vector<SgdHp> out;
  for (size_t g = 0; g < hps.size(); ++g) {
    const auto& h = hps[g];
    SgdHp p{};
    p.lr = h[0];
    p.momentum = h[1];
    p.damp1 = 1.0 - h[2];
    p.weight_decay = h[3];
    p.prox_mu = h[4];
    const int gi = static_cast<int>(g);
    if (h[6] != 0) p.flags |= kSgdMaximize;
    if (h[3] != 0) p.flags |= kSgdWeightDecay;
    if (gat.has(gi, sgd_slot::CORR)) p.flags |= kSgdCorrection;
    if (gat.has(gi, sgd_slot::X0)) p.flags |= kSgdProx;
    if (gat.has(gi, sgd_slot::SCALE)) p.flags |= kSgdScale;
    if (h[1] != 0) {
      p.flags |= kSgdMomentum;
      if (h[5] != 0) p.flags |= kSgdNesterov;
      TORCH_CHECK(gat.has(gi, sgd_slot::BUF) || !gat.has(gi, sgd_slot::X), "fedopt_kernels ", backend,
                  " sgd: momentum=", h[1], " in batch group ", g, " but no 'momentum_buffer' tensors were given");
    }
    out.push_back(p);
  }
  return out;
}

std::vector<FedNarHp> fednar_hps(const HpLists& hps, const Gathered& gat, const char* backend) {
  check_len(hps, gat, 5, "fednar", backend);
  std::vector<FedNarHp> out;
  for (size_t g = 0; g < hps.size(); ++g) {
    const auto& h = hps[g];
    FedNarHp p{};
    p.step_lr = h[0];
    p.weight_decay = h[1];
    p.max_norm = h[2];
    p.eps = h[3];
    p.prox_mu = h[4];
    const int gi = static_cast<int>(g);
    if (h[1] != 0) p.flags |= kNarWeightDecay;
    if (gat.has(gi, fednar_slot::CORR)) p.flags |= kNarCorrection;
    if (gat.has(gi, fednar_slot::X0)) p.flags |= kNarProx;
    out.push_back(p);
  }
  return out;
}

std::vector<PAdamHp> padamfed_hps(const HpLists& hps, const Gathered& gat, const char* backend) {
  check_len(hps, gat, 4, "padamfed", backend);
  std::vector<PAdamHp> out;
  for (size_t g = 0; g < hps.size(); ++g) {
    const auto& h = hps[g];
    PAdamHp p{};
    p.lr = h[0];
    p.beta = h[1];
    p.one_minus_beta = 1.0 - h[1];
    p.eps = h[2];
    const int gi = static_cast<int>(g);
    const bool nonempty = gat.has(gi, padamfed_slot::X);
    TORCH_CHECK(!nonempty || (gat.has(gi, padamfed_slot::D) && gat.has(gi, padamfed_slot::ACC)), "fedopt_kernels ",
                backend, " padamfed: batch group ", g, " lacks its 'D' or 'acc' tensors");
    if (h[3] != 0) {
      p.flags |= kPadVarianceReduction;
      TORCH_CHECK(!nonempty || gat.has(gi, padamfed_slot::H), "fedopt_kernels ", backend,
                  " padamfed: variance_reduction in batch group ", g, " needs 'anchor_grad' tensors");
    }
    out.push_back(p);
  }
  return out;
}

}  // namespace fo
