// Multi-tensor apply: one kernel launch walks many tensors, one block per chunk of kChunk elements.
//
// The launch's tensor table travels as a kernel argument (__grid_constant__: read in place from
// the constant bank, never copied to local memory). It holds per tensor its pointers, size, the
// index of its first block and of its first norm-partial slot, and per row group its mask of optional
// roles and its row of the op's hp tensor (the hyperparameter *values* stay in device memory, so a
// new learning rate changes no kernel argument: CUDA graphs replay with it).
// A block finds its tensor by binary search over the first-block prefix, so a launch covers any
// number of chunks; a new launch starts only when the table's tensor or group capacity (sized to
// the portable 4 KiB kernel-argument limit) is full, and the last, partly filled table is always
// launched. Zero-size tensors never reach the table (the gather step drops them).
//
// Client-batched ops (docs/client_batched.md) use the same table: a row is one *stacked* tensor [C, *shape]
// (numel = elements per client) and `clients` = C. Its C * chunks blocks are client-major, so a
// block's client and chunk follow arithmetically: client c's slice starts at element c * numel
// (per-row roles at c * M, which `begin / row_len` gives, since numel = M * row_len). A per-client
// op is the case C = 1, so both run the same kernels.
//
// Norm partial slots are numbered per client over all entries of the op in order (whatever their
// dtype): client c owns slots [c * S, (c + 1) * S), S = `client_slots`, so a client's norm adds
// its slots in a fixed order: deterministic, no atomics.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../common/fo_entry.h"

namespace fo {
namespace cuda {

constexpr int kBlock = 256;          // threads per block
constexpr int64_t kChunk = 16384;    // elements per block, and per norm partial
constexpr int kVec = 4;              // elements per vector access: 128-bit for float32
constexpr int kIlp = 4;              // vector accesses in flight per thread
constexpr size_t kArgBytes = 4096;   // kernel-argument bytes every supported CUDA version accepts
static_assert(kChunk % (kVec * kBlock) == 0, "chunks must start vector-aligned");

template <int Depth, int MaxTensors, int MaxGroups>
struct Table {
  static constexpr int kDepth = Depth;
  static constexpr int kMaxTensors = MaxTensors;
  static constexpr int kMaxGroups = MaxGroups;

  void* ptr[Depth][MaxTensors];
  int64_t numel[MaxTensors];
  int64_t row_len[MaxTensors];
  int32_t first_block[MaxTensors];
  int32_t first_slot[MaxTensors];
  uint8_t group[MaxTensors];    // index into present / group_id
  uint8_t aligned[MaxTensors];  // every pointer allows kVec-wide accesses
  int32_t ntensors;
  int32_t clients;              // C of a batched op, 1 for a per-client op
  int64_t client_slots;         // norm slots per client (S)
  int32_t present[MaxGroups];   // the row group's mask of optional roles
  int32_t group_id[MaxGroups];  // the row group's row of hp (and of its device scalars)
};

// Where a block works: tensor `i` of the table, client `c`, elements [begin, begin + n) of the
// stacked tensor (client offset included), norm slot `slot`; `aligned`: kVec-wide accesses allowed.
struct Where {
  int i;
  int n;
  int c;
  bool aligned;
  int64_t begin;
  int64_t slot;
};

template <class TableT>
__device__ __forceinline__ Where locate(const TableT& tab) {
  const int b = static_cast<int>(blockIdx.x);
  int lo = 0, hi = tab.ntensors - 1;
  while (lo < hi) {  // last tensor whose first block is <= b
    const int mid = (lo + hi + 1) >> 1;
    if (tab.first_block[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  const int64_t numel = tab.numel[lo];
  int chunk = b - tab.first_block[lo], c = 0;
  if (tab.clients != 1) {
    // chunks per client: <= INT_MAX (the host checks), so the split is a 32-bit division
    const int per = static_cast<int>((numel + kChunk - 1) / kChunk);
    c = chunk / per;
    chunk -= c * per;
  }
  const int64_t slice = static_cast<int64_t>(c) * numel;  // client c's first element
  Where w;
  w.i = lo;
  w.c = c;
  w.begin = slice + static_cast<int64_t>(chunk) * kChunk;
  const int64_t left = numel - static_cast<int64_t>(chunk) * kChunk;
  w.n = static_cast<int>(left < kChunk ? left : kChunk);
  // base pointers aligned (host) and the slice offset a multiple of kVec (chunks are)
  w.aligned = tab.aligned[lo] && (slice % kVec) == 0;
  w.slot = static_cast<int64_t>(c) * tab.client_slots + tab.first_slot[lo] + chunk;
  return w;
}

inline int64_t chunks_of(const Entry& e) { return (e.numel + kChunk - 1) / kChunk; }

// Fill tables with the entries of dtype `dtype` (in entry order) and call
// launch(table, nblocks) -> cudaError_t for each full table and for the last one.
// present[b]: row group b's mask of optional roles; state_slot[d]: slot d holds state-typed data
// (float32, or float64 for float64 parameters); clients: C (entries are stacked tensors, numel per
// client), 1 for a per-client op.
template <class TableT, class Launch>
cudaError_t for_each_table(const Entry* entries, int n, DType dtype, const int32_t* present, const bool* state_slot,
                           int64_t clients, Launch&& launch) {
  if (clients < 1 || clients > INT_MAX) return cudaErrorInvalidValue;
  TableT tab;
  int64_t per_client = 0;  // norm slots of one client: every entry's chunks, all dtypes
  for (int e = 0; e < n; ++e) per_client += chunks_of(entries[e]);
  if (per_client > INT_MAX) return cudaErrorInvalidValue;  // first_slot is 32-bit
  tab.clients = static_cast<int32_t>(clients);
  tab.client_slots = per_client;
  int ng = 0, nt = 0;
  int global_group[TableT::kMaxGroups];
  int64_t blocks = 0, slot = 0;
  auto flush = [&]() -> cudaError_t {
    if (nt == 0) return cudaSuccess;
    tab.ntensors = nt;
    const cudaError_t err = launch(tab, blocks);
    nt = 0;
    ng = 0;
    blocks = 0;
    return err;
  };
  for (int e = 0; e < n; ++e) {
    const Entry& en = entries[e];
    const int64_t chunks = chunks_of(en);
    if (en.dtype == dtype) {
      const int64_t nblk = chunks * clients;  // every client's chunks of this tensor
      int g = -1;
      for (int j = 0; j < ng; ++j)
        if (global_group[j] == en.group) g = j;
      if (nt == TableT::kMaxTensors || (g < 0 && ng == TableT::kMaxGroups) || blocks + nblk > INT_MAX) {
        const cudaError_t err = flush();
        if (err != cudaSuccess) return err;
        g = -1;
      }
      if (nblk > INT_MAX) return cudaErrorInvalidValue;  // > 3.5e13 elements in one launch
      if (g < 0) {
        g = ng++;
        global_group[g] = en.group;
        tab.present[g] = present[en.group];
        tab.group_id[g] = en.group;
      }
      bool aligned = true;
      for (int d = 0; d < TableT::kDepth; ++d) {
        tab.ptr[d][nt] = en.ptr[d];
        const int width = kVec * (state_slot[d] ? state_size(dtype) : dtype_size(dtype));
        aligned = aligned && reinterpret_cast<uintptr_t>(en.ptr[d]) % width == 0;
      }
      tab.numel[nt] = en.numel;
      tab.row_len[nt] = en.row_len;
      tab.first_block[nt] = static_cast<int32_t>(blocks);
      tab.first_slot[nt] = static_cast<int32_t>(slot);
      tab.group[nt] = static_cast<uint8_t>(g);
      tab.aligned[nt] = aligned ? 1 : 0;
      ++nt;
      blocks += nblk;
    }
    slot += chunks;
  }
  return flush();  // the tail table
}

// Run f(DType) for each dtype present among the entries, in a fixed order.
template <class F>
cudaError_t for_each_dtype(const Entry* entries, int n, F&& f) {
  const DType order[] = {DType::F32, DType::BF16, DType::F16, DType::F64};
  for (DType t : order) {
    bool any = false;
    for (int e = 0; e < n && !any; ++e) any = entries[e].dtype == t;
    if (!any) continue;
    const cudaError_t err = f(t);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace fo
