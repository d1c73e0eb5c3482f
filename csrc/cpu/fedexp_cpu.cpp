// Op "fedexp" (and "fedexp_batched") on CPU: pass 1 sums the squares of g per fixed chunk, the norm
// (one per client) and each group's step lr * eta_g are formed from them in chunk order, pass 2
// moves x (two_pass.h): 16 bytes per float32 element.
#include "two_pass.h"
#define FO_CPU_TILES "fedexp_tiles.h"
#include "isa_copies.h"

FO_CPU_TWO_PASS_OP(fedexp, FedExpHp, FedExpKernel)
