// The clipped sum's CUDA launches on raw pointers (csrc/cuda/clip_sum.cu); clip_sum_cuda.cpp drives them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fo {
namespace cuda {

enum class ClipDtype : int { kFloat = 0, kDouble = 1, kHalf = 2, kBFloat16 = 3 };

constexpr int64_t kClipChunk = 16384;  // elements per pass-1 block: one float64 partial each
constexpr int64_t kClipMaxClients = 65535;  // pass 1's grid.y

// pass 1: partial[c * per_client + first + chunk] = the chunk's sum of squares of row c
cudaError_t clip_squares(ClipDtype dt, const void* x, int64_t row_stride, int64_t numel, int64_t clients,
                         double* partial, int64_t per_client, int64_t first, cudaStream_t stream);
// pass 2: each client's partials in order -> norm, factor (0 where inactive), below
cudaError_t clip_factors(const double* partial, int64_t per_client, int64_t clients, double max_norm,
                         const bool* active, double* norms, double* factors, bool* below, cudaStream_t stream);
// pass 3: out[e] += factors[c] * x[c][e], the active clients in order
cudaError_t clip_add(ClipDtype dt, const void* x, int64_t row_stride, int64_t numel, int64_t clients,
                     const double* factors, const bool* active, double* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace fo
