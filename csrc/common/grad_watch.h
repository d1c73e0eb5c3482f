// What a step plan (fedopt_kernels/core/plan.py) checks at every step about tensors it does not own, in
// one call: is each parameter's gradient the tensor seen last time (or a new one of the parameter's
// shape, dtype, device and layout), does each parameter still have its storage, and at which
// addresses (and strides) do the gradients sit. The answer is an id of that address set, equal for
// equal sets, which the replay key (fedopt_kernels/core/replay.py) carries instead of every address.
//
// It keeps the parameters but no gradient: a reference to the last step's gradients would keep their
// blocks from the caching allocator, so the next backward would put its gradients elsewhere, and a
// replayed step, which needs them where they were, would never come.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <vector>

namespace fo {

class GradWatch {
 public:
  // params: every parameter of the plan, flat; order: the kernels' parameter order (indexes into params
  // of those that had a gradient when the plan was built)
  GradWatch(std::vector<at::Tensor> params, std::vector<int64_t> order);

  // >= 0: nothing the plan depends on changed (new gradients passed the quick check and are now the
  // ones seen); the id of the gradients' (address, strides) set in kernel order. -1: the caller must
  // look (a gradient appeared or went, a new one does not match its parameter, a parameter's storage
  // changed) and call accept() once it has checked what it found.
  int64_t check();

  // Take the parameters' current storages and gradients as seen; the id of their address set.
  int64_t accept();

 private:
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

  int64_t signature_id();
  bool same_signature() const;  // the gradients sit where signature_ says (compared in place)

  std::vector<at::Tensor> params_;
  std::vector<int64_t> order_;
  std::vector<uint8_t> had_grad_;       // per parameter: a gradient when the plan was built
  std::vector<WeakImpl> seen_;          // per parameter: the gradient last seen (weak: never kept alive)
  std::vector<const void*> data_;       // per parameter: its data address last seen
  std::vector<int64_t> signature_;      // per gradient in kernel order: address, dims, strides
  std::vector<int64_t> scratch_;
  int64_t id_ = -1;
};

}  // namespace fo
