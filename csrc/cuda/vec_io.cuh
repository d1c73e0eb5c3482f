// Loads and stores of kVec (= 4) consecutive elements, converted to / from the compute type:
// one 128-bit access for float32 (LDG.E.128 / STG.E.128), 64-bit for float16/bfloat16, two
// 128-bit ones for float64. Pointers must be aligned to 4 elements (locate()'s `aligned` flag) and,
// for stores, point to global memory (every tensor the ops write does).
// float16/bfloat16 round to nearest even on store, as torch's .to() does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace fo {
namespace cuda {

// compute type: float32 for float32/float16/bfloat16, float64 for float64
template <class T>
using acc_t = typename std::conditional<std::is_same<T, double>::value, double, float>::type;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_acc(acc_t<T> v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <class T>
__device__ __forceinline__ acc_t<T> load1(const T* p) { return to_acc(*p); }

template <class T>
__device__ __forceinline__ void store1(T* p, acc_t<T> v) { *p = from_acc<T>(v); }

// 16-bit types: 4 elements in one 64-bit access, unpacked with bit operations (a union would
// make ptxas keep the pack in local memory)
__device__ __forceinline__ float bits_to_acc(unsigned short b, __half) { return __half2float(__ushort_as_half(b)); }
__device__ __forceinline__ float bits_to_acc(unsigned short b, __nv_bfloat16) {
  return __bfloat162float(__ushort_as_bfloat16(b));
}
__device__ __forceinline__ unsigned short acc_to_bits(float v, __half) { return __half_as_ushort(__float2half_rn(v)); }
__device__ __forceinline__ unsigned short acc_to_bits(float v, __nv_bfloat16) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

template <class T>
__device__ __forceinline__ void load4(const T* p, acc_t<T> (&v)[4]) {
  if constexpr (std::is_same<T, float>::value) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  } else if constexpr (std::is_same<T, double>::value) {
    const double2 a = reinterpret_cast<const double2*>(p)[0];
    const double2 b = reinterpret_cast<const double2*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
  } else {
    const uint2 q = *reinterpret_cast<const uint2*>(p);
    v[0] = bits_to_acc(static_cast<unsigned short>(q.x & 0xffffu), T());
    v[1] = bits_to_acc(static_cast<unsigned short>(q.x >> 16), T());
    v[2] = bits_to_acc(static_cast<unsigned short>(q.y & 0xffffu), T());
    v[3] = bits_to_acc(static_cast<unsigned short>(q.y >> 16), T());
  }
}

// Stores are written as PTX vector stores: for a batched client's slice (which starts at element
// c * numel) NVVM splits a plain float4 / uint2 store into scalar ones (the address is formed
// differently from the load's, so the load's alignment does not carry over). The "memory" clobber
// keeps them ordered with every other memory access, as a plain store is. (Compiled for the host,
// by tests/cuda_host, they are plain stores.)
template <class T>
__device__ __forceinline__ void store4(T* p, const acc_t<T> (&v)[4]) {
#if !defined(__CUDA_ARCH__)
  for (int q = 0; q < 4; ++q) p[q] = from_acc<T>(v[q]);
#else
  if constexpr (std::is_same<T, float>::value) {
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                 : "memory");
  } else if constexpr (std::is_same<T, double>::value) {
    asm volatile("st.global.v2.f64 [%0], {%1, %2};" ::"l"(p), "d"(v[0]), "d"(v[1]) : "memory");
    asm volatile("st.global.v2.f64 [%0], {%1, %2};" ::"l"(p + 2), "d"(v[2]), "d"(v[3]) : "memory");
  } else {
    const unsigned lo = static_cast<unsigned>(acc_to_bits(v[0], T())) |
                        (static_cast<unsigned>(acc_to_bits(v[1], T())) << 16);
    const unsigned hi = static_cast<unsigned>(acc_to_bits(v[2], T())) |
                        (static_cast<unsigned>(acc_to_bits(v[3], T())) << 16);
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(lo), "r"(hi) : "memory");
  }
#endif
}

// 4 consecutive elements as one vector access (kVector: the pointer is aligned) or as 4 scalar
// ones. A norm op runs both forms through one loop, so element i is summed by the same thread in
// the same order whatever the pointer's alignment: an unaligned view and its aligned clone (or a
// batched client's misaligned slice and the per-client op on it) give the same norm, bit for bit.
template <bool kVector, class T>
__device__ __forceinline__ void load4_any(const T* p, acc_t<T> (&v)[4]) {
  if constexpr (kVector) {
    load4(p, v);
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = load1(p + q);
  }
}

template <bool kVector, class T>
__device__ __forceinline__ void store4_any(T* p, const acc_t<T> (&v)[4]) {
  if constexpr (kVector) {
    store4(p, v);
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) store1(p + q, v[q]);
  }
}

}  // namespace cuda
}  // namespace fo
