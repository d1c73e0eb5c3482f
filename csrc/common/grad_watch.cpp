#include "grad_watch.h"

#include <c10/util/Exception.h>

#include <deque>
#include <map>
#include <utility>

namespace fo {

namespace {

// Address sets seen in this process -> id. Equal sets get equal ids, whichever plan saw them (a plan
// rebuilt over the same tensors keeps its recordings); ids are never reused, and start far above the
// ids the Python fallback hands out (fedopt_kernels/core/grad_watch.py), so the two never meet.
constexpr size_t kMaxInterned = 4096;
std::map<std::vector<int64_t>, int64_t>& interned() {
  static std::map<std::vector<int64_t>, int64_t> table;
  return table;
}
std::deque<std::map<std::vector<int64_t>, int64_t>::iterator>& arrival() {
  static std::deque<std::map<std::vector<int64_t>, int64_t>::iterator> order;
  return order;
}
int64_t next_id = int64_t{1} << 48;

int64_t intern(const std::vector<int64_t>& sig) {
  auto& table = interned();
  auto found = table.find(sig);
  if (found != table.end()) return found->second;
  auto it = table.emplace(sig, next_id++).first;
  arrival().push_back(it);
  if (table.size() > kMaxInterned) {  // forget the oldest: seen again, it gets a new id
    table.erase(arrival().front());
    arrival().pop_front();
  }
  return it->second;
}

// check_grad's conditions (fedopt_kernels/core/plan_inputs.py) for a gradient the kernels can take as
// they took the last one; anything else goes back to Python, which names what is wrong
bool quick_ok(const at::Tensor& p, const at::Tensor& g) {
  return g.defined() && g.layout() == c10::kStrided && g.scalar_type() == p.scalar_type() &&
         g.device() == p.device() && g.sizes().equals(p.sizes()) && g.has_storage();
}

const at::Tensor& grad_of(const at::Tensor& p) { return p.unsafeGetTensorImpl()->grad(); }

}  // namespace

GradWatch::GradWatch(std::vector<at::Tensor> params, std::vector<int64_t> order)
    : params_(std::move(params)), order_(std::move(order)) {
  for (int64_t i : order_)
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(params_.size()), "GradWatch: order index ", i, " out of range");
  accept();
}

int64_t GradWatch::accept() {
  const size_t n = params_.size();
  had_grad_.assign(n, 0);
  seen_.clear();
  data_.assign(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& g = grad_of(params_[i]);
    had_grad_[i] = g.defined() ? 1 : 0;
    seen_.emplace_back(g.getIntrusivePtr());
    data_[i] = params_[i].has_storage() ? params_[i].data_ptr() : nullptr;
  }
  id_ = -1;
  return signature_id();
}

int64_t GradWatch::check() {
  const size_t n = params_.size();
  bool replaced = false;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params_[i];
    if ((p.has_storage() ? p.data_ptr() : nullptr) != data_[i]) return -1;  // p.data = ...: a new plan
    const at::Tensor& g = grad_of(p);
    if (g.unsafeGetTensorImpl() == seen_[i]._unsafe_get_target()) continue;
    if (!had_grad_[i] || !quick_ok(p, g)) return -1;
    replaced = true;
  }
  if (replaced) {
    for (size_t i = 0; i < n; ++i) seen_[i] = WeakImpl(grad_of(params_[i]).getIntrusivePtr());
  }
  return same_signature() ? id_ : signature_id();
}

bool GradWatch::same_signature() const {
  if (id_ < 0) return false;
  size_t at = 0;
  const size_t end = signature_.size();
  for (int64_t i : order_) {
    const at::Tensor& g = grad_of(params_[i]);
    if (!g.defined() || !g.has_storage() || at >= end) return false;
    if (signature_[at++] != reinterpret_cast<int64_t>(g.data_ptr())) return false;
    const auto strides = g.strides();
    if (at >= end || signature_[at++] != static_cast<int64_t>(strides.size())) return false;
    for (int64_t st : strides) {
      if (at >= end || signature_[at++] != st) return false;
    }
  }
  return at == end;
}

int64_t GradWatch::signature_id() {
  scratch_.clear();
  for (int64_t i : order_) {
    const at::Tensor& g = grad_of(params_[i]);
    if (!g.defined() || !g.has_storage()) {
      scratch_.push_back(0);
      continue;
    }
    scratch_.push_back(reinterpret_cast<int64_t>(g.data_ptr()));
    const auto strides = g.strides();
    scratch_.push_back(static_cast<int64_t>(strides.size()));
    scratch_.insert(scratch_.end(), strides.begin(), strides.end());
  }
  if (id_ >= 0 && scratch_ == signature_) return id_;
  signature_.swap(scratch_);
  id_ = intern(signature_);
  return id_;
}

}  // namespace fo
