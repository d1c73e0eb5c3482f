// Ops "sgd" and "sgd_batched" on CUDA (FedDecaySGD / NeuronLRSGD): one launch per parameter dtype
// over all tensors of all row groups (and all clients). The row group's hyperparameters and
// lr_k = lr * table[min(k // decay_every, len - 1)] are read on the device (per client: its own hp
// row and k[c]), so a step never syncs with the host and can be captured in a CUDA graph.
// Operation order = fedopt_kernels/core/reference/sgd.py (compiled with --fmad=false: no contraction).
#include "../common/sgd_hp.h"
#include "cuda_ops.h"
#include "multi_tensor_apply.cuh"
#include "step_args.cuh"
#include "vec_io.cuh"

#include <vector>

namespace fo {
namespace cuda {

namespace {

using SgdTable = Table<sgd_slot::COUNT, 48, 16>;
static_assert(sizeof(SgdTable) + sizeof(DeviceScalars) <= kArgBytes, "sgd kernel arguments exceed 4 KiB");

template <class A>
struct SgdMath {
  A inv, wd, mu, mom, damp1;
  int f;
  // direction d (after momentum); updates b, the momentum buffer value, when momentum is on
  __device__ __forceinline__ A dir(A x, A g, A& b, A c, A x0) const {
    A d = g;
    if (f & kSgdUnscale) d = d * inv;
    if (f & kSgdMaximize) d = -d;
    if (f & kSgdWeightDecay) d = d + wd * x;
    if (f & kSgdCorrection) d = d + c;
    if (f & kSgdProx) d = d + mu * (x - x0);
    if (f & kSgdMomentum) {
      b = b * mom + damp1 * d;  // the unrounded buffer feeds the update, as in the reference
      d = (f & kSgdNesterov) ? d + mom * b : b;
    }
    return d;
  }
};

template <class T>
__global__ void __launch_bounds__(kBlock) sgd_kernel(const __grid_constant__ SgdTable tab,
                                                      const __grid_constant__ DeviceScalars ex) {
  using A = acc_t<T>;
  if (skipped(ex)) return;
  const Where w = locate(tab);
  if (inactive(ex, w.c)) return;
  const int g = tab.group[w.i];
  const int32_t present = tab.present[g];
  SgdHp hp = SgdHp::of(hp_row(ex, tab.group_id[g], w.c), present, ex.grad_scale != nullptr, inv_scale(ex));
  const int32_t k = ex.k[w.c];
  // batched, new momentum buffers: a client's first step takes buf = d (torch's first-step rule,
  // dampening 0); per-client ops never carry the bit (step<spec::sgd> clears it)
  if ((present & kFreshBit) && k == 0) hp.damp1 = 1.0;
  const int f = hp.flags;
  const SgdMath<A> m{static_cast<A>(hp.inv_scale), static_cast<A>(hp.weight_decay), static_cast<A>(hp.prox_mu),
                     static_cast<A>(hp.momentum), static_cast<A>(hp.damp1), f};
  const A lr = sgd_lr<A>(hp, k, ex.table, ex.table_len, ex.decay_every);
  T* X = static_cast<T*>(tab.ptr[sgd_slot::X][w.i]) + w.begin;
  const T* G = static_cast<const T*>(tab.ptr[sgd_slot::G][w.i]) + w.begin;
  T* B = static_cast<T*>(tab.ptr[sgd_slot::BUF][w.i]);
  const T* X0 = static_cast<const T*>(tab.ptr[sgd_slot::X0][w.i]);
  const T* C = static_cast<const T*>(tab.ptr[sgd_slot::CORR][w.i]);
  const A* R = static_cast<const A*>(tab.ptr[sgd_slot::SCALE][w.i]);
  if (B) B += w.begin;
  if (X0) X0 += w.begin;
  if (C) C += w.begin;
  const int64_t row_len = tab.row_len[w.i];
  // per-element step size: lr, or lr * r[row] for NeuronLRSGD (row of tensor element begin + j;
  // batched: begin includes c * numel = c * M * row_len, so the row index includes client c's c * M)
  auto rate = [&](int j) -> A { return (f & kSgdScale) ? lr * R[(w.begin + j) / row_len] : lr; };

  const int nvec = w.aligned ? w.n / kVec : 0;
  for (int v0 = threadIdx.x; v0 < nvec; v0 += kBlock * kIlp) {
    A x[kIlp][kVec], g[kIlp][kVec], b[kIlp][kVec], c[kIlp][kVec], x0[kIlp][kVec];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int v = v0 + u * kBlock;
      if (v < nvec) {
        const int j = v * kVec;
        load4(X + j, x[u]);
        load4(G + j, g[u]);
        if (f & kSgdMomentum) load4(B + j, b[u]);
        if (f & kSgdCorrection) load4(C + j, c[u]);
        if (f & kSgdProx) load4(X0 + j, x0[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int v = v0 + u * kBlock;
      if (v < nvec) {
        const int j = v * kVec;
        const bool one_row = !(f & kSgdScale) || (row_len % kVec == 0);
        const A r0 = rate(j);
#pragma unroll
        for (int q = 0; q < kVec; ++q) {
          const A d = m.dir(x[u][q], g[u][q], b[u][q], c[u][q], x0[u][q]);
          x[u][q] = x[u][q] - (one_row ? r0 : rate(j + q)) * d;
        }
        store4(X + j, x[u]);
        if (f & kSgdMomentum) store4(B + j, b[u]);
      }
    }
  }
  // elements the vector loop did not cover: the tail, or everything when misaligned
  for (int j = nvec * kVec + threadIdx.x; j < w.n; j += kBlock) {
    const A x = load1(X + j);
    A b = (f & kSgdMomentum) ? load1(B + j) : A(0);
    const A c = (f & kSgdCorrection) ? load1(C + j) : A(0);
    const A x0 = (f & kSgdProx) ? load1(X0 + j) : A(0);
    const A d = m.dir(x, load1(G + j), b, c, x0);
    store1(X + j, x - rate(j) * d);
    if (f & kSgdMomentum) store1(B + j, b);
  }
}

template <class T>
cudaError_t launch(const Entry* entries, int n, const int32_t* present, const DeviceScalars& ex, DType dt,
                   cudaStream_t stream) {
  return for_each_table<SgdTable>(entries, n, dt, present, spec::sgd::kStateSlot, ex.clients,
                                  [&](const SgdTable& tab, int64_t blocks) {
                                    sgd_kernel<T><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(tab, ex);
                                    return cudaGetLastError();
                                  });
}

cudaError_t run(const Entry* entries, int n, const int32_t* present, const DeviceScalars& s, cudaStream_t stream) {
  cudaError_t err = for_each_dtype(entries, n, [&](DType dt) {
    switch (dt) {
      case DType::F32: return launch<float>(entries, n, present, s, dt, stream);
      case DType::F16: return launch<__half>(entries, n, present, s, dt, stream);
      case DType::BF16: return launch<__nv_bfloat16>(entries, n, present, s, dt, stream);
      case DType::F64: return launch<double>(entries, n, present, s, dt, stream);
    }
    return cudaErrorInvalidValue;
  });
  if (err == cudaSuccess) err = advance(s, stream);  // after every block has read k
  return err;
}

}  // namespace

// sgd_batched honours FRESH; a per-client op ignores the bit (as the reference does)
template <>
cudaError_t step<spec::sgd>(const Launch& l) {
  bool fresh = false;
  for (int b = 0; !l.batched && b < l.ngroups; ++b) fresh = fresh || (l.present[b] & kFreshBit);
  if (!fresh) return run(l.entries, l.n, l.present, l.s, l.stream);
  std::vector<int32_t> plain(l.present, l.present + l.ngroups);
  for (int32_t& p : plain) p &= ~kFreshBit;
  return run(l.entries, l.n, plain.data(), l.s, l.stream);
}

}  // namespace cuda
}  // namespace fo
