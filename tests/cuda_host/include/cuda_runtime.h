// Host stand-in for cuda_runtime.h: the qualifiers become plain C++, threadIdx is a variable the
// model sets before it runs each "thread", and the vector types have the device alignment.
#pragma once

#include "cuda_runtime_api.h"

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__

struct FoHostDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline FoHostDim3 threadIdx;
inline FoHostDim3 blockIdx;

struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) double2 {
  double x, y;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
