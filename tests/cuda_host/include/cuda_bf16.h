// Host stand-in for cuda_bf16.h: declarations only (see cuda_fp16.h).
#pragma once

struct __nv_bfloat16 {
  unsigned short bits;
};
float __bfloat162float(__nv_bfloat16);
__nv_bfloat16 __float2bfloat16_rn(float);
__nv_bfloat16 __ushort_as_bfloat16(unsigned short);
unsigned short __bfloat16_as_ushort(__nv_bfloat16);
