// The two-pass (global norm, then update) driver shared by every norm op (FedNAR, PAdaMFed), for
// per-client ops (1 client) and client-batched ops (C clients, one norm each) alike.
//
// An op is a struct (apex-style functor) deriving from TwoPassOp (two_pass_op.cuh), which gives
//   TableT                     its tensor table (multi_tensor_apply.cuh)
//   Hp                         its per-row-group struct (common/<op>_hp.h: Hp::of(row, present, unscale,
//                              inv) from a row of hp, factor(norm, hp, norm_f64) the factor)
//   kStateSlot[]               which slots are state-typed (float32 / float64 storage)
// and has
//   chunk<T, kUpdate, kVector>(tab, w, hp, factor) -> double
//                              one block's chunk: pass 1 returns this thread's float64 sum of
//                              squares (and may write, e.g. acc), pass 2 applies the factor.
//                              kVector only picks vector or scalar accesses (norm_chunk.cuh):
//                              thread t takes elements 4v..4v+3 of vectors v = t, t + kBlock, ...
//                              in that order, then tail element 4 * (n / 4) + t, on both paths,
//                              so a sum never depends on alignment
// and this file runs: pass 1 over every dtype (one partial per (client, chunk) into its fixed
// slot), one block per client adding its slots in a fixed order and forming each of its
// (row group, client) factors, pass 2 over every dtype, then k[c] += 1. Deterministic (no atomics),
// no host sync, graph-capturable. Inactive clients' blocks return at once.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "block_reduce.cuh"
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"
#include "norm_chunk.cuh"
#include "step_args.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

constexpr int kFinalThreads = 512;

struct TwoPassExtra {
  DeviceScalars s;
  double* partials;      // pass 1 writes one per (client, chunk)
  const double* factors;  // pass 2 reads its (row group, client) factor
};

template <class Op, class T, bool kUpdate>
__global__ void __launch_bounds__(kBlock) two_pass_kernel(const __grid_constant__ typename Op::TableT tab,
                                                           const __grid_constant__ TwoPassExtra ex) {
  if (skipped(ex.s)) return;
  const Where w = locate(tab);
  if (inactive(ex.s, w.c)) return;
  const int g = tab.group[w.i];
  const int group = tab.group_id[g];
  const typename Op::Hp hp =
      Op::Hp::of(hp_row(ex.s, group, w.c), tab.present[g], ex.s.grad_scale != nullptr, inv_scale(ex.s));
  using A = acc_t<T>;
  const A factor = kUpdate ? static_cast<A>(ex.factors[static_cast<int64_t>(group) * ex.s.clients + w.c]) : A(0);
  const double sq = norm_chunk<Op, T, kUpdate>(tab, w, hp, factor);
  if (!kUpdate) {
    const double total = block_sum<kBlock>(sq);
    if (threadIdx.x == 0) ex.partials[w.slot] = total;
  }
}

// One block per client c (grid = clients): its norm from its `per_client` partials in a fixed
// order (thread t adds slots t, t + 512, ..., then a fixed butterfly), and its factor for every
// row group b into factors[b * clients + c]. A client's bits do not depend on the other clients.
template <class Op>
__global__ void __launch_bounds__(kFinalThreads) finalize_kernel(const double* partials, int64_t per_client,
                                                                  double* norms, double* factors, const DeviceScalars s,
                                                                  int32_t ngroups, int32_t norm_f64) {
  const int c = static_cast<int>(blockIdx.x);
  if (skipped(s) || inactive(s, c)) return;
  __shared__ double norm;
  const double* mine = partials + c * per_client;
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < per_client; i += kFinalThreads) acc += mine[i];
  acc = block_sum<kFinalThreads>(acc);
  if (threadIdx.x == 0) {
    norm = sqrt(acc);
    norms[c] = norm;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < ngroups; b += kFinalThreads)
    factors[static_cast<int64_t>(b) * s.clients + c] =
        factor(norm, Op::Hp::of(hp_row(s, b, c), 0, false, 1.0), norm_f64 != 0);
}

template <class Op, class T, bool kUpdate>
cudaError_t two_pass_launch(const Entry* entries, int n, const int32_t* present, const TwoPassExtra& ex, DType dt,
                            cudaStream_t stream) {
  using TableT = typename Op::TableT;
  static_assert(sizeof(TableT) + sizeof(TwoPassExtra) <= kArgBytes, "kernel arguments exceed 4 KiB");
  return for_each_table<TableT>(entries, n, dt, present, Op::kStateSlot, ex.s.clients,
                                [&](const TableT& tab, int64_t blocks) {
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

// scratch layout (cuda_ops.h two_pass_scratch): [partials: clients x slots][norms: clients]
// [factors: ngroups x clients]
template <class Op>
cudaError_t two_pass(const Entry* entries, int n, const int32_t* present, int ngroups, bool norm_f64,
                     const DeviceScalars& s, double* scratch, cudaStream_t stream) {
  if (s.clients < 1 || s.clients > INT_MAX) return cudaErrorInvalidValue;
  const int64_t slots = norm_slots(entries, n);  // per client
  double* norms = scratch + s.clients * slots;
  double* factors = norms + s.clients;
  const TwoPassExtra ex{s, scratch, factors};
  cudaError_t err = two_pass_pass<Op, false>(entries, n, present, ex, stream);
  if (err == cudaSuccess) {
    finalize_kernel<Op><<<static_cast<unsigned>(s.clients), kFinalThreads, 0, stream>>>(
        scratch, slots, norms, factors, s, ngroups, norm_f64 ? 1 : 0);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = two_pass_pass<Op, true>(entries, n, present, ex, stream);
  if (err == cudaSuccess) err = advance(s, stream);
  return err;
}

}  // namespace cuda
}  // namespace fo

// Defines op NAME's entry point (cuda_ops.h step<spec::NAME>): the two passes of Op, one norm per
// client.
#define FO_CUDA_TWO_PASS_OP(NAME, Op)                                                                   \
  namespace fo {                                                                                        \
  namespace cuda {                                                                                      \
  template <>                                                                                           \
  cudaError_t step<spec::NAME>(const Launch& l) {                                                       \
    return two_pass<Op>(l.entries, l.n, l.present, l.ngroups, l.norm_f64, l.s, l.scratch, l.stream);   \
  }                                                                                                     \
  }                                                                                                     \
  }
