// The two-pass (global norm, then update) driver shared by every norm op (FedNAR, PAdaMFed).
//
// An op is a struct (apex-style functor) with
//   TableT                     its tensor table (multi_tensor_apply.cuh)
//   Hp, hp_of(row, present, unscale, inv)   its per-batch struct from a row of hp (common/fo_hp.h)
//   scale(norm, hp, norm_f64)  the batch's factor from the global norm
//   kStateSlot[]               which slots are state-typed (float32 / float64 storage)
//   chunk<T, kUpdate>(tab, w, hp, scale) -> double
//                              one block's chunk: pass 1 returns this thread's float64 sum of
//                              squares (and may write, e.g. acc), pass 2 applies the factor
// and this file runs: pass 1 over every dtype (one partial per chunk into its fixed slot), one
// block adding the slots in a fixed order and forming each batch's factor, pass 2 over every
// dtype, then k += 1. Deterministic (no atomics), no host sync, graph-capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "block_reduce.cuh"
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"
#include "step_args.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

constexpr int kFinalThreads = 512;

struct TwoPassExtra {
  DeviceScalars s;
  double* partials;      // pass 1 writes one per chunk
  const double* scales;  // pass 2 reads its batch's factor
};

template <class Op, class T, bool kUpdate>
__global__ void __launch_bounds__(kBlock) two_pass_kernel(const __grid_constant__ typename Op::TableT tab,
                                                           const __grid_constant__ TwoPassExtra ex) {
  if (skipped(ex.s)) return;
  const Where w = locate(tab);
  const int g = tab.group[w.i];
  const int batch = tab.group_id[g];
  const typename Op::Hp hp = Op::hp_of(hp_row(ex.s, batch), tab.present[g], ex.s.grad_scale != nullptr, inv_scale(ex.s));
  using A = acc_t<T>;
  const A scale = kUpdate ? static_cast<A>(ex.scales[batch]) : A(0);
  const double sq = Op::template chunk<T, kUpdate>(tab, w, hp, scale);
  if (!kUpdate) {
    const double total = block_sum<kBlock>(sq);
    if (threadIdx.x == 0) ex.partials[w.slot] = total;
  }
}

// One block: the norm from the partials in a fixed order (thread t adds slots t, t + 512, ...,
// then a fixed butterfly), and every batch's factor from it.
template <class Op>
__global__ void __launch_bounds__(kFinalThreads) finalize_kernel(const double* partials, int64_t n, double* norm_out,
                                                                  double* scales, const DeviceScalars s, int32_t nbatches,
                                                                  int32_t norm_f64) {
  if (skipped(s)) return;
  __shared__ double norm;
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kFinalThreads) acc += partials[i];
  acc = block_sum<kFinalThreads>(acc);
  if (threadIdx.x == 0) {
    norm = sqrt(acc);
    *norm_out = norm;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < nbatches; b += kFinalThreads)
    scales[b] = Op::scale(norm, Op::hp_of(hp_row(s, b), 0, false, 1.0), norm_f64 != 0);
}

template <class Op, class T, bool kUpdate>
cudaError_t two_pass_launch(const Entry* entries, int n, const int32_t* present, const TwoPassExtra& ex, DType dt,
                            cudaStream_t stream) {
  using TableT = typename Op::TableT;
  static_assert(sizeof(TableT) + sizeof(TwoPassExtra) <= kArgBytes, "kernel arguments exceed 4 KiB");
  return for_each_table<TableT>(entries, n, dt, present, Op::kStateSlot, [&](const TableT& tab, int64_t blocks) {
    two_pass_kernel<Op, T, kUpdate><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(tab, ex);
    return cudaGetLastError();
  });
}

template <class Op, bool kUpdate>
cudaError_t two_pass_pass(const Entry* entries, int n, const int32_t* present, const TwoPassExtra& ex,
                          cudaStream_t stream) {
  return for_each_dtype(entries, n, [&](DType dt) {
    switch (dt) {
      case DType::F32: return two_pass_launch<Op, float, kUpdate>(entries, n, present, ex, dt, stream);
      case DType::F16: return two_pass_launch<Op, __half, kUpdate>(entries, n, present, ex, dt, stream);
      case DType::BF16: return two_pass_launch<Op, __nv_bfloat16, kUpdate>(entries, n, present, ex, dt, stream);
      case DType::F64: return two_pass_launch<Op, double, kUpdate>(entries, n, present, ex, dt, stream);
    }
    return cudaErrorInvalidValue;
  });
}

// scratch layout: [partials: slots][norm: 1][factors: nbatches]
template <class Op>
cudaError_t two_pass(const Entry* entries, int n, const int32_t* present, int nbatches, bool norm_f64,
                     const DeviceScalars& s, double* scratch, cudaStream_t stream) {
  const int64_t slots = norm_slots(entries, n);
  const TwoPassExtra ex{s, scratch, scratch + slots + 1};
  cudaError_t err = two_pass_pass<Op, false>(entries, n, present, ex, stream);
  if (err == cudaSuccess) {
    finalize_kernel<Op><<<1, kFinalThreads, 0, stream>>>(scratch, slots, scratch + slots, scratch + slots + 1, s,
                                                         nbatches, norm_f64 ? 1 : 0);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = two_pass_pass<Op, true>(entries, n, present, ex, stream);
  if (err == cudaSuccess) err = advance(s, stream);
  return err;
}

}  // namespace cuda
}  // namespace fo
