// Op "padamfed" on CUDA. Pass 1: v = beta*G + D (VR: (G + D) - (1-beta)*H), acc += G, one sum of
// squares of v per chunk into its fixed slot. One block then adds the slots in order and forms each
// group's eta / max(norm, eps). Pass 2 moves x by -v * that factor. No host sync.
#include "block_reduce.cuh"
#include "cuda_ops.h"
#include "global_norm.cuh"
#include "multi_tensor_apply.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

namespace {

using PadTable = Table<padamfed_slot::COUNT, 52, PAdamHp, 8>;

struct PadExtra {
  double* partials;
  const double* scales;
  int32_t norm_f64;
};
static_assert(sizeof(PadTable) + sizeof(PadExtra) <= kArgBytes, "padamfed kernel arguments exceed 4 KiB");

template <class A>
__device__ __forceinline__ A direction(bool vr, A beta, A omb, A g, A D, A h) {
  return vr ? (g + D) - omb * h : beta * g + D;
}

// kUpdate = false: the norm pass (reads G, D, acc, H; writes acc); true: the update pass
// (reads G, D, x, H; writes x). D and acc are state-typed: float32, float64 for float64 params.
template <class T, bool kUpdate>
__global__ void __launch_bounds__(kBlock) padamfed_kernel(const __grid_constant__ PadTable tab,
                                                           const __grid_constant__ PadExtra ex) {
  using A = acc_t<T>;
  const Where w = locate(tab);
  const PAdamHp& hp = tab.hp[tab.group[w.i]];
  const bool vr = (hp.flags & kPadVarianceReduction) != 0;
  const A beta = static_cast<A>(hp.beta), omb = static_cast<A>(hp.one_minus_beta);
  const A scale = kUpdate ? static_cast<A>(ex.scales[tab.group_id[tab.group[w.i]]]) : A(0);
  T* X = static_cast<T*>(tab.ptr[padamfed_slot::X][w.i]) + w.begin;
  const T* G = static_cast<const T*>(tab.ptr[padamfed_slot::G][w.i]) + w.begin;
  const A* D = static_cast<const A*>(tab.ptr[padamfed_slot::D][w.i]) + w.begin;
  A* ACC = static_cast<A*>(tab.ptr[padamfed_slot::ACC][w.i]) + w.begin;
  const T* H = static_cast<const T*>(tab.ptr[padamfed_slot::H][w.i]);
  if (H) H += w.begin;
  const bool nd64 = ex.norm_f64 != 0;
  A sq = A(0);
  double sqd = 0.0;  // used instead of sq when nd64 (the reference then sums float32 tensors in float64)

  const int nvec = tab.aligned[w.i] ? w.n / kVec : 0;
  for (int v0 = threadIdx.x; v0 < nvec; v0 += kBlock * kIlp) {
    A g[kIlp][kVec], d[kIlp][kVec], h[kIlp][kVec], y[kIlp][kVec];  // y: acc (pass 1) or x (pass 2)
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int v = v0 + u * kBlock;
      if (v < nvec) {
        const int j = v * kVec;
        load4(G + j, g[u]);
        load4(D + j, d[u]);
        if (vr) load4(H + j, h[u]);
        if (kUpdate) load4(X + j, y[u]);
        else load4(ACC + j, y[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int v = v0 + u * kBlock;
      if (v < nvec) {
#pragma unroll
        for (int q = 0; q < kVec; ++q) {
          const A vv = direction(vr, beta, omb, g[u][q], d[u][q], h[u][q]);
          if (kUpdate) {
            y[u][q] = y[u][q] - vv * scale;
          } else {
            if (nd64) sqd += static_cast<double>(vv) * static_cast<double>(vv);
            else sq += vv * vv;
            y[u][q] = y[u][q] + g[u][q];
          }
        }
        if (kUpdate) store4(X + v * kVec, y[u]);
        else store4(ACC + v * kVec, y[u]);
      }
    }
  }
  for (int j = nvec * kVec + threadIdx.x; j < w.n; j += kBlock) {
    const A g = load1(G + j);
    const A vv = direction(vr, beta, omb, g, D[j], vr ? load1(H + j) : A(0));
    if (kUpdate) {
      store1(X + j, load1(X + j) - vv * scale);
    } else {
      if (nd64) sqd += static_cast<double>(vv) * static_cast<double>(vv);
      else sq += vv * vv;
      ACC[j] = ACC[j] + g;
    }
  }
  if (!kUpdate) {
    const double total = nd64 ? block_sum<kBlock>(sqd) : static_cast<double>(block_sum<kBlock>(sq));
    if (threadIdx.x == 0) ex.partials[w.slot] = total;
  }
}

template <class T, bool kUpdate>
cudaError_t launch(const Entry* entries, int n, const PAdamHp* hps, const PadExtra& ex, DType dt, cudaStream_t stream) {
  static const bool state_slot[padamfed_slot::COUNT] = {false, false, true, true, false};
  return for_each_table<PadTable>(entries, n, dt, hps, state_slot, [&](const PadTable& tab, int64_t blocks) {
    padamfed_kernel<T, kUpdate><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(tab, ex);
    return cudaGetLastError();
  });
}

template <bool kUpdate>
cudaError_t pass(const Entry* entries, int n, const PAdamHp* hps, const PadExtra& ex, cudaStream_t stream) {
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
  __device__ double operator()(double norm, const PAdamHp& hp, bool norm_f64) const { return padamfed_scale(norm, hp, norm_f64); }
};

}  // namespace

cudaError_t padamfed(const Entry* entries, int n, const PAdamHp* hps, int ngroups, bool norm_f64, double* scratch,
                     cudaStream_t stream) {
  const int64_t slots = norm_slots(entries, n);
  const PadExtra ex{scratch, scratch + slots + 1, norm_f64 ? 1 : 0};
  cudaError_t err = pass<false>(entries, n, hps, ex, stream);
  if (err == cudaSuccess) err = finalize<PAdamHp, Scale>(scratch, slots, hps, ngroups, norm_f64, stream);
  if (err == cudaSuccess) err = pass<true>(entries, n, hps, ex, stream);
  return err;
}

}  // namespace cuda
}  // namespace fo
