// The CUDA norm ops' chunk code (csrc/cuda/norm_chunk.cuh, fednar_op.cuh, padamfed_op.cuh,
// sam_ascent_op.cuh), compiled
// for the host with the stand-ins in include/ and run one "thread" at a time: for every thread of
// a block, the chunk of an unaligned copy of the data (scalar accesses) must give the same float64
// partial sum, bit for bit, as the chunk of an aligned copy (vector accesses), and both passes
// must write the same bits. Prints "OK <cases>" or the first difference (exit status 1).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "fednar_op.cuh"
#include "norm_chunk.cuh"
#include "padamfed_op.cuh"
#include "sam_ascent_op.cuh"

using namespace fo;
using namespace fo::cuda;

namespace {

uint64_t g_state = 0x9e3779b97f4a7c15ull;

double next_value() {  // deterministic values in [-1, 1)
  g_state = g_state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<double>(g_state >> 11) / static_cast<double>(1ull << 52) - 1.0;
}

// `bytes` bytes, 64-byte aligned, with room for one more element: the shifted copy starts one
// element in (off the 16-byte alignment of float32 vectors and the 32 bytes of float64 ones)
struct Buffer {
  unsigned char* data;
  explicit Buffer(size_t bytes) : data(static_cast<unsigned char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64))) {}
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

int g_cases = 0;

bool same(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

// Runs pass 1 then pass 2 of Op on one chunk of n elements, thread by thread, on an aligned and a
// shifted copy of the same `depth` roles (state roles hold acc_t<T>, the others T).
template <class Op, class T>
bool check(const char* name, int n, const typename Op::Hp& hp, const bool* present_role, const bool* state_role,
           int depth) {
  using A = acc_t<T>;
  std::vector<std::unique_ptr<Buffer>> keep;
  typename Op::TableT tab[2];
  std::memset(tab, 0, sizeof(tab));
  for (int d = 0; d < depth; ++d) {
    const size_t size = state_role[d] ? sizeof(A) : sizeof(T);
    std::vector<double> values(n);
    for (auto& v : values) v = next_value();
    for (int copy = 0; copy < 2; ++copy) {
      if (!present_role[d]) {
        tab[copy].ptr[d][0] = nullptr;
        continue;
      }
      keep.emplace_back(new Buffer(static_cast<size_t>(n + 1) * size));
      unsigned char* p = keep.back()->data + (copy ? size : 0);
      for (int i = 0; i < n; ++i) {
        if (size == sizeof(float)) {
          const float f = static_cast<float>(values[i]);
          std::memcpy(p + i * size, &f, size);
        } else {
          std::memcpy(p + i * size, &values[i], size);
        }
      }
      tab[copy].ptr[d][0] = p;
    }
  }
  for (int copy = 0; copy < 2; ++copy) tab[copy].numel[0] = n;
  Where w[2];
  for (int copy = 0; copy < 2; ++copy) {
    w[copy].i = 0;
    w[copy].n = n;
    w[copy].c = 0;
    w[copy].aligned = copy == 0;
    w[copy].begin = 0;
    w[copy].slot = 0;
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (int t = 0; t < kBlock; ++t) {
      threadIdx.x = static_cast<unsigned>(t);
      double sq[2];
      for (int copy = 0; copy < 2; ++copy)
        sq[copy] = pass == 0 ? norm_chunk<Op, T, false>(tab[copy], w[copy], hp, A(0))
                             : norm_chunk<Op, T, true>(tab[copy], w[copy], hp, static_cast<A>(0.37));
      if (!same(&sq[0], &sq[1], sizeof(double))) {
        std::printf("MISMATCH %s n=%d pass %d thread %d: partial %.17g (vector) vs %.17g (scalar)\n", name, n,
                    pass + 1, t, sq[0], sq[1]);
        return false;
      }
    }
    for (int d = 0; d < depth; ++d) {
      if (!present_role[d]) continue;
      const size_t size = state_role[d] ? sizeof(A) : sizeof(T);
      if (!same(tab[0].ptr[d][0], tab[1].ptr[d][0], n * size)) {
        std::printf("MISMATCH %s n=%d pass %d: role %d written differently\n", name, n, pass + 1, d);
        return false;
      }
    }
  }
  ++g_cases;
  return true;
}

}  // namespace

int main() {
  // chunk lengths: shorter than one vector, tails of 1-3 elements, several vectors per thread, a
  // full chunk
  const int sizes[] = {1, 2, 3, 5, 7, 1023, 1025, 4097, 9999, 16383, static_cast<int>(kChunk)};
  FedNarHp nar{};
  nar.lr = 0.1;
  nar.weight_decay = 0.01;
  nar.max_norm = 1.0;
  nar.eps = 1e-6;
  nar.prox_mu = 0.2;
  nar.inv_scale = 0.25;
  nar.flags = kNarWeightDecay | kNarProx | kNarCorrection | kNarUnscale;
  const bool nar_present[fednar_slot::COUNT] = {true, true, true, true};
  const bool* nar_state = spec::fednar::kStateSlot;
  bool ok = true;
  for (int n : sizes) {
    ok = ok && check<NarOp, float>("fednar float32", n, nar, nar_present, nar_state, fednar_slot::COUNT);
    ok = ok && check<NarOp, double>("fednar float64", n, nar, nar_present, nar_state, fednar_slot::COUNT);
    for (int vr = 0; vr < 2 && ok; ++vr) {
      PAdamHp pad{};
      pad.lr = 0.05;
      pad.beta = 0.3;
      pad.one_minus_beta = 0.7;
      pad.eps = 1e-8;
      pad.inv_scale = 0.25;
      pad.flags = kPadUnscale | (vr ? kPadVarianceReduction : 0);
      const bool pad_present[padamfed_slot::COUNT] = {true, true, true, true, vr == 1};
      const bool* pad_state = spec::padamfed::kStateSlot;
      ok = ok && check<PadOp, float>(vr ? "padamfed-vr float32" : "padamfed float32", n, pad, pad_present,
                                     pad_state, padamfed_slot::COUNT);
      ok = ok && check<PadOp, double>(vr ? "padamfed-vr float64" : "padamfed float64", n, pad, pad_present,
                                      pad_state, padamfed_slot::COUNT);
    }
    for (int adaptive = 0; adaptive < 2 && ok; ++adaptive) {
      SamHp sam{};
      sam.rho = 0.05;
      sam.eta = 0.01;
      sam.eps = 1e-12;
      sam.inv_scale = 0.25;
      sam.flags = kSamUnscale | (adaptive ? kSamAdaptive : 0);
      const bool sam_present[sam_ascent_slot::COUNT] = {true, true, true};
      const bool* sam_state = spec::sam_ascent::kStateSlot;
      ok = ok && check<SamOp, float>(adaptive ? "asam float32" : "sam float32", n, sam, sam_present, sam_state,
                                     sam_ascent_slot::COUNT);
      ok = ok && check<SamOp, double>(adaptive ? "asam float64" : "sam float64", n, sam, sam_present, sam_state,
                                      sam_ascent_slot::COUNT);
    }
    if (!ok) break;
  }
  if (!ok) return 1;
  std::printf("OK %d cases\n", g_cases);
  return 0;
}
