// Ops "fedadam" and "fedadam_batched" on CUDA (FedAdam / FedYogi / FedAdagrad): one launch per
// parameter dtype over all tensors of all row groups (and all clients). Each block forms its row
// group's factors at step t = k + 1 on the device (common/fedadam_hp.h, the code the CPU backend also
// runs), so a step never syncs with the host and can be captured in a CUDA graph. m and v are stored
// in the compute type. Operation order = fedopt_kernels/core/reference/fedadam.py (--fmad=false).
#include "../common/fedadam_hp.h"
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"
#include "step_args.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

namespace {

using FedAdamTable = Table<fedadam_slot::COUNT, 48, 16>;
static_assert(sizeof(FedAdamTable) + sizeof(DeviceScalars) <= kArgBytes, "fedadam kernel arguments exceed 4 KiB");

template <class T, int32_t kRule>
__device__ __forceinline__ void fedadam_chunk(const FedAdamTable& tab, const Where& w, const FedAdamStep<acc_t<T>>& s) {
  using A = acc_t<T>;
  T* X = static_cast<T*>(tab.ptr[fedadam_slot::X][w.i]) + w.begin;
  const T* G = static_cast<const T*>(tab.ptr[fedadam_slot::G][w.i]) + w.begin;
  A* M = static_cast<A*>(tab.ptr[fedadam_slot::M][w.i]) + w.begin;
  A* V = static_cast<A*>(tab.ptr[fedadam_slot::V][w.i]) + w.begin;
  const int nvec = w.aligned ? w.n / kVec : 0;
  for (int v0 = threadIdx.x; v0 < nvec; v0 += kBlock * kIlp) {
    A x[kIlp][kVec], g[kIlp][kVec], m[kIlp][kVec], v[kIlp][kVec];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int e = v0 + u * kBlock;
      if (e < nvec) {
        const int j = e * kVec;
        load4(X + j, x[u]);
        load4(G + j, g[u]);
        load4(M + j, m[u]);
        load4(V + j, v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int e = v0 + u * kBlock;
      if (e < nvec) {
        const int j = e * kVec;
#pragma unroll
        for (int q = 0; q < kVec; ++q) x[u][q] = fedadam_element<kRule, A>(s, x[u][q], g[u][q], m[u][q], v[u][q]);
        store4(X + j, x[u]);
        store4(M + j, m[u]);
        store4(V + j, v[u]);
      }
    }
  }
  // elements the vector loop did not cover: the tail, or everything when misaligned
  for (int j = nvec * kVec + threadIdx.x; j < w.n; j += kBlock) {
    A m = M[j], v = V[j];
    store1(X + j, fedadam_element<kRule, A>(s, load1(X + j), load1(G + j), m, v));
    M[j] = m;
    V[j] = v;
  }
}

template <class T>
__global__ void __launch_bounds__(kBlock) fedadam_kernel(const __grid_constant__ FedAdamTable tab,
                                                          const __grid_constant__ DeviceScalars ex) {
  using A = acc_t<T>;
  if (skipped(ex)) return;
  const Where w = locate(tab);
  if (inactive(ex, w.c)) return;
  const int g = tab.group[w.i];
  const FedAdamHp hp =
      FedAdamHp::of(hp_row(ex, tab.group_id[g], w.c), tab.present[g], ex.grad_scale != nullptr, inv_scale(ex));
  const FedAdamStep<A> s = FedAdamStep<A>::at(hp, ex.k[w.c]);
  if (s.rule == kRuleAdam) fedadam_chunk<T, kRuleAdam>(tab, w, s);
  else if (s.rule == kRuleYogi) fedadam_chunk<T, kRuleYogi>(tab, w, s);
  else fedadam_chunk<T, kRuleAdagrad>(tab, w, s);
}

template <class T>
cudaError_t launch(const Entry* entries, int n, const int32_t* present, const DeviceScalars& ex, DType dt,
                   cudaStream_t stream) {
  return for_each_table<FedAdamTable>(entries, n, dt, present, spec::fedadam::kStateSlot, ex.clients,
                                      [&](const FedAdamTable& tab, int64_t blocks) {
                                        fedadam_kernel<T><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(tab, ex);
                                        return cudaGetLastError();
                                      });
}

}  // namespace

template <>
cudaError_t step<spec::fedadam>(const Launch& l) {
  cudaError_t err = for_each_dtype(l.entries, l.n, [&](DType dt) {
    switch (dt) {
      case DType::F32: return launch<float>(l.entries, l.n, l.present, l.s, dt, l.stream);
      case DType::F16: return launch<__half>(l.entries, l.n, l.present, l.s, dt, l.stream);
      case DType::BF16: return launch<__nv_bfloat16>(l.entries, l.n, l.present, l.s, dt, l.stream);
      case DType::F64: return launch<double>(l.entries, l.n, l.present, l.s, dt, l.stream);
    }
    return cudaErrorInvalidValue;
  });
  if (err == cudaSuccess) err = advance(l.s, l.stream);  // after every block has read k
  return err;
}

}  // namespace cuda
}  // namespace fo
