// The clipped sum of a chunk of clients' replies on CUDA tensors (fedopt_kernels/core/clip_sum.py).
// Three launches per tensor list, nothing read back to the host: per-chunk float64 partial sums of
// squares (a fixed block tree, block_reduce.cuh), each client's partials added in a fixed order, and
// the sums, each thread adding the active clients' rounded terms in client order. Compiled with
// --fmad=false, and the terms spelled __dmul_rn / __dadd_rn: no contraction, the reference's rounding.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "block_reduce.cuh"
#include "clip_sum_launch.h"

namespace fo {
namespace cuda {

namespace {

constexpr int kClipThreads = 256;

__device__ __forceinline__ double wide(float v) { return static_cast<double>(v); }
__device__ __forceinline__ double wide(double v) { return v; }
__device__ __forceinline__ double wide(__half v) { return static_cast<double>(__half2float(v)); }
__device__ __forceinline__ double wide(__nv_bfloat16 v) { return static_cast<double>(__bfloat162float(v)); }

template <class T>
__global__ void clip_squares_kernel(const T* __restrict__ x, int64_t row_stride, int64_t numel,
                                    double* __restrict__ partial, int64_t per_client, int64_t first) {
  const int64_t chunk = blockIdx.x, c = blockIdx.y;
  const T* row = x + c * row_stride;
  const int64_t lo = chunk * kClipChunk, hi = lo + kClipChunk < numel ? lo + kClipChunk : numel;
  double acc = 0.0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kClipThreads) {
    const double v = wide(row[i]);
    acc = __dadd_rn(acc, __dmul_rn(v, v));
  }
  acc = block_sum<kClipThreads>(acc);
  if (threadIdx.x == 0) partial[c * per_client + first + chunk] = acc;
}

__global__ void clip_factors_kernel(const double* __restrict__ partial, int64_t per_client, double max_norm,
                                    const bool* __restrict__ active, double* __restrict__ norms,
                                    double* __restrict__ factors, bool* __restrict__ below) {
  const int64_t c = blockIdx.x;
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < per_client; i += kClipThreads) acc = __dadd_rn(acc, partial[c * per_client + i]);
  acc = block_sum<kClipThreads>(acc);
  if (threadIdx.x == 0) {
    const double norm = sqrt(acc);
    double f = max_norm / norm;  // norm 0: inf, clamped to 1; NaN stays NaN (torch.clamp)
    if (f > 1.0) f = 1.0;
    const bool on = active == nullptr || active[c];
    norms[c] = norm;
    factors[c] = on ? f : 0.0;
    below[c] = on && norm <= max_norm;
  }
}

template <class T>
__global__ void clip_add_kernel(const T* __restrict__ x, int64_t row_stride, int64_t numel, int64_t clients,
                                const double* __restrict__ factors, const bool* __restrict__ active,
                                double* __restrict__ out) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kClipThreads + threadIdx.x;
  if (e >= numel) return;
  double s = out[e];
  for (int64_t c = 0; c < clients; ++c) {
    if (active != nullptr && !active[c]) continue;  // never read: the row may hold NaN or inf
    s = __dadd_rn(s, __dmul_rn(factors[c], wide(x[c * row_stride + e])));
  }
  out[e] = s;
}

template <class Fn>
cudaError_t by_dtype(ClipDtype dt, Fn&& fn) {
  switch (dt) {
    case ClipDtype::kFloat: fn(static_cast<const float*>(nullptr)); break;
    case ClipDtype::kDouble: fn(static_cast<const double*>(nullptr)); break;
    case ClipDtype::kHalf: fn(static_cast<const __half*>(nullptr)); break;
    case ClipDtype::kBFloat16: fn(static_cast<const __nv_bfloat16*>(nullptr)); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t clip_squares(ClipDtype dt, const void* x, int64_t row_stride, int64_t numel, int64_t clients,
                         double* partial, int64_t per_client, int64_t first, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((numel + kClipChunk - 1) / kClipChunk), static_cast<unsigned>(clients));
  return by_dtype(dt, [&](auto tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    clip_squares_kernel<T><<<grid, kClipThreads, 0, stream>>>(static_cast<const T*>(x), row_stride, numel, partial,
                                                             per_client, first);
  });
}

cudaError_t clip_factors(const double* partial, int64_t per_client, int64_t clients, double max_norm,
                         const bool* active, double* norms, double* factors, bool* below, cudaStream_t stream) {
  clip_factors_kernel<<<static_cast<unsigned>(clients), kClipThreads, 0, stream>>>(partial, per_client, max_norm,
                                                                                  active, norms, factors, below);
  return cudaGetLastError();
}

cudaError_t clip_add(ClipDtype dt, const void* x, int64_t row_stride, int64_t numel, int64_t clients,
                     const double* factors, const bool* active, double* out, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((numel + kClipThreads - 1) / kClipThreads);
  return by_dtype(dt, [&](auto tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    clip_add_kernel<T><<<blocks, kClipThreads, 0, stream>>>(static_cast<const T*>(x), row_stride, numel, clients,
                                                            factors, active, out);
  });
}

}  // namespace cuda
}  // namespace fo
