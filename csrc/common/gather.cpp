#include "gather.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace fo {

std::string dtype_name(at::ScalarType t) { return std::string(c10::toString(t)); }

static DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kDouble: return DType::F64;
    default: TORCH_CHECK(false, "unreachable dtype");
  }
}

static std::string where(const std::vector<SlotSpec>& slots, int slot, size_t i) {
  std::ostringstream os;
  os << "'" << slots[slot].name << "' of parameter " << i;
  return os.str();
}

void Gathered::finish() {
  for (auto& wb : writeback) wb.first.copy_(wb.second);
  writeback.clear();
  keep_alive.clear();
}

Gathered gather(const RoleLists& lists, const std::vector<int64_t>& row_of, const std::vector<int64_t>& present,
                const std::vector<SlotSpec>& slots, const char* op, const char* backend, int64_t clients) {
  Gathered out;
  const int nslots = static_cast<int>(slots.size());
  TORCH_CHECK(nslots <= kMaxSlots && nslots >= 2, "internal: bad slot layout");
  TORCH_CHECK(static_cast<int>(lists.size()) == nslots, "fedopt_kernels ", backend, " ", op, ": got ", lists.size(),
              " tensor lists, expected ", nslots);
  const size_t n = lists[0].size();
  TORCH_CHECK(lists[1].size() == n && row_of.size() == n, "fedopt_kernels ", backend, " ", op, ": ", n, " params but ",
              lists[1].size(), " grads and ", row_of.size(), " row indices (row_of)");
  const int64_t nb = static_cast<int64_t>(present.size());
  out.present.resize(present.size());
  for (size_t b = 0; b < present.size(); ++b) out.present[b] = static_cast<int32_t>(present[b]);
  // each optional role's list is consumed in parameter order by the row groups that have it
  std::vector<size_t> cursor(nslots, 0);
  for (int s = 2; s < nslots; ++s) {
    size_t want = 0;
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(row_of[i] >= 0 && row_of[i] < nb, "fedopt_kernels ", backend, " ", op, ": row index ", row_of[i],
                  " of parameter ", i, " is outside [0, ", nb, ")");
      if (present[row_of[i]] & slots[s].bit) ++want;
    }
    TORCH_CHECK(lists[s].size() == want, "fedopt_kernels ", backend, " ", op, ": '", slots[s].name, "' has ",
                lists[s].size(), " tensors but the row groups' present masks ask for ", want);
  }
  bool device_set = false;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& x = lists[0][i];
    const int64_t b = row_of[i];
    // the dimension per-row roles index: the first, or the first after the client dimension
    const int64_t row_dim = clients > 0 ? 1 : 0;
    if (clients > 0)
      TORCH_CHECK(x.dim() >= 1 && x.size(0) == clients, "fedopt_kernels ", backend, " ", op, ": parameter ", i,
                  " has shape ", x.sizes(), "; every tensor of a batched op needs a leading client dimension of ",
                  clients);
    const at::ScalarType pt = x.scalar_type();
    TORCH_CHECK(pt == at::kFloat || pt == at::kHalf || pt == at::kBFloat16 || pt == at::kDouble, "fedopt_kernels ",
                backend, " backend: parameter ", i, " has dtype ", dtype_name(pt),
                "; supported: float32, float16, bfloat16, float64");
    if (!device_set) {
      out.device = x.device();
      device_set = true;
    }
    TORCH_CHECK(x.device() == out.device, "fedopt_kernels ", backend, ": parameter ", i, " is on ", x.device(),
                " but others are on ", out.device);
    const at::ScalarType st = pt == at::kDouble ? at::kDouble : at::kFloat;
    out.any_f64 = out.any_f64 || pt == at::kDouble;

    // this parameter's tensor in each slot (nullptr where its row group lacks the role)
    const at::Tensor* mine[kMaxSlots] = {};
    for (int s = 0; s < nslots; ++s) {
      if (s < 2) mine[s] = &lists[s][i];
      else if (present[b] & slots[s].bit) mine[s] = &lists[s][cursor[s]++];
    }
    // Which tensors of this parameter can the kernels address as flat memory? All contiguous;
    // or (no per-row scale) all dense with the same strides, e.g. channels_last everywhere.
    bool all_contig = true, same_dense = true, has_row = false;
    for (int s = 0; s < nslots; ++s) {
      if (!mine[s]) continue;
      const at::Tensor& t = *mine[s];
      TORCH_CHECK(t.defined(), "fedopt_kernels ", backend, ": ", where(slots, s, i), " is None");
      TORCH_CHECK(t.device() == out.device, "fedopt_kernels ", backend, ": ", where(slots, s, i), " is on ",
                  t.device(), ", expected ", out.device);
      TORCH_CHECK(!t.is_sparse() && !t.is_complex(), "fedopt_kernels ", backend, ": ", where(slots, s, i),
                  " must be a dense real tensor");
      if (slots[s].per_row) {
        has_row = true;
        const bool ok = clients > 0
                            ? (x.dim() >= 2 && t.dim() == 2 && t.size(0) == clients && t.size(1) == x.size(1))
                            : (x.dim() >= 1 && t.dim() == 1 && t.size(0) == x.size(0));
        TORCH_CHECK(ok, "fedopt_kernels ", backend, ": ", where(slots, s, i), " has shape ", t.sizes(),
                    clients > 0 ? ", expected [clients, M] (one value per client and output unit)"
                                : ", expected one value per output unit [shape[0]]");
        continue;
      }
      TORCH_CHECK(t.sizes() == x.sizes(), "fedopt_kernels ", backend, ": ", where(slots, s, i), " has shape ",
                  t.sizes(), ", expected ", x.sizes());
      all_contig = all_contig && t.is_contiguous();
      same_dense = same_dense && t.is_non_overlapping_and_dense() && t.strides() == x.strides();
    }
    const bool flat_ok = all_contig || (!has_row && same_dense);

    Entry e{};
    e.numel = clients > 0 ? x.numel() / clients : x.numel();
    e.row_len = e.numel;
    e.group = static_cast<int32_t>(b);
    e.dtype = to_dtype(pt);
    e.segment = 0;
    for (int s = 0; s < nslots; ++s) {
      if (!mine[s]) continue;
      at::Tensor t = *mine[s];
      const at::ScalarType want = slots[s].kind == SlotKind::Param ? pt : st;
      // batched: client slices are found by offset, so every stacked tensor must be contiguous
      const bool direct = t.scalar_type() == want && (slots[s].per_row || clients > 0 ? t.is_contiguous() : flat_ok);
      if (!direct && e.numel > 0) {
        // slow path: a contiguous temporary of the expected dtype; written ones are copied back
        // (same strides as the others when those are used directly, contiguous otherwise)
        const bool keep_strides = flat_ok && !slots[s].per_row && clients == 0;
        at::Tensor tmp = t.to(t.options().dtype(want), /*non_blocking=*/false, /*copy=*/true,
                              keep_strides ? at::MemoryFormat::Preserve : at::MemoryFormat::Contiguous);
        if (slots[s].written) out.writeback.emplace_back(t, tmp);
        else out.keep_alive.push_back(tmp);
        t = tmp;
      }
      e.ptr[s] = t.data_ptr();
    }
    if (has_row && e.numel > 0) e.row_len = e.numel / x.size(row_dim);
    if (e.numel > 0) {
      out.entries.push_back(e);
      out.rows.push_back(x.dim() > row_dim ? x.size(row_dim) : 1);
    }
  }
  return out;
}

std::vector<Entry> expand_clients(const Gathered& gat, const std::vector<SlotSpec>& slots, int64_t clients) {
  std::vector<Entry> out;
  out.reserve(gat.entries.size() * static_cast<size_t>(clients));
  for (int64_t c = 0; c < clients; ++c) {
    for (size_t i = 0; i < gat.entries.size(); ++i) {
      Entry e = gat.entries[i];
      const bool f64 = e.dtype == DType::F64;
      for (size_t s = 0; s < slots.size(); ++s) {
        if (!e.ptr[s]) continue;
        const int size = slots[s].kind == SlotKind::Param ? dtype_size(e.dtype) : (f64 ? 8 : 4);
        const int64_t stride = slots[s].per_row ? gat.rows[i] : e.numel;
        e.ptr[s] = static_cast<char*>(e.ptr[s]) + c * stride * size;
      }
      e.group = static_cast<int32_t>(e.group * clients + c);
      e.segment = static_cast<int32_t>(c);
      out.push_back(e);
    }
  }
  return out;
}

}  // namespace fo
