// The DSA indexer's TMA score kernel with warpgroup MMA (wgmma): sm_90a only (Hopper), compiled for nothing
// else. Same contract, parameters and code as dsa_indexer.cu's TMA score kernel (`scores_mma<..., WG = true>`,
// see there); this file builds that one entry point from it.
#define DSA_INDEXER_WGMMA
#include "dsa_indexer.cu"
