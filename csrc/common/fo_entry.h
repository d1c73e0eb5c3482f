// One parameter tensor and its companions, as the kernels see it: raw pointers, no torch types.
// Shared by the C++ CPU kernels and the CUDA launchers (which nvcc compiles without torch headers).
//
// Slot (role) order, present bits and hp column order per op come from op_table.h, which the build
// generates from fedopt_kernels/core/ops.py (the one declaration of every op; docs/dispatch.md).
#pragma once

#include <cstdint>

#include "op_table.h"

namespace fo {

// Storage dtype of a parameter. Companion tensors use either the same dtype ("param-typed": grads,
// momentum buffers, x0, corrections, anchor grads) or the state dtype: float32, float64 for float64
// parameters ("state-typed": PAdaMFed's D and acc, NeuronLRSGD's scales).
enum class DType : int32_t { F32 = 0, F16 = 1, BF16 = 2, F64 = 3 };

inline int dtype_size(DType t) { return t == DType::F64 ? 8 : t == DType::F32 ? 4 : 2; }
inline int state_size(DType t) { return t == DType::F64 ? 8 : 4; }

struct Entry {
  void* ptr[kMaxSlots];  // contiguous (or same-strided dense) storage; null when the slot is absent
  int64_t numel;         // > 0: zero-size tensors never become entries
  int64_t row_len;       // elements per neuron-scale row; numel when the tensor has no scale
  int32_t group;         // the entry's hp row (row group b; b * C + c for client c of a batched op)
  DType dtype;           // parameter dtype
  int32_t segment;       // the client it belongs to (0 for a per-client op): its norm, k and active flag
};

}  // namespace fo
