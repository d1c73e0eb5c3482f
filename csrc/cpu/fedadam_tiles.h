// Op "fedadam" chunk code for one ISA (see cpu_common.h); included by fedadam_cpu.cpp once per ISA
// (isa_copies.h). One loop per tile with the rule a template argument: x, g, m, v each cross memory
// once (28 bytes per float32 element). m and v are stored in the compute type (float32, float64 for
// float64 parameters), so they are updated in place; float16/bfloat16 x and g are staged.
#include "cpu_tile.h"

#include "../common/fedadam_hp.h"

namespace fo {
namespace cpu {
namespace FO_CPU_ISA {

template <class T, int32_t kRule>
void fedadam_chunk(const Entry& en, const FedAdamStep<Acc<T>>& s, int64_t begin, int64_t end) {
  using A = Acc<T>;
  alignas(64) A xbuf[kTile], gbuf[kTile];
  T* X = static_cast<T*>(en.ptr[fedadam_slot::X]);
  const T* G = static_cast<const T*>(en.ptr[fedadam_slot::G]);
  A* M = static_cast<A*>(en.ptr[fedadam_slot::M]);
  A* V = static_cast<A*>(en.ptr[fedadam_slot::V]);
  for (int64_t off = begin; off < end; off += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, end - off));
    const A* x = load<A>(X + off, n, xbuf);
    const A* g = load<A>(G + off, n, gbuf);
    A* xo = out_ptr<A>(X + off, xbuf);
    A* m = M + off;
    A* v = V + off;
    FO_IVDEP for (int i = 0; i < n; ++i) xo[i] = fedadam_element<kRule, A>(s, x[i], g[i], m[i], v[i]);
    commit<A>(X + off, xo, n);
  }
}

// chunks [lo, hi) of one parallel_for range; steps[g]: hp row g's factors at its client's step
struct FedAdamKernel {
  static void chunks(const std::vector<Chunk>& chunks, int64_t lo, int64_t hi, const std::vector<Entry>& entries,
                     const std::vector<FedAdamStep<float>>& f32, const std::vector<FedAdamStep<double>>& f64) {
    each_chunk(chunks, lo, hi, entries, [&](auto tag, int64_t, const Chunk& ch, const Entry& en) {
      using T = decltype(tag);
      if constexpr (std::is_same<Acc<T>, double>::value) {
        run<T>(en, f64[en.group], ch);
      } else {
        run<T>(en, f32[en.group], ch);
      }
    });
  }

  template <class T>
  static void run(const Entry& en, const FedAdamStep<Acc<T>>& s, const Chunk& ch) {
    if (s.rule == kRuleAdam) fedadam_chunk<T, kRuleAdam>(en, s, ch.begin, ch.end);
    else if (s.rule == kRuleYogi) fedadam_chunk<T, kRuleYogi>(en, s, ch.begin, ch.end);
    else fedadam_chunk<T, kRuleAdagrad>(en, s, ch.begin, ch.end);
  }
};

}  // namespace FO_CPU_ISA
}  // namespace cpu
}  // namespace fo
