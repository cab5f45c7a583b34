// The schedule stage: block_idx [b, hp, s, k] -> the reverse index and work tiles of
// schedule/config.h, built entirely on the device (no host synchronisation, graph capturable).
//
// Comes before: select. Comes after: forward (and the backward) read the layout of config.h.
//
// Passes, each a parallel primitive (no single-thread loops over the data):
//   1. build_keys      one thread per block_idx entry: the list key (sentinel for empty slots) and
//                      the packed entry (i << 6 | slot).
//   2. stable radix sort of (key, entry) pairs on key_bits bits (CUB onesweep). Stability keeps the
//                      (b, p, i, slot) input order inside every list, so lists are query-ascending.
//   3. list_bounds     one thread per key: lower_bound of the key in the sorted keys gives the
//                      list's first entry; the list's tile count is ⌈length / tokens_per_tile⌉.
//   4. exclusive scan  of the tile counts (CUB) -> the first tile of every list.
//   5. write_tiles     one warp per key writes its tiles {key, first entry, count}.
#pragma once

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <cstdint>

#include "kernels/launch.h"
#include "kernels/schedule/config.h"

namespace flashmsa::kernels::schedule {

struct KeyShape {
  int64_t seqlen;
  int64_t chunk_rows;
  int64_t num_blocks;
  int batch;
  int num_proxy_heads;
  int proxy_heads_per_kv;  // Rg = Hp / Hkv
  int top_k;
  uint32_t sentinel;       // num_keys
};

// ---- 1. keys ----------------------------------------------------------------------------------
__global__ void build_keys(const int32_t* __restrict__ block_idx,  // [b, hp, s, k]
                           KeyShape shape, int64_t entries, uint32_t* __restrict__ keys,
                           uint32_t* __restrict__ values) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= entries) return;
  const int slot = int(e % shape.top_k);
  const int64_t row = e / shape.top_k;  // (b · Hp + p) · S + i
  const int64_t i = row % shape.seqlen;
  const int64_t bp = row / shape.seqlen;
  const int p = int(bp % shape.num_proxy_heads);
  const int64_t b = bp / shape.num_proxy_heads;
  const int32_t block = block_idx[e];
  uint32_t key = shape.sentinel;
  if (block >= 0) {
    const int64_t chunk = (b * shape.seqlen + i) / shape.chunk_rows;
    const int g = p / shape.proxy_heads_per_kv;
    const int num_kv_heads = shape.num_proxy_heads / shape.proxy_heads_per_kv;
    key = uint32_t(
        (((chunk * shape.batch + b) * num_kv_heads + g) * shape.num_blocks + block) *
            shape.proxy_heads_per_kv +
        p % shape.proxy_heads_per_kv);
  }
  keys[e] = key;
  values[e] = (uint32_t(i) << kSlotBits) | uint32_t(slot);
}

// ---- 3. list bounds ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t lower_bound(const uint32_t* __restrict__ sorted, uint32_t count,
                                                uint32_t key) {
  uint32_t low = 0;
  uint32_t high = count;
  while (low < high) {
    const uint32_t mid = (low + high) / 2;
    if (sorted[mid] < key) {
      low = mid + 1;
    } else {
      high = mid;
    }
  }
  return low;
}

__global__ void list_bounds(const uint32_t* __restrict__ sorted_keys, uint32_t entries,
                            uint32_t num_keys, int tokens_per_tile,
                            uint32_t* __restrict__ entry_offsets,  // [num_keys + 1]
                            uint32_t* __restrict__ tile_counts) {  // [num_keys + 1]
  const uint32_t key = blockIdx.x * blockDim.x + threadIdx.x;
  if (key > num_keys) return;
  const uint32_t first = lower_bound(sorted_keys, entries, key);
  entry_offsets[key] = first;
  if (key == num_keys) {
    tile_counts[key] = 0;
    return;
  }
  const uint32_t last = lower_bound(sorted_keys, entries, key + 1);
  tile_counts[key] = (last - first + tokens_per_tile - 1) / tokens_per_tile;
}

// ---- 5. tiles ---------------------------------------------------------------------------------
__global__ void write_tiles(const uint32_t* __restrict__ entry_offsets,
                            const uint32_t* __restrict__ tile_offsets, uint32_t num_keys,
                            int tokens_per_tile, uint4* __restrict__ tiles,
                            int32_t* __restrict__ header, int32_t values_buffer) {
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const uint32_t lane = threadIdx.x % 32;
  if (warp == 0 && lane == 0) header[0] = values_buffer;
  if (warp >= num_keys) return;
  const uint32_t first = entry_offsets[warp];
  const uint32_t length = entry_offsets[warp + 1] - first;
  const uint32_t first_tile = tile_offsets[warp];
  const uint32_t count = tile_offsets[warp + 1] - first_tile;
  for (uint32_t t = lane; t < count; t += 32) {
    const uint32_t begin = t * tokens_per_tile;
    const uint32_t rows = min(uint32_t(tokens_per_tile), length - begin);
    tiles[first_tile + t] = make_uint4(warp, first + begin, rows, 0u);
  }
}

// ---- launcher ---------------------------------------------------------------------------------
inline Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::Ok();
  return {StatusCode::kCudaError, std::string("schedule: ") + what + ": " + cudaGetErrorString(error)};
}

inline Status run_schedule(const ScheduleParams& params, cudaStream_t stream) {
  const ProblemShape& shape = params.shape;
  const ScheduleLayout layout = make_schedule_layout(shape);
  if (layout.entries >= (int64_t(1) << 31) || layout.key_bits > 32 ||
      shape.seqlen >= (int64_t(1) << (32 - kSlotBits))) {
    return {StatusCode::kUnsupported,
            "shape: the schedule indexes entries and keys in 32 bits (B·Hp·S·K < 2^31, S < 2^26)"};
  }
  if (shape.heads_per_proxy() > kBlockSize) {
    return {StatusCode::kUnsupported, "shape: heads per proxy head H/Hp must be ≤ 128"};
  }
  char* base = static_cast<char*>(params.workspace);
  auto at = [&](size_t offset) { return reinterpret_cast<uint32_t*>(base + offset); };
  const int entries = int(layout.entries);
  const uint32_t num_keys = uint32_t(layout.num_keys);
  const int tokens = tokens_per_tile(shape);

  KeyShape key_shape;
  key_shape.seqlen = shape.seqlen;
  key_shape.chunk_rows = chunk_rows(shape);
  key_shape.num_blocks = shape.num_blocks();
  key_shape.batch = int(shape.batch);
  key_shape.num_proxy_heads = shape.num_proxy_heads;
  key_shape.proxy_heads_per_kv = shape.num_proxy_heads / shape.num_kv_heads;
  key_shape.top_k = shape.top_k;
  key_shape.sentinel = num_keys;

  constexpr int kThreads = 256;
  build_keys<<<unsigned((layout.entries + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      params.block_idx, key_shape, layout.entries, at(layout.keys[0]), at(layout.values[0]));
  if (Status s = cuda_status(cudaGetLastError(), "build_keys"); !s.ok()) return s;

  cub::DoubleBuffer<uint32_t> keys(at(layout.keys[0]), at(layout.keys[1]));
  cub::DoubleBuffer<uint32_t> values(at(layout.values[0]), at(layout.values[1]));
  size_t temp_bytes = 0;
  if (Status s = cuda_status(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, values,
                                                              entries, 0, layout.key_bits, stream),
                             "sort size");
      !s.ok()) {
    return s;
  }
  if (temp_bytes > layout.temp_bytes) {
    return {StatusCode::kCudaError, "schedule: radix sort needs more temporary storage than reserved"};
  }
  temp_bytes = layout.temp_bytes;
  if (Status s = cuda_status(cub::DeviceRadixSort::SortPairs(base + layout.temp, temp_bytes, keys,
                                                              values, entries, 0, layout.key_bits,
                                                              stream),
                             "sort");
      !s.ok()) {
    return s;
  }

  list_bounds<<<unsigned((num_keys + 1 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      keys.Current(), uint32_t(entries), num_keys, tokens, at(layout.entry_offsets),
      at(layout.tile_counts));
  if (Status s = cuda_status(cudaGetLastError(), "list_bounds"); !s.ok()) return s;

  size_t scan_bytes = 0;
  if (Status s = cuda_status(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, at(layout.tile_counts),
                                                          at(layout.tile_offsets), int(num_keys + 1),
                                                          stream),
                             "scan size");
      !s.ok()) {
    return s;
  }
  if (scan_bytes > layout.temp_bytes) {
    return {StatusCode::kCudaError, "schedule: scan needs more temporary storage than reserved"};
  }
  scan_bytes = layout.temp_bytes;
  if (Status s = cuda_status(cub::DeviceScan::ExclusiveSum(base + layout.temp, scan_bytes,
                                                          at(layout.tile_counts),
                                                          at(layout.tile_offsets),
                                                          int(num_keys + 1), stream),
                             "scan");
      !s.ok()) {
    return s;
  }

  const int64_t tile_threads = int64_t(num_keys) * 32;
  write_tiles<<<unsigned((tile_threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      at(layout.entry_offsets), at(layout.tile_offsets), num_keys, tokens,
      reinterpret_cast<uint4*>(base + layout.tiles), reinterpret_cast<int32_t*>(base + layout.header),
      values.selector);
  return cuda_status(cudaGetLastError(), "write_tiles");
}

}  // namespace flashmsa::kernels::schedule
