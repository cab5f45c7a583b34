// Tile constants of the select kernel (SPEC.md §1). kernel.cuh includes this file; the launcher in
// launch.cu picks the instantiation.
#pragma once

#include "flashmsa/params.h"

namespace flashmsa::kernels::select {

constexpr int kThreads = 128;               // one thread per query row of a 128-token block
constexpr int kHeadDim = 128;               // Di
constexpr int kMaxKeep = kMaxTopK - 1;      // list entries besides the forced local block

// Dynamic shared memory: one key block [128, Di] in the input dtype, then the per-row lists
// (score [kMaxKeep][kThreads] fp32, block [kMaxKeep][kThreads] int32).
constexpr int kKeyTileBytes = kBlockSize * kHeadDim * 2;
constexpr int kListBytes = kMaxKeep * kThreads * 8;
constexpr int kSmemBytes = kKeyTileBytes + kListBytes;

}  // namespace flashmsa::kernels::select
