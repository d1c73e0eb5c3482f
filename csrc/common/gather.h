// From an op's Python-side tensor lists (one per role, optional roles compacted; see
// fedopt_kernels/core/ops.py) to flat `Entry`s, with validation and a slow path for tensors the kernels
// cannot address directly (non-contiguous, or an unexpected dtype).
// Shared by both extensions so the CPU tests exercise the code the CUDA backend also runs.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "fo_entry.h"

namespace fo {

enum class SlotKind { Param, State };

struct SlotSpec {
  const char* name;  // the role's name in the op's spec (for error messages)
  SlotKind kind;     // dtype: the parameter's, or float32 (float64 for float64 parameters)
  bool written;      // the op stores into it
  bool per_row;      // one value per output unit ([shape[0]]), not one per element
  int32_t bit;       // its bit of a row group's `present` mask; 0 for params and grads (every row group has them)
};

// one list per slot: params, grads, then each optional role's compacted list
using RoleLists = std::vector<std::vector<at::Tensor>>;

struct Gathered {
  std::vector<Entry> entries;      // non-empty parameters, in argument order
  std::vector<int64_t> rows;       // batched: per entry, M (per-row roles' length per client)
  std::vector<int32_t> present;    // per row group: mask of optional roles
  at::Device device{at::kCPU};
  bool any_f64 = false;            // a float64 parameter: norms are *used* in float64 (as the reference)
  // temporaries the kernels write, to be copied back into the caller's tensors afterwards
  std::vector<std::pair<at::Tensor, at::Tensor>> writeback;  // (caller's tensor, temporary)
  std::vector<at::Tensor> keep_alive;                        // read-only temporaries

  int64_t ngroups() const { return static_cast<int64_t>(present.size()); }
  void finish();  // runs the writebacks
};

// `backend` names the caller in error messages ("cpu" / "cuda"); `op` the op. `clients` > 0: the
// batched form (every tensor [clients, *shape], per-row roles [clients, M]); each entry then
// describes one stacked tensor (numel and row_len are per client) and `expand_clients` makes the
// per-client entries.
Gathered gather(const RoleLists& lists, const std::vector<int64_t>& row_of, const std::vector<int64_t>& present,
                const std::vector<SlotSpec>& slots, const char* op, const char* backend, int64_t clients = 0);

// The per-client entries of a batched op's stacked entries: client-major (all of client 0's tensors,
// then client 1's, ...), entry (c, i) pointing at client c's slice of stacked tensor i, with
// hp row group * clients + c and segment c. Per-row slots step by M per client, others by numel.
std::vector<Entry> expand_clients(const Gathered& gat, const std::vector<SlotSpec>& slots, int64_t clients);

std::string dtype_name(at::ScalarType t);

}  // namespace fo
