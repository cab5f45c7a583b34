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
// Small problems (≤ 4096 entries and key rows) run all five passes in one CTA instead:
// small_schedule, one launch (see its NOTES).
#pragma once

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
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
// The list key of block_idx entry e (the sentinel for an empty slot) and its packed entry.
__device__ __forceinline__ void entry_key_value(const int32_t* __restrict__ block_idx,  // [b, hp, s, k]
                                                const KeyShape& shape, int64_t e, uint32_t* key,
                                                uint32_t* value) {
  const int slot = int(e % shape.top_k);
  const int64_t row = e / shape.top_k;  // (b · Hp + p) · S + i
  const int64_t i = row % shape.seqlen;
  const int64_t bp = row / shape.seqlen;
  const int p = int(bp % shape.num_proxy_heads);
  const int64_t b = bp / shape.num_proxy_heads;
  const int32_t block = block_idx[e];
  *key = shape.sentinel;
  if (block >= 0) {
    const int64_t chunk = (b * shape.seqlen + i) / shape.chunk_rows;
    const int g = p / shape.proxy_heads_per_kv;
    const int num_kv_heads = shape.num_proxy_heads / shape.proxy_heads_per_kv;
    *key = uint32_t(
        (((chunk * shape.batch + b) * num_kv_heads + g) * shape.num_blocks + block) *
            shape.proxy_heads_per_kv +
        p % shape.proxy_heads_per_kv);
  }
  *value = (uint32_t(i) << kSlotBits) | uint32_t(slot);
}

__global__ void build_keys(const int32_t* __restrict__ block_idx,  // [b, hp, s, k]
                           KeyShape shape, int64_t entries, uint32_t* __restrict__ keys,
                           uint32_t* __restrict__ values) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= entries) return;
  entry_key_value(block_idx, shape, e, &keys[e], &values[e]);
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

// The first index whose value is > key.
__device__ __forceinline__ uint32_t upper_bound(const uint32_t* __restrict__ sorted, uint32_t count,
                                                uint32_t key) {
  return lower_bound(sorted, count, key + 1);
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
  // One warp per key: more than 2^27 keys are more than 2^32 threads, so the warp index is formed
  // from the block index (a thread index in 32 bits would wrap and skip the highest keys' tiles).
  const uint64_t global_warp = uint64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const uint32_t lane = threadIdx.x % 32;
  if (global_warp == 0 && lane == 0) header[0] = values_buffer;
  if (global_warp >= num_keys) return;
  const uint32_t warp = uint32_t(global_warp);
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

// ---- small problems: every pass in one CTA ----------------------------------------------------
// NOTES: at small S the schedule's cost is its host time: the five passes above are six launches
// and CUB's occupancy queries (≈ 25 µs of host time per call on the H200 machine). When the
// entries and the key table fit one CTA, this kernel does the same passes in shared memory with one
// launch: keys, a stable block radix sort (cub::BlockRadixSort keeps the input order of equal
// keys, like the device sort), list bounds by binary search, a block scan of the tile counts, and
// the tiles. It writes what the device path writes (sorted entries in values[0], entry_offsets,
// tile_offsets, tiles, header[0] = 0); tile_counts are left unwritten (nothing reads them).
constexpr int kSmallThreads = 1024;
constexpr int kSmallItems = 4;                                  // per thread, blocked
constexpr int64_t kSmallCapacity = kSmallThreads * kSmallItems;  // entries, and key table rows

inline bool fits_one_cta(const ScheduleLayout& layout) {
  return layout.entries <= kSmallCapacity && layout.num_keys + 1 <= kSmallCapacity;
}

__global__ void __launch_bounds__(kSmallThreads)
    small_schedule(const int32_t* __restrict__ block_idx,  // [b, hp, s, k]
                   KeyShape shape, uint32_t entries, int key_bits, int tokens_per_tile,
                   uint32_t* __restrict__ sorted_values,  // [entries]
                   uint32_t* __restrict__ entry_offsets,  // [num_keys + 1]
                   uint32_t* __restrict__ tile_offsets,   // [num_keys + 1]
                   uint4* __restrict__ tiles, int32_t* __restrict__ header) {
  using BlockSort = cub::BlockRadixSort<uint32_t, kSmallThreads, kSmallItems, uint32_t>;
  using BlockScan = cub::BlockScan<uint32_t, kSmallThreads>;
  struct Tables {
    uint32_t keys[kSmallCapacity];          // sorted keys (entries of them are real)
    uint32_t tile_offsets[kSmallCapacity];  // exclusive scan of the tile counts
  };
  __shared__ union {
    typename BlockSort::TempStorage sort;
    Tables tables;  // once the sort is done
  } storage;
  __shared__ typename BlockScan::TempStorage scan_storage;

  const uint32_t num_keys = shape.sentinel;
  const uint32_t padding_key = (1u << key_bits) - 1u;  // >= the sentinel: sorts after every entry
  const uint32_t first_item = threadIdx.x * kSmallItems;

  // 1-2. keys and the stable sort, items in blocked order (thread t holds t·4 .. t·4+3).
  uint32_t keys[kSmallItems];
  uint32_t values[kSmallItems];
  for (int j = 0; j < kSmallItems; ++j) {
    keys[j] = padding_key;
    values[j] = 0;
    if (first_item + j < entries) entry_key_value(block_idx, shape, first_item + j, &keys[j], &values[j]);
  }
  BlockSort(storage.sort).Sort(keys, values, 0, key_bits);
  __syncthreads();  // the sort's storage becomes the tables
  for (int j = 0; j < kSmallItems; ++j) {
    storage.tables.keys[first_item + j] = keys[j];
    if (first_item + j < entries) sorted_values[first_item + j] = values[j];
  }
  __syncthreads();

  // 3-4. list bounds and the exclusive scan of the tile counts, key rows in blocked order.
  uint32_t counts[kSmallItems];
  for (int j = 0; j < kSmallItems; ++j) {
    const uint32_t key = first_item + j;
    counts[j] = 0;
    if (key > num_keys) continue;
    const uint32_t first = lower_bound(storage.tables.keys, entries, key);
    entry_offsets[key] = first;
    if (key == num_keys) continue;
    const uint32_t last = lower_bound(storage.tables.keys, entries, key + 1);
    counts[j] = (last - first + tokens_per_tile - 1) / tokens_per_tile;
  }
  uint32_t offsets[kSmallItems];
  BlockScan(scan_storage).ExclusiveSum(counts, offsets);
  for (int j = 0; j < kSmallItems; ++j) {
    const uint32_t key = first_item + j;
    storage.tables.tile_offsets[key] = offsets[j];
    if (key <= num_keys) tile_offsets[key] = offsets[j];
  }
  __syncthreads();

  // 5. tiles: thread-strided over all tiles; each finds its list in the scanned offsets.
  const uint32_t total_tiles = storage.tables.tile_offsets[num_keys];
  for (uint32_t tile = threadIdx.x; tile < total_tiles; tile += kSmallThreads) {
    const uint32_t key = upper_bound(storage.tables.tile_offsets, num_keys + 1, tile) - 1;
    const uint32_t first = lower_bound(storage.tables.keys, entries, key);
    const uint32_t length = lower_bound(storage.tables.keys, entries, key + 1) - first;
    const uint32_t begin = (tile - storage.tables.tile_offsets[key]) * tokens_per_tile;
    const uint32_t rows = min(uint32_t(tokens_per_tile), length - begin);
    tiles[tile] = make_uint4(key, first + begin, rows, 0u);
  }
  if (threadIdx.x == 0) header[0] = 0;  // the sorted entries are in values[0]
}

// ---- launcher ---------------------------------------------------------------------------------
inline Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::Ok();
  return {StatusCode::kCudaError, std::string("schedule: ") + what + ": " + cudaGetErrorString(error)};
}

inline Status run_schedule(const ScheduleParams& params, cudaStream_t stream) {
  const ProblemShape& shape = params.shape;
  if (const Limit limit = schedule_limit(shape)) return unsupported(limit);
  const ScheduleLayout layout = make_schedule_layout(shape);
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

  if (fits_one_cta(layout)) {
    small_schedule<<<1, kSmallThreads, 0, stream>>>(
        params.block_idx, key_shape, uint32_t(entries), layout.key_bits, tokens,
        at(layout.values[0]), at(layout.entry_offsets), at(layout.tile_offsets),
        reinterpret_cast<uint4*>(base + layout.tiles), reinterpret_cast<int32_t*>(base + layout.header));
    return cuda_status(cudaGetLastError(), "small_schedule");
  }

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
