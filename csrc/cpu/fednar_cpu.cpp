// Op "fednar" (and "fednar_batched") on CPU: pass 1 computes d and its per-chunk sums of squares,
// each segment's norm (one per client) and each group's scale are formed from them in chunk order,
// pass 2 recomputes d and updates x (two_pass.h).
// (Recomputing d reads x and g again: that is the 20 B/element counted in docs/benchmarks.md, cheaper than storing d.)
#include "two_pass.h"
#define FO_CPU_TILES "fednar_tiles.h"
#include "isa_copies.h"

FO_CPU_TWO_PASS_OP(fednar, FedNarHp, NarKernel)
