// From the Python-side lists of tensors to flat `Entry`s, with validation and a slow path for
// tensors the kernels cannot address directly (non-contiguous, or an unexpected dtype).
// Shared by both extensions so the CPU tests exercise the code the CUDA backend also runs.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "fo_entry.h"

namespace fo {

enum class SlotKind { Param, State };

struct SlotSpec {
  const char* name;  // as in Group.tensors (for error messages)
  SlotKind kind;     // dtype: the parameter's, or float32 (float64 for float64 parameters)
  bool written;      // the op stores into it
  bool per_row;      // one value per output unit ([shape[0]]), not one per element
};

// per group: one list per slot (an empty list = the slot is absent for that group)
using GroupLists = std::vector<std::vector<std::vector<at::Tensor>>>;

struct Gathered {
  std::vector<Entry> entries;      // non-empty parameters, in group order
  std::vector<bool> slot_present;  // per group * kMaxSlots: group g has slot s
  at::Device device{at::kCPU};
  bool any_f64 = false;            // the global norm runs in float64 (SPEC: as the reference does)
  // temporaries the kernels write, to be copied back into the caller's tensors afterwards
  std::vector<std::pair<at::Tensor, at::Tensor>> writeback;  // (caller's tensor, temporary)
  std::vector<at::Tensor> keep_alive;                        // read-only temporaries

  bool has(int group, int slot) const { return slot_present[static_cast<size_t>(group) * kMaxSlots + slot]; }
  void finish();  // runs the writebacks
};

// `backend` names the caller in error messages ("cpu" / "cuda").
Gathered gather(const GroupLists& lists, const std::vector<SlotSpec>& slots, const char* backend);

std::string dtype_name(at::ScalarType t);

}  // namespace fo
