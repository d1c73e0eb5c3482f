// Op "fednar" on CUDA. Pass 1 (one launch per dtype over all tensors): d and one sum of squares
// per chunk into its fixed slot. Then one block adds the slots in order and turns the norm into each
// group's step_lr * min(1, max_norm / (norm + eps)) (the host/device code the CPU backend also
// runs). Pass 2 reads its group's factor and updates x. No host sync anywhere.
#include "block_reduce.cuh"
#include "cuda_ops.h"
#include "global_norm.cuh"
#include "multi_tensor_apply.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

namespace {

using NarTable = Table<fednar_slot::COUNT, 60, FedNarHp, 8>;

struct NarExtra {
  double* partials;    // pass 1 writes one per chunk
  const double* scales;  // pass 2 reads its group's factor
  int32_t norm_f64;      // accumulate the norm in float64 (a float64 parameter is present)
};
static_assert(sizeof(NarTable) + sizeof(NarExtra) <= kArgBytes, "fednar kernel arguments exceed 4 KiB");

// d = g + weight_decay * x + correction + prox_mu * (x - x0), in the reference's order
template <class A>
__device__ __forceinline__ A direction(int f, A wd, A mu, A x, A g, A c, A x0) {
  A d = g;
  if (f & kNarWeightDecay) d = d + wd * x;
  if (f & kNarCorrection) d = d + c;
  if (f & kNarProx) d = d + mu * (x - x0);
  return d;
}

// Both passes walk the chunk the same way; kUpdate selects the norm pass or the update pass.
template <class T, bool kUpdate>
__global__ void __launch_bounds__(kBlock) fednar_kernel(const __grid_constant__ NarTable tab,
                                                         const __grid_constant__ NarExtra ex) {
  using A = acc_t<T>;
  const Where w = locate(tab);
  const FedNarHp& hp = tab.hp[tab.group[w.i]];
  const int f = hp.flags;
  const A wd = static_cast<A>(hp.weight_decay), mu = static_cast<A>(hp.prox_mu);
  const A scale = kUpdate ? static_cast<A>(ex.scales[tab.group_id[tab.group[w.i]]]) : A(0);
  T* X = static_cast<T*>(tab.ptr[fednar_slot::X][w.i]) + w.begin;
  const T* G = static_cast<const T*>(tab.ptr[fednar_slot::G][w.i]) + w.begin;
  const T* X0 = static_cast<const T*>(tab.ptr[fednar_slot::X0][w.i]);
  const T* C = static_cast<const T*>(tab.ptr[fednar_slot::CORR][w.i]);
  if (X0) X0 += w.begin;
  if (C) C += w.begin;
  const bool nd64 = ex.norm_f64 != 0;
  A sq = A(0);
  double sqd = 0.0;  // used instead of sq when nd64 (the reference then sums float32 tensors in float64)

  const int nvec = tab.aligned[w.i] ? w.n / kVec : 0;
  for (int v0 = threadIdx.x; v0 < nvec; v0 += kBlock * kIlp) {
    A x[kIlp][kVec], g[kIlp][kVec], c[kIlp][kVec], x0[kIlp][kVec];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int v = v0 + u * kBlock;
      if (v < nvec) {
        const int j = v * kVec;
        load4(X + j, x[u]);
        load4(G + j, g[u]);
        if (f & kNarCorrection) load4(C + j, c[u]);
        if (f & kNarProx) load4(X0 + j, x0[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int v = v0 + u * kBlock;
      if (v < nvec) {
#pragma unroll
        for (int q = 0; q < kVec; ++q) {
          const A d = direction(f, wd, mu, x[u][q], g[u][q], c[u][q], x0[u][q]);
          if (kUpdate) x[u][q] = x[u][q] - scale * d;
          else if (nd64) sqd += static_cast<double>(d) * static_cast<double>(d);
          else sq += d * d;
        }
        if (kUpdate) store4(X + v * kVec, x[u]);
      }
    }
  }
  for (int j = nvec * kVec + threadIdx.x; j < w.n; j += kBlock) {
    const A x = load1(X + j);
    const A c = (f & kNarCorrection) ? load1(C + j) : A(0);
    const A x0 = (f & kNarProx) ? load1(X0 + j) : A(0);
    const A d = direction(f, wd, mu, x, load1(G + j), c, x0);
    if (kUpdate) store1(X + j, x - scale * d);
    else if (nd64) sqd += static_cast<double>(d) * static_cast<double>(d);
    else sq += d * d;
  }
  if (!kUpdate) {
    const double total = nd64 ? block_sum<kBlock>(sqd) : static_cast<double>(block_sum<kBlock>(sq));
    if (threadIdx.x == 0) ex.partials[w.slot] = total;
  }
}

template <class T, bool kUpdate>
cudaError_t launch(const Entry* entries, int n, const FedNarHp* hps, const NarExtra& ex, DType dt, cudaStream_t stream) {
  static const bool state_slot[fednar_slot::COUNT] = {false, false, false, false};
  return for_each_table<NarTable>(entries, n, dt, hps, state_slot, [&](const NarTable& tab, int64_t blocks) {
    fednar_kernel<T, kUpdate><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(tab, ex);
    return cudaGetLastError();
  });
}

template <bool kUpdate>
cudaError_t pass(const Entry* entries, int n, const FedNarHp* hps, const NarExtra& ex, cudaStream_t stream) {
  return for_each_dtype(entries, n, [&](DType dt) {
    switch (dt) {
      case DType::F32: return launch<float, kUpdate>(entries, n, hps, ex, dt, stream);
      case DType::F16: return launch<__half, kUpdate>(entries, n, hps, ex, dt, stream);
      case DType::BF16: return launch<__nv_bfloat16, kUpdate>(entries, n, hps, ex, dt, stream);
      case DType::F64: return launch<double, kUpdate>(entries, n, hps, ex, dt, stream);
    }
    return cudaErrorInvalidValue;
  });
}

struct Scale {
  __device__ double operator()(double norm, const FedNarHp& hp, bool norm_f64) const { return fednar_scale(norm, hp, norm_f64); }
};

}  // namespace

cudaError_t fednar(const Entry* entries, int n, const FedNarHp* hps, int ngroups, bool norm_f64, double* scratch,
                   cudaStream_t stream) {
  const int64_t slots = norm_slots(entries, n);
  const NarExtra ex{scratch, scratch + slots + 1, norm_f64 ? 1 : 0};
  cudaError_t err = pass<false>(entries, n, hps, ex, stream);
  if (err == cudaSuccess) err = finalize<FedNarHp, Scale>(scratch, slots, hps, ngroups, norm_f64, stream);
  if (err == cudaSuccess) err = pass<true>(entries, n, hps, ex, stream);
  return err;
}

}  // namespace cuda
}  // namespace fo
