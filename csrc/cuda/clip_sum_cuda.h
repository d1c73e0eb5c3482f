// A chunk of clients' replies clipped to a global L2 norm and summed (fedopt_kernels/core/clip_sum.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

namespace fo {
namespace cuda {

// tensors: [C, *shape] each (every row contiguous); out: float64 contiguous [*shape] each, added
// into. Returns {norms (float64 [C]), factors (float64 [C]), below (bool [C])}, on the device.
std::vector<at::Tensor> clip_sum(const std::vector<at::Tensor>& tensors, double max_norm,
                                 const c10::optional<at::Tensor>& active, const std::vector<at::Tensor>& out);

}  // namespace cuda
}  // namespace fo
