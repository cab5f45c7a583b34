// Dealing a persistent grid's tiles: each CTA walks a contiguous range of a segment's tiles (a
// segment is a run of list keys; the backward tile kernel's are its (chunk, b, g)), and the ranges
// have equal *weight* rather than equal tile counts, because a list start costs more than a tile
// (the pipeline drains and K, V, k̃ are loaded again).
//
// Comes before: schedule/kernel.cuh (tile_offsets). Read by: backward/pipelined_kernel.cuh, which
// takes CTA x's range [bounds[x], bounds[x + 1]).
#pragma once

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "kernels/schedule/config.h"

namespace flashmsa::kernels::schedule {

constexpr int kDealThreads = 256;

// A tile weighs `tile` (≥ 1), and each non-empty list `list` more. The ranges share the first
// share_num / share_den of the segment's weight; the tiles after bounds[grid] are left to the
// caller (to be dealt on demand; measured for the forward's tile kernel and not kept, design.md
// "Next", item 9).
struct DealWeights {
  uint32_t tile;
  uint32_t list;
  uint32_t share_num;
  uint32_t share_den;
};

// One CTA per segment writes bounds[x] for x = 0 … grid (grid ≤ kMaxDealGrid). The weight of the
// segment's tiles before tile i is W(i) = tile · (i − begin) + list · (non-empty lists starting
// before i), and bounds[x] is the first i with W(i) ≥ target(x) = ⌊W · share_num · x / (share_den
// · grid)⌋ (W the segment's total): W never decreases, so the ranges cover the shared part once,
// in order, and bounds[grid] is the segment's end when the share is whole. The list holding a
// crossing finds it: with A the weight before it, its tile j ≥ 1 has W = A + list + tile · j.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    deal_tile_bounds(const uint32_t* tile_offsets, int64_t segment_keys, int grid,
                     DealWeights weights, uint32_t* bounds) {
  using BlockScan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ uint32_t list_total;
  const int64_t first = int64_t(blockIdx.x) * segment_keys;
  const uint32_t begin = tile_offsets[first];
  const uint32_t end = tile_offsets[first + segment_keys];
  uint32_t* out = bounds + size_t(blockIdx.x) * (kMaxDealGrid + 1);
  // Pass 1: the segment's non-empty lists.
  uint32_t lists = 0;
  for (int64_t k = threadIdx.x; k < segment_keys; k += kThreads) {
    lists += tile_offsets[first + k + 1] > tile_offsets[first + k] ? 1u : 0u;
  }
  if (threadIdx.x == 0) list_total = 0;
  __syncthreads();
  atomicAdd(&list_total, lists);
  __syncthreads();
  const uint64_t total =
      uint64_t(weights.tile) * (end - begin) + uint64_t(weights.list) * list_total;
  // target(x) = ⌊share · x / g⌋ with share = W · share_num and g = grid · share_den.
  const uint64_t share = total * weights.share_num;
  const uint64_t g = uint64_t(grid) * weights.share_den;
  auto target = [&](uint64_t x) { return share * x / g; };
  // Ranges whose target is 0 (more CTAs than weight) start at the segment's first tile.
  for (int x = threadIdx.x; x <= grid; x += kThreads) {
    if (target(uint64_t(x)) == 0) out[x] = begin;
  }
  // Pass 2: each non-empty list writes the bounds whose target falls in (A, A + its weight].
  uint32_t lists_before = 0;  // non-empty lists of the earlier rounds
  for (int64_t base = 0; base < segment_keys; base += kThreads) {
    const int64_t k = base + threadIdx.x;
    const uint32_t at = k < segment_keys ? tile_offsets[first + k] : end;
    const uint32_t count = k < segment_keys ? tile_offsets[first + k + 1] - at : 0u;
    uint32_t rank = 0;
    uint32_t round_lists = 0;
    BlockScan(scan_storage).ExclusiveSum(count > 0 ? 1u : 0u, rank, round_lists);
    __syncthreads();
    if (count > 0) {
      const uint64_t a =
          uint64_t(weights.tile) * (at - begin) + uint64_t(weights.list) * (lists_before + rank);
      const uint64_t a_next = a + weights.list + uint64_t(weights.tile) * count;
      // x with a < target(x) ≤ a_next, i.e. (a + 1)·g / share ≤ x < (a_next + 1)·g / share.
      uint64_t x = ((a + 1) * g + share - 1) / share;
      const uint64_t x_end = ((a_next + 1) * g + share - 1) / share;
      for (x = x < 1 ? 1 : x; x < x_end && x <= uint64_t(grid); ++x) {
        const uint64_t t = target(x);
        const uint64_t over = t > a + weights.list ? t - a - weights.list : 0;
        uint64_t j = (over + weights.tile - 1) / weights.tile;
        j = j < 1 ? 1 : (j > count ? count : j);
        out[x] = at + uint32_t(j);
      }
    }
    lists_before += round_lists;
  }
}

}  // namespace flashmsa::kernels::schedule
