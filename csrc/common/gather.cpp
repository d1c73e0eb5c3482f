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

static std::string where(const std::vector<SlotSpec>& slots, int slot, size_t g, size_t i) {
  std::ostringstream os;
  os << "'" << slots[slot].name << "' of parameter " << i << " in batch group " << g;
  return os.str();
}

void Gathered::finish() {
  for (auto& wb : writeback) wb.first.copy_(wb.second);
  writeback.clear();
  keep_alive.clear();
}

Gathered gather(const GroupLists& lists, const std::vector<SlotSpec>& slots, const char* backend) {
  Gathered out;
  const int nslots = static_cast<int>(slots.size());
  TORCH_CHECK(nslots <= kMaxSlots && nslots >= 2, "internal: bad slot layout");
  bool device_set = false;
  out.slot_present.assign(lists.size() * kMaxSlots, false);

  for (size_t g = 0; g < lists.size(); ++g) {
    const auto& grp = lists[g];
    TORCH_CHECK(static_cast<int>(grp.size()) == nslots, "fedopt_kernels ", backend, ": batch group ", g, " has ",
                grp.size(), " tensor lists, expected ", nslots);
    const size_t n = grp[0].size();
    for (int s = 0; s < nslots; ++s) {
      const bool present = !grp[s].empty();
      TORCH_CHECK(s >= 2 || present || n == 0, "fedopt_kernels ", backend, ": '", slots[s].name, "' missing in batch group ", g);
      TORCH_CHECK(!present || grp[s].size() == n, "fedopt_kernels ", backend, ": batch group ", g, " has ", grp[s].size(),
                  " '", slots[s].name, "' tensors for ", n, " parameters");
      out.slot_present[g * kMaxSlots + s] = present;
    }
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& x = grp[0][i];
      const at::ScalarType pt = x.scalar_type();
      TORCH_CHECK(pt == at::kFloat || pt == at::kHalf || pt == at::kBFloat16 || pt == at::kDouble,
                  "fedopt_kernels ", backend, " backend: parameter ", i, " in batch group ", g, " has dtype ",
                  dtype_name(pt), "; supported: float32, float16, bfloat16, float64");
      if (!device_set) {
        out.device = x.device();
        device_set = true;
      }
      TORCH_CHECK(x.device() == out.device, "fedopt_kernels ", backend, ": parameter ", i, " in batch group ", g,
                  " is on ", x.device(), " but others are on ", out.device);
      const at::ScalarType st = pt == at::kDouble ? at::kDouble : at::kFloat;
      out.any_f64 = out.any_f64 || pt == at::kDouble;

      // Which tensors of this parameter can the kernels address as flat memory? All contiguous;
      // or (no per-row scale) all dense with the same strides, e.g. channels_last everywhere.
      bool all_contig = true, same_dense = true, has_row = false;
      for (int s = 0; s < nslots; ++s) {
        if (grp[s].empty()) continue;
        const at::Tensor& t = grp[s][i];
        TORCH_CHECK(t.defined(), "fedopt_kernels ", backend, ": ", where(slots, s, g, i), " is None");
        TORCH_CHECK(t.device() == out.device, "fedopt_kernels ", backend, ": ", where(slots, s, g, i), " is on ",
                    t.device(), ", expected ", out.device);
        TORCH_CHECK(!t.is_sparse() && !t.is_complex(), "fedopt_kernels ", backend, ": ", where(slots, s, g, i),
                    " must be a dense real tensor");
        if (slots[s].per_row) {
          has_row = true;
          TORCH_CHECK(x.dim() >= 1 && t.dim() == 1 && t.size(0) == x.size(0), "fedopt_kernels ", backend, ": ",
                      where(slots, s, g, i), " has shape ", t.sizes(), ", expected [", (x.dim() ? x.size(0) : 0),
                      "] (one value per output unit)");
          continue;
        }
        TORCH_CHECK(t.sizes() == x.sizes(), "fedopt_kernels ", backend, ": ", where(slots, s, g, i), " has shape ",
                    t.sizes(), ", expected ", x.sizes());
        all_contig = all_contig && t.is_contiguous();
        same_dense = same_dense && t.is_non_overlapping_and_dense() && t.strides() == x.strides();
      }
      const bool flat_ok = all_contig || (!has_row && same_dense);

      Entry e{};
      e.numel = x.numel();
      e.row_len = e.numel;
      e.group = static_cast<int32_t>(g);
      e.dtype = to_dtype(pt);
      for (int s = 0; s < nslots; ++s) {
        if (grp[s].empty()) continue;
        at::Tensor t = grp[s][i];
        const at::ScalarType want = slots[s].kind == SlotKind::Param ? pt : st;
        const bool direct = t.scalar_type() == want && (slots[s].per_row ? t.is_contiguous() : flat_ok);
        if (!direct) {
          // slow path: a contiguous temporary of the expected dtype; written ones are copied back
          // (same strides as the others when those are used directly, contiguous otherwise)
          const bool keep_strides = flat_ok && !slots[s].per_row;
          at::Tensor tmp = t.to(t.options().dtype(want), /*non_blocking=*/false, /*copy=*/true,
                                keep_strides ? at::MemoryFormat::Preserve : at::MemoryFormat::Contiguous);
          if (slots[s].written) out.writeback.emplace_back(t, tmp);
          else out.keep_alive.push_back(tmp);
          t = tmp;
        }
        e.ptr[s] = t.data_ptr();
      }
      if (has_row && e.numel > 0) e.row_len = e.numel / x.size(0);
      if (e.numel > 0) out.entries.push_back(e);
    }
  }
  return out;
}

}  // namespace fo
