// Compiles the chunk code FO_CPU_TILES (an op's "<op>_tiles.h") once per ISA (cpu_common.h): into
// fo::cpu::base for the build's baseline and, where FO_CPU_AVX2, into fo::cpu::avx2 with AVX2 on.
// An op's .cpp defines FO_CPU_TILES and includes this file once; FO_CPU_COPIES(K) then names both
// copies of the op's chunk code K.
//
// No include guard on purpose: included once per op file.
#include "cpu_common.h"

#define FO_CPU_ISA base
#include FO_CPU_TILES
#undef FO_CPU_ISA

#if FO_CPU_AVX2
#pragma GCC push_options
#pragma GCC target("avx2")
#define FO_CPU_ISA avx2
#include FO_CPU_TILES
#undef FO_CPU_ISA
#pragma GCC pop_options
#endif

#undef FO_CPU_TILES
