// Host stand-in for the CUDA runtime API header: just the types the kernel sources name, so that
// chunk_order.cpp compiles their device code with a plain C++ compiler (no GPU, no toolkit).
#pragma once

typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
typedef struct FoHostStream* cudaStream_t;
