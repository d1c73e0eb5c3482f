// One parameter tensor and its companions, as the kernels see it: raw pointers, no torch types.
// Shared by the C++ CPU kernels and the CUDA launchers (which nvcc compiles without torch headers).
//
// Slot (role) order and hp column order per op are those of fedopt_kernels/_ops.py (the one
// declaration of every op); tests/test_op_signatures.py checks the names exported by the bindings
// against it.
#pragma once

#include <cstdint>

namespace fo {

// Storage dtype of a parameter. Companion tensors use either the same dtype ("param-typed": grads,
// momentum buffers, x0, corrections, anchor grads) or the state dtype: float32, float64 for float64
// parameters ("state-typed": PAdaMFed's D and acc, NeuronLRSGD's scales).
enum class DType : int32_t { F32 = 0, F16 = 1, BF16 = 2, F64 = 3 };

inline int dtype_size(DType t) { return t == DType::F64 ? 8 : t == DType::F32 ? 4 : 2; }
inline int state_size(DType t) { return t == DType::F64 ? 8 : 4; }

constexpr int kMaxSlots = 6;

// Slot order per op (= roles of the op's spec).
namespace sgd_slot { enum { X, G, BUF, X0, CORR, SCALE, COUNT }; }
namespace fednar_slot { enum { X, G, X0, CORR, COUNT }; }
namespace padamfed_slot { enum { X, G, D, ACC, H, COUNT }; }

// hp column order per op (= hps of the op's spec); one float64 row per batch.
namespace sgd_hp { enum { LR, MOMENTUM, DAMPENING, WEIGHT_DECAY, PROX_MU, NESTEROV, MAXIMIZE, COUNT }; }
namespace fednar_hp { enum { STEP_LR, WEIGHT_DECAY, MAX_NORM, EPS, PROX_MU, COUNT }; }
namespace padamfed_hp { enum { LR, BETA, EPS, COUNT }; }

struct Entry {
  void* ptr[kMaxSlots];  // contiguous (or same-strided dense) storage; null when the slot is absent
  int64_t numel;         // > 0: zero-size tensors never become entries
  int64_t row_len;       // elements per neuron-scale row; numel when the tensor has no scale
  int32_t group;         // the entry's hp row (batch b; b * C + c for client c of a batched op)
  DType dtype;           // parameter dtype
  int32_t segment;       // the client it belongs to (0 for a per-client op): its norm, k and active flag
};

// Batched ops (docs/client_batched.md): bit of a batch's `present` mask meaning "the round started with fresh
// momentum buffers" (sgd_batched: a client at k == 0 takes buf = d); fedopt_kernels/_ops.py FRESH.
constexpr int32_t kFreshBit = 1 << 16;

}  // namespace fo
