// Tile constants, shared-memory layout and top-K buckets of the select kernel (SPEC.md §1).
//
// Read before kernel.cuh (device code and launcher); instantiations/*.cu instantiate one
// (dtype, top-K bucket) each and launch.cu dispatches to them.
//
// A CTA tile is kTileRows = 256 query rows that share one proxy key head: `heads_per_tile` proxy
// heads × `tokens_per_tile` tokens (4 × 64, 2 × 128 or 1 × 256, chosen on the host). Every key tile
// of 128 keys × Di is loaded once into shared memory and multiplied against all 256 rows, which
// makes 256 FLOP per byte of key traffic from L2.
#pragma once

#include <cstdint>

#include "flashmsa/params.h"
#include "kernels/common/limit.h"
#include "kernels/common/smem_limits.h"

namespace flashmsa::kernels::select {

constexpr int kHeadDim = 128;                 // Di; validation refuses others

// What select is not built for (kernels/common/limit.h): block indices are stored in 16 bits.
inline Limit select_limit(const ProblemShape& shape) {
  if (shape.num_blocks() > 65536) return {"shape.seqlen", "select stores block indices in 16 bits (S ≤ 8388608)"};
  return {};
}
constexpr int kHalfDim = 64;                  // elements in one 128-byte swizzled row
constexpr int kTileRows = 256;                // query rows per CTA tile (M)
constexpr int kConsumerWarpgroups = 2;        // mainloop + epilogue warpgroups
constexpr int kRowsPerWarpgroup = 128;        // two m64 wgmma fragments per consumer warpgroup
constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);  // warpgroup 0 is the TMA producer
constexpr int kProducerRegisters = 24;
constexpr int kConsumerRegisters = 240;

static_assert(kRowsPerWarpgroup * kConsumerWarpgroups == kTileRows);

// NOTES: top-K buckets. Each row keeps K-1 (score, block) entries (the local block is implicit) in
// shared memory, 6 bytes each (fp32 score, uint16 block: NB <= 65536, i.e. S <= 8M tokens). The
// bucket fixes the list capacity; what is left of 227 KB after the query tile (64 KB) goes to key
// stages (32 KB each): 4 stages for K <= 16, 2 stages for K <= 64.
template <int kMaxTopKOfBucket>
struct TopKBucket;

template <>
struct TopKBucket<16> {
  static constexpr int kMaxKeep = 15;
  static constexpr int kStages = 4;
};

template <>
struct TopKBucket<64> {
  static constexpr int kMaxKeep = 63;
  static constexpr int kStages = 2;
};

template <typename Element, int kMaxKeep, int kStages>
struct SharedStorage {
  // Query tile, two halves of Di, each (256 rows, 64) with the 128-byte swizzle; row = head·T + token.
  alignas(1024) Element query[2][kTileRows * kHalfDim];
  // Key stages, each two halves (128 keys, 64) with the 128-byte swizzle.
  alignas(1024) Element key[kStages][2][kBlockSize * kHalfDim];
  // Per-row top-K lists, column = owner thread (0..255) so a warp's accesses hit distinct banks.
  float list_score[kMaxKeep][kTileRows];
  uint16_t list_block[kMaxKeep][kTileRows];
  uint64_t key_full[kStages];
  uint64_t key_empty[kStages];
  uint64_t query_full;
  uint64_t query_empty;
};

// Dynamic shared memory requested: the storage plus slack to align its start to 1024 bytes.
template <typename Element, int kMaxKeep, int kStages>
constexpr int smem_bytes() {
  return int(sizeof(SharedStorage<Element, kMaxKeep, kStages>)) + 1024;
}

// Kernel arguments besides the tensor maps. Tiles are numbered longest first (see kernel.cuh).
struct KernelParams {
  int32_t* block_idx;  // [b, hp, s, k]
  int seqlen;
  int num_proxy_heads;
  int proxy_ratio;      // R
  int heads_per_tile;   // proxy heads of one key head per tile
  int tokens_per_tile;  // kTileRows / heads_per_tile
  int top_k;
  int subgroups;        // R / heads_per_tile
  int num_groups;       // batch · Hpk · subgroups
  int num_query_tiles;  // ceil(S / tokens_per_tile)
  int num_tiles;        // num_groups · num_query_tiles
  float scale;          // σp
};

}  // namespace flashmsa::kernels::select
