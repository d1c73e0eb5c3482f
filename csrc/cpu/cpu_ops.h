// The CPU entry point of every op: fo::cpu::step<spec::<op>>(entries, gat, sc), one step of the op
// over `entries` (a per-client op's tensors, or the slices of a batched op's active clients:
// step_rows.h) with the step's gathered arguments and validated scalars. Each op's own
// <op>_cpu.cpp defines its specialisation; the bindings call it for every op op_table.h lists,
// so no op is named here. An entry's `group` picks its hp row; a norm op forms one norm per
// `segment` (one client of a batched op).
#pragma once

#include <vector>

#include "../common/fo_entry.h"

namespace fo {

struct Gathered;     // common/gather.h
struct StepScalars;  // common/op_args.h

namespace cpu {

template <class Spec>
void step(const std::vector<Entry>& entries, const Gathered& gat, const StepScalars& sc);

// the specialisation of every declared op, defined in its <op>_cpu.cpp
#define FO_CPU_DECLARE_STEP(NAME) \
  template <>                     \
  void step<spec::NAME>(const std::vector<Entry>& entries, const Gathered& gat, const StepScalars& sc);
FO_FOR_EACH_OP(FO_CPU_DECLARE_STEP)
#undef FO_CPU_DECLARE_STEP

}  // namespace cpu
}  // namespace fo
