// Tile constants, shared-memory layout and workspace layout of the sparse forward (SPEC.md §2 and
// the proxy LSE of §3). Plain C++ so src/api/workspace.cpp sizes the workspace from it.
//
// Comes before: schedule/config.h (tiles, query chunks). Used by: forward/kernel.cuh (tiles),
// forward/combine.cuh (merge of the partials).
//
// A work tile is (b, KV head g, KV block c, proxy head p, ≤ ⌊128/M⌋ tokens that chose c): its
// 128 gathered query rows (token-major, the M heads of a token adjacent) attend to the 128 keys of
// block c. The tile writes, per (row, head, slot), a partial output normalised by its own sum and
// the partial LSE; the combine merges the ≤ K partials of a (row, head) by their LSEs. Partials are
// laid out [chunk_rows, Hp, K, M, D] (partial_index): a token's M heads of one slot are adjacent,
// so a tile writes one contiguous M·D piece per token.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/smem_limits.h"
#include "kernels/schedule/config.h"

namespace flashmsa::kernels::forward {

constexpr int kHeadDim = 128;      // D; the only head dim built now
constexpr int kTileRows = 128;     // gathered query rows per tile
constexpr int kWarps = 4;          // each warp owns 32 rows (two m16 MMA tiles)
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = kTileRows / kWarps;
constexpr int kKeyChunk = 64;      // keys per online-softmax step (two steps per block)
// NOTES: 2 CTAs per SM hide one CTA's gathers behind the other's MMAs; the shared-memory budget
// below keeps two resident for M ≥ 4 (≤ 32 proxy rows).
constexpr int kMinBlocksPerSm = 2;

// Proxy query rows of a tile, padded to whole m16 MMA tiles.
inline int proxy_rows(const ProblemShape& shape) {
  const int tokens = schedule::tokens_per_tile(shape);
  return (tokens + 15) / 16 * 16;
}

// Dynamic shared memory of the tile kernel: Q, K and V (the proxy keys use V's buffer before V
// arrives), the proxy queries, the tile's (row, slot) list and per-warp proxy softmax statistics.
inline size_t tile_smem_bytes(const ProblemShape& shape) {
  const size_t tile = size_t(kTileRows) * kHeadDim * 2;
  const int prows = proxy_rows(shape);
  return 3 * tile + size_t(prows) * kHeadDim * 2 + size_t(kTileRows) * 2 * 4 +
         size_t(kWarps) * prows * 2 * 4;
}

// The pipelined tile kernel (pipelined_kernel.cuh): a producer warpgroup and two consumer
// warpgroups of 64 rows, two stages of query rows, one CTA per SM.
constexpr int kPipelinedThreads = 3 * 128;
constexpr int kPipelinedProducerThreads = 128;
constexpr int kPipelinedMaxStages = 3;  // stages of query rows: 3 where shared memory allows, else 2
constexpr int kPipelinedProducerRegisters = 56;   // 128·56 + 256·224 = 64512 ≤ 65536
constexpr int kPipelinedConsumerRegisters = 224;

// The consumer warpgroups take turns issuing their products (S of warpgroup 0, S of 1, P·V of 0,
// P·V of 1, ...; FlashAttention-3's order) when the build defines FLASHMSA_FORWARD_CONSUMER_TURNS=1
// (CMake option of that name, off by default); named barrier kTurnBarrier + c is warpgroup c's
// turn. docs/design.md "Next", item 18, counts what it can take off the tile kernel.
#ifndef FLASHMSA_FORWARD_CONSUMER_TURNS
#define FLASHMSA_FORWARD_CONSUMER_TURNS 0
#endif
constexpr bool kConsumerTurns = FLASHMSA_FORWARD_CONSUMER_TURNS != 0;
constexpr uint32_t kTurnBarrier = 5;  // 2, 3: each consumer warpgroup's own; 4: the producer's

// Byte offsets inside the pipelined kernel's shared memory (from a 1024-byte aligned base).
struct PipelinedLayout {
  int stages = 0;
  int proxy_rows = 0;  // proxy query rows per stage (tokens per tile rounded up to 16)
  uint32_t q = 0;      // (stage, 2 halves, 128 rows, 64) 16-bit, 128-byte swizzle
  uint32_t k = 0;      // (2 halves, 128 keys, 64)
  uint32_t v = 0;
  uint32_t kp = 0;     // proxy keys
  uint32_t qp = 0;     // (stage, 2 halves, proxy_rows, 64)
  uint32_t stats = 0;  // fp32 pairs (stage, 4 warps of the proxy's warpgroup, proxy_rows)
  uint32_t meta = 0;   // (stage) StageMeta, 1040 bytes each
  uint32_t barriers = 0;
  uint32_t grab = 0;   // (2) uint32: the last ranges of tiles taken from the chunk's counter
  uint32_t total = 0;  // bytes to request, including the alignment slack
};

// Load balance: a chunk's tiles are walked segment (b, g) after segment (schedule::keys_per_segment),
// so that one KV group's query rows are gathered at a time and meet L2 more often. A segment's
// tiles differ in cost (a list change drains the pipeline), so every CTA takes an equal share of
// all but 1/kDealtShare of them, in order, and then ranges of that rest (about kGrabsPerCta per
// CTA) from the segment's counter until none is left.
constexpr uint32_t kDealtShare = 8;
constexpr uint32_t kGrabsPerCta = 6;
struct TileSplit {
  uint32_t fixed;  // tiles walked in equal shares, in order
  uint32_t dealt;  // the rest, dealt on demand after them
  uint32_t grab;   // tiles per range taken from the counter
};
constexpr TileSplit split_tiles(uint32_t total, uint32_t grid) {
  const uint32_t dealt = total / kDealtShare;
  const uint32_t grab = dealt / (grid * kGrabsPerCta);
  return {total - dealt, dealt, grab > 0 ? grab : 1u};
}

// ⌊n · x / grid⌋ for x ≤ grid < 2^16 in 32-bit arithmetic: with n = q · grid + r it is
// q · x + ⌊r · x / grid⌋, and r · x < grid².
constexpr uint32_t share_bound(uint32_t n, uint32_t x, uint32_t grid) {
  return (n / grid) * x + (n % grid) * x / grid;
}

// Segments (b, g) of a query chunk: each has a counter of tiles dealt on demand.
inline int64_t segments_per_chunk(const ProblemShape& shape) { return shape.batch * shape.num_kv_heads; }

constexpr int kPipelinedMaxTokens = kTileRows / 2;  // tokens per tile for M ≥ 2
constexpr uint32_t kStageMetaBytes = kPipelinedMaxTokens * (8 + 8 + 4 + 4) + 16;

// The pipelined kernel serves M = H/Hp ≥ 2 (≤ 64 proxy rows per tile); M = 1 uses kernel.cuh.
inline bool pipelined_supported(const ProblemShape& shape) { return shape.heads_per_proxy() >= 2; }

inline PipelinedLayout make_pipelined_layout(const ProblemShape& shape, int stages) {
  PipelinedLayout layout;
  layout.stages = stages;
  layout.proxy_rows = proxy_rows(shape);
  const uint32_t tile = kTileRows * kHeadDim * 2;
  uint32_t offset = 0;
  layout.q = offset;
  offset += stages * tile;
  layout.k = offset;
  offset += tile;
  layout.v = offset;
  offset += tile;
  layout.kp = offset;
  offset += tile;
  layout.qp = offset;
  offset += stages * uint32_t(layout.proxy_rows) * kHeadDim * 2;
  layout.stats = offset;
  offset += stages * 4 * uint32_t(layout.proxy_rows) * 8;
  layout.meta = offset;
  offset += stages * kStageMetaBytes;
  layout.barriers = offset;
  offset += (2 * kPipelinedMaxStages + 1) * 8;
  layout.grab = offset;
  offset += 2 * 4;
  layout.total = offset + 1024;
  return layout;
}

// The deepest pipeline that fits in shared memory.
inline PipelinedLayout make_pipelined_layout(const ProblemShape& shape) {
  for (int stages = kPipelinedMaxStages; stages > 2; --stages) {
    const PipelinedLayout layout = make_pipelined_layout(shape, stages);
    if (layout.total <= kMaxBlockSharedBytes) return layout;
  }
  return make_pipelined_layout(shape, 2);
}

// Index of (row, proxy head, slot, head m of the proxy head's M) in the partials [chunk_rows, Hp,
// K, M] (times D for the outputs); rows are flattened (b · S + i) minus the chunk's first row.
__host__ __device__ constexpr int64_t partial_index(int64_t row, int proxy_head, int slot, int m,
                                                    int num_proxy_heads, int top_k, int heads_per_proxy) {
  return ((row * num_proxy_heads + proxy_head) * top_k + slot) * heads_per_proxy + m;
}

// Byte offsets of the per-chunk partial buffers inside the forward workspace (reused by every
// chunk). Rows are flattened (b · S + i) minus the chunk's first row.
struct ForwardLayout {
  int64_t chunk_rows = 0;
  int64_t num_tile_counters = 0; // one per (chunk, segment)
  size_t tile_counters = 0;      // uint32 [num_tile_counters], zeroed by the forward before its first chunk
  size_t partial_out = 0;        // 16-bit [chunk_rows, Hp, K, M, D]
  size_t partial_lse = 0;        // fp32 [chunk_rows, Hp, K, M]
  size_t partial_proxy_lse = 0;  // fp32 [chunk_rows, Hp, K]
  size_t total = 0;
};

inline ForwardLayout make_forward_layout(const ProblemShape& shape) {
  ForwardLayout layout;
  layout.chunk_rows = schedule::chunk_rows(shape);
  const size_t row_heads = size_t(layout.chunk_rows) * shape.num_heads * shape.top_k;
  size_t offset = 0;
  layout.num_tile_counters = schedule::num_chunks(shape) * segments_per_chunk(shape);
  layout.tile_counters = offset;
  offset += schedule::align_up(size_t(layout.num_tile_counters) * 4);
  layout.partial_out = offset;
  offset += schedule::align_up(row_heads * shape.head_dim * 2);
  layout.partial_lse = offset;
  offset += schedule::align_up(row_heads * 4);
  layout.partial_proxy_lse = offset;
  offset += schedule::align_up(size_t(layout.chunk_rows) * shape.num_proxy_heads * shape.top_k * 4);
  layout.total = offset;
  return layout;
}

}  // namespace flashmsa::kernels::forward
