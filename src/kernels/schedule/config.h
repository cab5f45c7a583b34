// The schedule's device layout: the reverse index of block_idx (per KV block, the query rows that
// chose it) and the work tiles the forward's persistent grid walks. Plain C++ (no CUDA types), so
// src/api/workspace.cpp sizes the workspace from the same formulas the kernels address it with.
//
// Comes before: select (block_idx). Built by: schedule/kernel.cuh. Read by: forward/kernel.cuh.
//
// Entries. One entry per valid (b, proxy head p, query i, slot) of block_idx, packed as
// (i << 6) | slot. Entries are grouped by a *list key*
//   key = ((((chunk · B + b) · Hkv + g) · NB + c) · Rg + p % Rg),   Rg = Hp / Hkv,  g = p / Rg,
// where chunk = (b · S + i) / chunk_rows is the query chunk of the row. Inside a list the entries
// are in ascending query order (the sort is stable and block_idx is read in (b, p, i, slot) order).
// Keys of one chunk are contiguous, and inside a chunk the lists of one (b, g, c) are adjacent for
// all proxy heads of the KV group, so consecutive tiles reuse the same K/V block from L2.
//
// Tiles. Each list is cut into tiles of at most tokens_per_tile(M) = ⌊128 / M⌋ entries, so a tile
// gathers ≤ 128 query rows (tokens × M heads). The tiles of chunk j are
// tiles[tile_offsets[j · keys_per_chunk] .. tile_offsets[(j + 1) · keys_per_chunk]), read on the
// device by the forward; the host never learns a count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashmsa/params.h"
#include "kernels/common/limit.h"

namespace flashmsa::kernels::schedule {

constexpr int kSlotBits = 6;  // slot < kMaxTopK = 64
static_assert((1 << kSlotBits) == kMaxTopK, "slot field must hold every slot");

// CTAs a dealing of tiles (schedule/deal.cuh) can serve: its bounds rows hold kMaxDealGrid + 1.
constexpr int kMaxDealGrid = 256;

// Bytes of forward partials one query row may use per chunk; bounds the forward's extra memory.
// NOTES: 5 GB keeps 16K-row chunks for the paper configuration (266 KB of partials per row), so
// the per-chunk launch tails stay small next to the work, and S = 1M still needs < 6 GB.
constexpr double kPartialBudgetBytes = 5e9;

// Query rows per tile token: ⌊128 / M⌋ tokens of M heads fill a 128-row MMA tile.
inline int tokens_per_tile(const ProblemShape& shape) { return kBlockSize / shape.heads_per_proxy(); }

// Partial bytes per query row: M·Hp heads × K slots × (D outputs in 16 bits + fp32 LSE) plus the
// proxy partial LSEs.
inline double partial_bytes_per_row(const ProblemShape& shape) {
  return double(shape.num_heads) * shape.top_k * (2.0 * shape.head_dim + 4.0) +
         double(shape.num_proxy_heads) * shape.top_k * 4.0;
}

// Rows (flattened b · S + i) per query chunk: the largest power of two ≥ 128 whose partials fit
// the budget, capped at the rows that exist.
inline int64_t chunk_rows(const ProblemShape& shape) {
  int64_t rows = kBlockSize;
  while (double(rows) * 2 * partial_bytes_per_row(shape) <= kPartialBudgetBytes) rows *= 2;
  const int64_t total = shape.batch * shape.seqlen;
  const int64_t total_rounded = (total + kBlockSize - 1) / kBlockSize * kBlockSize;
  return rows < total_rounded ? rows : total_rounded;
}

inline int64_t num_chunks(const ProblemShape& shape) {
  const int64_t rows = chunk_rows(shape);
  return (shape.batch * shape.seqlen + rows - 1) / rows;
}

inline int64_t keys_per_chunk(const ProblemShape& shape) {
  return shape.batch * shape.num_proxy_heads * shape.num_blocks();
}

// Keys of one (chunk, b, g): the lists of a KV group's blocks and proxy heads, consecutive in the
// key order above (the backward's tile segments).
inline int64_t keys_per_segment(const ProblemShape& shape) {
  return shape.num_blocks() * (shape.num_proxy_heads / shape.num_kv_heads);
}

// What the schedule cannot index (kernels/common/limit.h): a tile holds at least one token of M
// heads, and entries (i << 6 | slot), their count and the list keys are 32-bit. It applies to every
// sparse-mode op (they read the schedule); the layouts below assume it holds. Assumes a shape that
// passes validate's shape rules. `field`: the shape's name in the op's params ("fwd.shape" in the
// backward's).
inline Limit schedule_limit(const ProblemShape& shape, const char* field = "shape") {
  if (shape.heads_per_proxy() > kBlockSize) return {field, "heads per proxy head H/Hp must be ≤ 128"};
  // In this order each product is bounded by the checks before it (< 2^49 for the keys).
  if (shape.seqlen >= (int64_t(1) << (32 - kSlotBits)) ||
      shape.batch * shape.num_proxy_heads * shape.seqlen * shape.top_k >= (int64_t(1) << 31) ||
      num_chunks(shape) * keys_per_chunk(shape) >= (int64_t(1) << 32)) {
    return {field,
            "the schedule indexes entries and keys in 32 bits (B·Hp·S·K < 2^31, S < 2^26, fewer "
            "than 2^32 lists)"};
  }
  return {};
}

inline size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Upper bound of CUB's temporary storage for the stable radix sort (DoubleBuffer, onesweep) and
// for the exclusive scan: histograms, one look-back counter row per tile of ≥ 256 items, and the
// scan's tile descriptors. The launcher checks CUB's own query against it.
inline size_t sort_temp_bound(int64_t items) {
  const int64_t portion = int64_t(1) << 28;
  const int64_t portions = (items + portion - 1) / portion;
  const int64_t capped = items < portion ? items : portion;
  return align_up(size_t(portions) * 4 * 256 * 8 + size_t(capped) * 4 + 64 * 1024);
}

// Byte offsets of every region of the schedule workspace.
struct ScheduleLayout {
  int64_t entries = 0;   // E = B · Hp · S · K items sorted (valid ones first after the sort)
  int64_t num_keys = 0;  // list keys; key num_keys is the sentinel of empty slots
  int64_t max_tiles = 0;
  int key_bits = 0;      // bits of the sort key (the sentinel included)
  size_t header = 0;            // int32[4]: [0] which entry buffer holds the sorted entries
  size_t keys[2] = {0, 0};      // uint32[E] sort keys, double buffer
  size_t values[2] = {0, 0};    // uint32[E] packed entries (i << 6 | slot), double buffer
  size_t entry_offsets = 0;     // uint32[num_keys + 1]: first sorted entry of each list
  size_t tile_counts = 0;       // uint32[num_keys + 1]: tiles of each list (last = 0)
  size_t tile_offsets = 0;      // uint32[num_keys + 1]: exclusive scan of tile_counts
  size_t tiles = 0;             // uint4[max_tiles]: {key, first entry, entry count, 0}
  size_t temp = 0;              // CUB temporary storage
  size_t temp_bytes = 0;
  size_t total = 0;
};

inline ScheduleLayout make_schedule_layout(const ProblemShape& shape) {
  ScheduleLayout layout;
  layout.entries = shape.batch * shape.num_proxy_heads * shape.seqlen * shape.top_k;
  layout.num_keys = num_chunks(shape) * keys_per_chunk(shape);
  layout.max_tiles = layout.entries / tokens_per_tile(shape) + layout.num_keys + 1;
  while ((int64_t(1) << layout.key_bits) <= layout.num_keys) ++layout.key_bits;
  const size_t entry_bytes = align_up(size_t(layout.entries) * 4);
  const size_t key_table_bytes = align_up(size_t(layout.num_keys + 1) * 4);
  size_t offset = 0;
  layout.header = offset;
  offset += 256;
  for (int i = 0; i < 2; ++i) {
    layout.keys[i] = offset;
    offset += entry_bytes;
  }
  for (int i = 0; i < 2; ++i) {
    layout.values[i] = offset;
    offset += entry_bytes;
  }
  layout.entry_offsets = offset;
  offset += key_table_bytes;
  layout.tile_counts = offset;
  offset += key_table_bytes;
  layout.tile_offsets = offset;
  offset += key_table_bytes;
  layout.tiles = offset;
  offset += align_up(size_t(layout.max_tiles) * 16);
  const int64_t scan_items = layout.num_keys + 1;
  const size_t sort_temp = sort_temp_bound(layout.entries);
  const size_t scan_temp = sort_temp_bound(scan_items);
  layout.temp = offset;
  layout.temp_bytes = sort_temp > scan_temp ? sort_temp : scan_temp;
  offset += layout.temp_bytes;
  layout.total = offset;
  return layout;
}

}  // namespace flashmsa::kernels::schedule
