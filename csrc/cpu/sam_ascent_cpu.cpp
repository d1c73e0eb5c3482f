// Op "sam_ascent" (and "sam_ascent_batched") on CPU, FedSAM's ascent: pass 1 forms d = w * g and its
// per-chunk sums of squares, each segment's (client's) norm and each group's rho / (norm + eps)
// follow in chunk order; pass 2 saves x and moves it by that factor times w * d (two_pass.h).
#include "two_pass.h"
#define FO_CPU_TILES "sam_ascent_tiles.h"
#include "isa_copies.h"

FO_CPU_TWO_PASS_OP(sam_ascent, SamHp, SamKernel)
