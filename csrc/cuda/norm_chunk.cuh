// How a block runs its chunk of a norm op (FedNAR, PAdaMFed): with kVec-wide accesses where every
// pointer allows them (Where::aligned), with scalar ones elsewhere. Both forms are the op's one
// loop (Op::chunk, kVector only picks the access width), so thread t sums the same elements in the
// same order either way: a norm never depends on where a tensor or a client's slice starts.
// tests/test_cuda_chunk_order.py runs this code on the host (tests/cuda_host) to check that.
#pragma once

#include "multi_tensor_apply.cuh"
#include "vec_io.cuh"

namespace fo {
namespace cuda {

// pass 1 (!kUpdate): this thread's float64 sum of squares; pass 2: applies `factor`, returns 0
template <class Op, class T, bool kUpdate>
__device__ __forceinline__ double norm_chunk(const typename Op::TableT& tab, const Where& w, const typename Op::Hp& hp,
                                             acc_t<T> factor) {
  return w.aligned ? Op::template chunk<T, kUpdate, true>(tab, w, hp, factor)
                   : Op::template chunk<T, kUpdate, false>(tab, w, hp, factor);
}

}  // namespace cuda
}  // namespace fo
