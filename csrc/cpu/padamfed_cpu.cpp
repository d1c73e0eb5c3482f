// Op "padamfed" (and "padamfed_batched") on CPU: pass 1 forms v, accumulates acc += G and the
// per-chunk sums of squares of v; each segment's (client's) norm and each group's eta / max(norm,
// eps) follow in chunk order; pass 2 recomputes v and moves x (two_pass.h). Bytes per element as
// docs/benchmarks.md counts them: pass 1 reads G, D, acc (+H) and writes acc, pass 2 reads G, D,
// x (+H) and writes x.
#include "two_pass.h"
#define FO_CPU_TILES "padamfed_tiles.h"
#include "isa_copies.h"

FO_CPU_TWO_PASS_OP(padamfed, PAdamHp, PadKernel)
