// Host stand-in for cuda_fp16.h: declarations only. The host model runs float32 and float64
// chunks; the 16-bit helpers of vec_io.cuh are inline and never called, so never emitted.
#pragma once

struct __half {
  unsigned short bits;
};
float __half2float(__half);
__half __float2half_rn(float);
__half __ushort_as_half(unsigned short);
unsigned short __half_as_ushort(__half);
