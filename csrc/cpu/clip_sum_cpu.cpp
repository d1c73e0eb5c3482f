// The clipped sum of a chunk of clients' replies on CPU tensors (fedopt_kernels/core/clip_sum.py).
//
// Pass 1: one float64 sum of squares per work item (a client's tensor cut into fixed chunks of
// kChunk elements, kLanes fixed accumulators each), then each client's items added in item order:
// the norms do not depend on the number of threads. Pass 2: the sums cut into blocks of kBlock
// elements; a block adds the active clients' scaled rows in client order, each term rounded once
// and then added (FMA contraction is off in this build), which is the reference's arithmetic.
#include "clip_sum_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace fo {
namespace cpu {
namespace {

constexpr int64_t kBlock = 2048;  // sums per pass-2 item: its float64 sums stay in L1 while C rows stream

struct Rows {
  const char* data;      // row 0
  int64_t stride_bytes;  // from one client's row to the next
  int64_t numel;         // per row
  at::ScalarType dtype;
};

template <class T>
inline double wide(T v) {
  return static_cast<double>(static_cast<float>(v));  // float16, bfloat16: exact through float32
}
template <>
inline double wide<float>(float v) {
  return static_cast<double>(v);
}
template <>
inline double wide<double>(double v) {
  return v;
}

template <class T>
double squares(const T* x, int64_t n) {
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const double v = wide(x[i + k]);
      lanes[k] += v * v;
    }
  }
  for (int k = 0; i + k < n; ++k) {  // the tail: element i + k in lane k, as above
    const double v = wide(x[i + k]);
    lanes[k] += v * v;
  }
  double total = 0.0;
  for (int k = 0; k < kLanes; ++k) total += lanes[k];
  return total;
}

template <class T>
void add_rows(double* s, const Rows& r, int64_t begin, int64_t n, const double* factors, const bool* active,
              int64_t C) {
  for (int64_t c = 0; c < C; ++c) {
    if (active != nullptr && !active[c]) continue;  // never read: the row may hold NaN or inf
    const T* x = reinterpret_cast<const T*>(r.data + c * r.stride_bytes) + begin;
    const double f = factors[c];
    FO_IVDEP for (int64_t e = 0; e < n; ++e) {
      const double term = f * wide(x[e]);
      s[e] = s[e] + term;
    }
  }
}

template <class Fn>
void by_dtype(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float()); break;
    case at::kDouble: fn(double()); break;
    case at::kHalf: fn(c10::Half()); break;
    case at::kBFloat16: fn(c10::BFloat16()); break;
    default: TORCH_CHECK(false, "fedopt_kernels cpu clip_sum: tensors must be float16/bfloat16/float32/float64");
  }
}

struct Item {
  int64_t client;  // pass 1 only
  int32_t tensor;
  int64_t begin, end;
};

}  // namespace

std::vector<at::Tensor> clip_sum(const std::vector<at::Tensor>& tensors, double max_norm,
                                 const c10::optional<at::Tensor>& active, const std::vector<at::Tensor>& out) {
  TORCH_CHECK(!tensors.empty(), "fedopt_kernels cpu clip_sum: tensors is empty");
  TORCH_CHECK(out.size() == tensors.size(), "fedopt_kernels cpu clip_sum: out has ", out.size(), " tensors for ",
              tensors.size());
  const int64_t C = tensors[0].dim() > 0 ? tensors[0].size(0) : -1;
  std::vector<Rows> rows;
  int64_t total = 0;
  for (size_t j = 0; j < tensors.size(); ++j) {
    const at::Tensor& t = tensors[j];
    TORCH_CHECK(t.device().is_cpu() && t.dim() >= 1 && t.size(0) == C,
                "fedopt_kernels cpu clip_sum: tensors[", j, "] must be a CPU tensor [C, *shape] with C = ", C);
    int64_t n = 1;  // per row (also when C is 0)
    for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
    TORCH_CHECK(C == 0 || t.select(0, 0).is_contiguous(), "fedopt_kernels cpu clip_sum: tensors[", j,
                "] rows must be contiguous");
    const at::Tensor& o = out[j];
    TORCH_CHECK(o.device().is_cpu() && o.scalar_type() == at::kDouble && o.is_contiguous() && o.numel() == n,
                "fedopt_kernels cpu clip_sum: out[", j, "] must be a contiguous float64 CPU tensor of ", n,
                " elements");
    rows.push_back({static_cast<const char*>(t.data_ptr()), t.stride(0) * static_cast<int64_t>(t.element_size()), n,
                    t.scalar_type()});
    total += n;
  }
  at::Tensor act_t;
  const bool* act = nullptr;
  if (active.has_value()) {
    act_t = active->contiguous();
    TORCH_CHECK(act_t.device().is_cpu() && act_t.scalar_type() == at::kBool && act_t.numel() == C,
                "fedopt_kernels cpu clip_sum: active must be a bool CPU tensor of ", C, " elements");
    act = act_t.data_ptr<bool>();
  }
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor norms = at::empty({C}, f64), factors = at::empty({C}, f64);
  at::Tensor below = at::empty({C}, at::TensorOptions().dtype(at::kBool));
  const bool serial = C * total < kSerialElements;

  // pass 1: the items of client 0 (tensor by tensor, chunk by chunk), then client 1's, ...
  std::vector<Item> items;
  std::vector<int64_t> first(C + 1, 0);
  for (int64_t c = 0; c < C; ++c) {
    first[c] = static_cast<int64_t>(items.size());
    for (size_t j = 0; j < rows.size(); ++j)
      for (int64_t b = 0; b < rows[j].numel; b += kChunk)
        items.push_back({c, static_cast<int32_t>(j), b, std::min(rows[j].numel, b + kChunk)});
  }
  first[C] = static_cast<int64_t>(items.size());
  std::vector<double> partial(items.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, n_items, serial ? n_items + 1 : kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const Item& it = items[i];
      const Rows& r = rows[it.tensor];
      by_dtype(r.dtype, [&](auto tag) {
        using T = decltype(tag);
        partial[i] = squares(reinterpret_cast<const T*>(r.data + it.client * r.stride_bytes) + it.begin,
                             it.end - it.begin);
      });
    }
  });
  double* nm = norms.data_ptr<double>();
  double* fa = factors.data_ptr<double>();
  bool* be = below.data_ptr<bool>();
  for (int64_t c = 0; c < C; ++c) {
    double sq = 0.0;
    for (int64_t i = first[c]; i < first[c + 1]; ++i) sq += partial[i];
    const double norm = std::sqrt(sq);
    double f = max_norm / norm;  // norm 0: inf, clamped to 1; NaN stays NaN (torch.clamp)
    if (f > 1.0) f = 1.0;
    const bool on = act == nullptr || act[c];
    nm[c] = norm;
    fa[c] = on ? f : 0.0;
    be[c] = on && norm <= max_norm;
  }

  // pass 2: blocks of every tensor's sums, each adding the clients in order
  std::vector<Item> blocks;
  for (size_t j = 0; j < rows.size(); ++j)
    for (int64_t b = 0; b < rows[j].numel; b += kBlock)
      blocks.push_back({0, static_cast<int32_t>(j), b, std::min(rows[j].numel, b + kBlock)});
  const int64_t n_blocks = static_cast<int64_t>(blocks.size());
  at::parallel_for(0, n_blocks, serial ? n_blocks + 1 : kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const Item& it = blocks[i];
      const Rows& r = rows[it.tensor];
      double* s = out[it.tensor].data_ptr<double>() + it.begin;
      by_dtype(r.dtype, [&](auto tag) { add_rows<decltype(tag)>(s, r, it.begin, it.end - it.begin, fa, act, C); });
    }
  });
  return {norms, factors, below};
}

}  // namespace cpu
}  // namespace fo
