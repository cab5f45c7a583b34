// Select kernel (SPEC.md §1): block scores of q_proxy·k_proxyᵀ, forced local block, top-K, fused.
//
// config.h comes before (tiles, shared memory); instantiations/*.cu instantiate run_select and
// launch.cu dispatches to them. docs/design.md "Select kernel" has the design and the numbers.
//
// Roles:
//   scheduler  persistent CTAs walk the tiles longest first, in snake order (tile_at).
//   producer   warpgroup 0, one thread: TMA loads of the query tile (256 rows) and of the key
//              blocks c < c(rows) into a ring of stages.
//   mainloop   warpgroups 1-2, 128 rows each: S = Q·Kᵀ for one key block on wgmma (two m64n128
//              fragments, fp32 accumulators; Q held in registers for the whole tile, keys from
//              shared memory), ping-ponged so one warpgroup's epilogue runs under the other's
//              matrix work.
//   epilogue   per key block: row maxima (the block score, times σp), then the streaming top-K.
//              Per tile: block_idx rows written, local block first.
//
// NOTES: no token-level mask is ever needed. The local block c(i) is forced (+inf), so its scores
// are never computed; every other visible block c < c(i) is entirely visible (all its keys j < i);
// and keys >= S lie only in the last block, which is local to every query that could see it.
//
// NOTES: the streaming top-K. Each row's K-1 best (score, block) pairs live unsorted in shared
// memory, owned by one thread (the quad's four threads each own one of the four rows their
// accumulator fragments share), with the weakest entry's score in a register as the threshold.
// Blocks arrive in ascending order, so a new block enters only with a score strictly above the
// threshold (an equal score keeps the earlier, smaller block: SPEC.md's tie rule) and replaces the
// weakest entry (lowest score, ties to the larger block); a rescan of the K-1 entries finds the
// next weakest. After the first K blocks most scores fall below the threshold and nothing is
// touched. The list is sorted once per tile, before the row is written.
// Rare per row is not rare per warp: a warp holds 32 rows, so for c < ~30·K some row inserts at
// almost every key block and the warp pays the insertion path. A sorted list with a shifting
// insert (and a serial rescan) cost 7 of 18 ms at 128K; the unsorted list with a branch-free rescan
// (independent LDS, min tree) brought the kernel to 12.6 ms, near the 11.1 ms of the same kernel
// with no top-K at all (docs/design.md "Select kernel").
//
// NOTES: Q lives in registers (wgmma with A from registers, 64 registers per thread, loaded once
// per tile with ldmatrix), so each key block reads only the key tile from shared memory, and the
// query buffer is released at the start of a tile: the producer loads the next tile's queries
// under the current one.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "flashmsa/api.h"
#include "kernels/common/device_cache.h"
#include "kernels/common/ptx/barrier.h"
#include "kernels/common/ptx/tma.h"
#include "kernels/common/ptx/wgmma.h"
#include "kernels/common/tma_desc.h"
#include "kernels/select/config.h"

namespace flashmsa::kernels::select {

// ---------------------------------------------------------------------------------------------
// Tile scheduler
// ---------------------------------------------------------------------------------------------

// One CTA tile: `heads_per_tile` proxy heads (from first_proxy_head) × `tokens_per_tile` tokens
// (from first_token) of one batch, all sharing key head `key_head`.
struct Tile {
  int batch;
  int key_head;
  int first_proxy_head;
  int first_token;
  int num_key_blocks;  // key blocks the tile's rows can see besides their local block
};

// Tiles are numbered longest first: index u -> query tile num_query_tiles-1 - u / num_groups.
__device__ __forceinline__ Tile tile_at(const KernelParams& params, int index) {
  const int query_tile = params.num_query_tiles - 1 - index / params.num_groups;
  const int group = index % params.num_groups;
  Tile tile;
  const int subgroup = group % params.subgroups;
  const int head_group = group / params.subgroups;  // batch · Hpk + key head
  const int num_key_heads = params.num_proxy_heads / params.proxy_ratio;
  tile.batch = head_group / num_key_heads;
  tile.key_head = head_group % num_key_heads;
  tile.first_proxy_head = tile.key_head * params.proxy_ratio + subgroup * params.heads_per_tile;
  tile.first_token = query_tile * params.tokens_per_tile;
  const int last_token = min(tile.first_token + params.tokens_per_tile, params.seqlen) - 1;
  tile.num_key_blocks = last_token / kBlockSize;
  return tile;
}

// The r-th tile of CTA `cta` among `ctas`: snake order over the longest-first list, so that the
// sum of tile lengths evens out between CTAs. Returns -1 past the end.
__device__ __forceinline__ int scheduled_tile(int round, int cta, int ctas, int num_tiles) {
  const int index = round * ctas + ((round & 1) ? ctas - 1 - cta : cta);
  return index < num_tiles ? index : -1;
}

// ---------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------

template <typename Element, int kMaxKeep, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    select_kernel(const __grid_constant__ CUtensorMap query_map,
                  const __grid_constant__ CUtensorMap key_map, const KernelParams params) {
  using Storage = SharedStorage<Element, kMaxKeep, kStages>;
  extern __shared__ unsigned char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(ptx::align_shared_1024(smem_raw));

  constexpr uint32_t kQueryBytes = 2 * kTileRows * kHalfDim * sizeof(Element);
  constexpr uint32_t kKeyBytes = 2 * kBlockSize * kHalfDim * sizeof(Element);
  constexpr uint32_t kConsumerWarps = 4 * kConsumerWarpgroups;

  const int warpgroup = ptx::warpgroup_index();
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&smem.key_full[s], 1);
      ptx::mbarrier_init(&smem.key_empty[s], kConsumerWarps);
    }
    ptx::mbarrier_init(&smem.query_full, 1);
    ptx::mbarrier_init(&smem.query_empty, kConsumerWarps);
    ptx::fence_barrier_init();
    ptx::tma_prefetch_descriptor(&query_map);
    ptx::tma_prefetch_descriptor(&key_map);
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ===================================== producer =====================================
    ptx::warpgroup_registers_decrease<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    int load = 0;  // key blocks loaded so far: stage = load % kStages
    for (int round = 0, tile_iter = 0;; ++round, ++tile_iter) {
      const int index = scheduled_tile(round, blockIdx.x, gridDim.x, params.num_tiles);
      if (index < 0) break;
      const Tile tile = tile_at(params, index);
      ptx::mbarrier_wait(&smem.query_empty, (tile_iter & 1) ^ 1);
      ptx::mbarrier_arrive_expect_tx(&smem.query_full, kQueryBytes);
      for (int half = 0; half < 2; ++half) {
        ptx::tma_load_4d(smem.query[half], &query_map, &smem.query_full, half * kHalfDim,
                         tile.first_token, tile.first_proxy_head, tile.batch);
      }
      for (int block = 0; block < tile.num_key_blocks; ++block, ++load) {
        const int stage = load % kStages;
        ptx::mbarrier_wait(&smem.key_empty[stage], ((load / kStages) & 1) ^ 1);
        ptx::mbarrier_arrive_expect_tx(&smem.key_full[stage], kKeyBytes);
        for (int half = 0; half < 2; ++half) {
          ptx::tma_load_4d(smem.key[stage][half], &key_map, &smem.key_full[stage], half * kHalfDim,
                           block * kBlockSize, tile.key_head, tile.batch);
        }
      }
    }
    return;
  }

  // ===================================== consumers =====================================
  ptx::warpgroup_registers_increase<kConsumerRegisters>();
  const int consumer = warpgroup - 1;                 // 0 or 1
  const int column = threadIdx.x - 128;               // owner column in the top-K lists, 0..255
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int quad_lane = lane & 3;
  // The row this thread owns: fragment (quad_lane >> 1), upper/lower 8 rows (quad_lane & 1).
  const int owned_row = consumer * kRowsPerWarpgroup + (quad_lane >> 1) * 64 + warp * 16 + lane / 4 +
                        (quad_lane & 1) * 8;
  const int keep = params.top_k - 1;
  const float scale = params.scale;
  float* list_score = &smem.list_score[0][column];     // this row's list, slot stride kTileRows
  uint16_t* list_block = &smem.list_block[0][column];
  for (int slot = keep; slot < kMaxKeep; ++slot) list_score[slot * kTileRows] = INFINITY;  // unused

  // Ping-pong: named barrier 1 + w is "warpgroup w may issue"; warpgroup 0 starts.
  // NOTES: measured at 128K: 12.64 ms with, 12.72 ms without (within run-to-run spread); kept
  // because it fixes the issue order that lets one epilogue hide under the other's wgmma.
  constexpr uint32_t kPingPongThreads = 2 * 128;
  if (consumer == 1) ptx::named_barrier_arrive(1, kPingPongThreads);

  float accum[2][64];  // (m64 fragment, 64 values): rows consumer·128 + fragment·64 + ...
  uint32_t query_fragment[2][8][4];  // (m64 fragment, k-step of 16 over Di, 4 registers of bf16x2)
  int load = 0;
  for (int round = 0, tile_iter = 0;; ++round, ++tile_iter) {
    const int index = scheduled_tile(round, blockIdx.x, gridDim.x, params.num_tiles);
    if (index < 0) break;
    const Tile tile = tile_at(params, index);
    const int row_token = tile.first_token + owned_row % params.tokens_per_tile;
    const int row_head = tile.first_proxy_head + owned_row / params.tokens_per_tile;
    const int row_block = row_token / kBlockSize;
    int count = 0;
    int worst = 0;  // slot of the weakest entry once the list is full
    float threshold = keep > 0 ? -INFINITY : INFINITY;

    // ---- mainloop prologue: this warpgroup's query rows into registers (wgmma A fragments) ----
    ptx::mbarrier_wait(&smem.query_full, tile_iter & 1);
#pragma unroll
    for (int fragment = 0; fragment < 2; ++fragment) {
      const int row = consumer * kRowsPerWarpgroup + fragment * 64 + warp * 16 + lane % 16;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t row_address = ptx::smem_address(smem.query[half] + row * kHalfDim);
#pragma unroll
        for (int k_step = 0; k_step < kHalfDim / 16; ++k_step) {
          const int chunk = (2 * k_step + lane / 16) ^ (row % 8);  // the 128-byte swizzle
          ptx::ldmatrix_x4(query_fragment[fragment][half * 4 + k_step], row_address + chunk * 16);
        }
      }
    }
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&smem.query_empty);  // the producer may load the next tile

    for (int block = 0; block < tile.num_key_blocks; ++block, ++load) {
      const int stage = load % kStages;
      ptx::mbarrier_wait(&smem.key_full[stage], (load / kStages) & 1);

      // ---- mainloop: S[128 rows, 128 keys] = Q·Kᵀ for this warpgroup's rows ----
      ptx::named_barrier_sync(1 + consumer, kPingPongThreads);
      ptx::wgmma_fence();
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint64_t key_desc = ptx::make_sw128_kmajor_desc(smem.key[stage][half]);
#pragma unroll
        for (int k_step = 0; k_step < kHalfDim / 16; ++k_step) {
#pragma unroll
          for (int fragment = 0; fragment < 2; ++fragment) {
            ptx::Wgmma64x128x16<Element>::run(accum[fragment], query_fragment[fragment][half * 4 + k_step],
                                              ptx::advance_desc(key_desc, k_step * 32),
                                              (half | k_step) != 0);
          }
        }
      }
      ptx::wgmma_commit_group();
      ptx::named_barrier_arrive(1 + (1 - consumer), kPingPongThreads);
      ptx::wgmma_wait_group<0>();
      ptx::fence_accumulators(accum[0]);
      ptx::fence_accumulators(accum[1]);
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&smem.key_empty[stage]);

      // ---- epilogue: block maxima of the four rows of this quad, reduce-scattered ----
      float row_max[4];  // (fragment, upper/lower 8 rows)
#pragma unroll
      for (int fragment = 0; fragment < 2; ++fragment) {
#pragma unroll
        for (int upper = 0; upper < 2; ++upper) {
          float even = accum[fragment][2 * upper];
          float odd = accum[fragment][2 * upper + 1];
#pragma unroll
          for (int j = 1; j < 16; ++j) {
            even = fmaxf(even, accum[fragment][4 * j + 2 * upper]);
            odd = fmaxf(odd, accum[fragment][4 * j + 2 * upper + 1]);
          }
          row_max[fragment * 2 + upper] = fmaxf(even, odd);
        }
      }
      // Step 1 (lanes ^ 2): keep my fragment's two rows; step 2 (lanes ^ 1): keep my row.
      const bool my_fragment = quad_lane >> 1;
      const bool my_upper = quad_lane & 1;
      float keep0 = my_fragment ? row_max[2] : row_max[0];
      float keep1 = my_fragment ? row_max[3] : row_max[1];
      const float send0 = my_fragment ? row_max[0] : row_max[2];
      const float send1 = my_fragment ? row_max[1] : row_max[3];
      keep0 = fmaxf(keep0, __shfl_xor_sync(0xffffffffu, send0, 2));
      keep1 = fmaxf(keep1, __shfl_xor_sync(0xffffffffu, send1, 2));
      const float mine = my_upper ? keep1 : keep0;
      const float other = my_upper ? keep0 : keep1;
      float score = fmaxf(mine, __shfl_xor_sync(0xffffffffu, other, 1)) * scale;
      if (score != score) score = -INFINITY;  // NaN ranks lowest, as in the reference

      // ---- epilogue: streaming top-K insertion (rare once the list is full) ----
      if (block < row_block && (count < keep || score > threshold)) {
        const int position = count < keep ? count++ : worst;
        list_score[position * kTileRows] = score;
        list_block[position * kTileRows] = static_cast<uint16_t>(block);
        if (count == keep) {
          // The new weakest entry: lowest score, ties to the larger (later) block. Branch-free over
          // all kMaxKeep slots (unused ones hold +inf): a min tree, then the largest
          // (block, slot) key among the entries at that minimum.
          float slot_score[kMaxKeep];
          int slot_key[kMaxKeep];
#pragma unroll
          for (int slot = 0; slot < kMaxKeep; ++slot) {
            slot_score[slot] = list_score[slot * kTileRows];
            slot_key[slot] = int(list_block[slot * kTileRows]) * 64 + slot;
          }
          threshold = slot_score[0];
#pragma unroll
          for (int slot = 1; slot < kMaxKeep; ++slot) threshold = fminf(threshold, slot_score[slot]);
          int worst_key = -1;
#pragma unroll
          for (int slot = 0; slot < kMaxKeep; ++slot) {
            worst_key = max(worst_key, slot_score[slot] == threshold ? slot_key[slot] : -1);
          }
          worst = worst_key & 63;
        }
      }
    }

    // ---- epilogue: sort the list (descending score, ties to the smaller block), write the row ----
    for (int slot = 1; slot < count; ++slot) {
      const float entry_score = list_score[slot * kTileRows];
      const uint16_t entry_block = list_block[slot * kTileRows];
      int position = slot;
      for (; position > 0; --position) {
        const float above_score = list_score[(position - 1) * kTileRows];
        const uint16_t above_block = list_block[(position - 1) * kTileRows];
        if (above_score > entry_score || (above_score == entry_score && above_block < entry_block)) break;
        list_score[position * kTileRows] = above_score;
        list_block[position * kTileRows] = above_block;
      }
      list_score[position * kTileRows] = entry_score;
      list_block[position * kTileRows] = entry_block;
    }
    if (row_token < params.seqlen) {
      int32_t* out = params.block_idx +
                     ((int64_t(tile.batch) * params.num_proxy_heads + row_head) * params.seqlen +
                      row_token) * params.top_k;
      out[0] = row_block;
      for (int slot = 1; slot < params.top_k; ++slot) {
        out[slot] = slot - 1 < count ? int32_t(list_block[(slot - 1) * kTileRows]) : -1;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------------------------

template <typename Element, int kMaxTopKOfBucket>
Status run_select(const SelectParams& params, cudaStream_t stream) {
  using Bucket = TopKBucket<kMaxTopKOfBucket>;
  constexpr int kSmemBytes = smem_bytes<Element, Bucket::kMaxKeep, Bucket::kStages>();
  static_assert(uint32_t(kSmemBytes) <= kMaxBlockSharedBytes, "select: shared memory over the 227 KB budget");
  const ProblemShape& shape = params.shape;
  if (const Limit limit = select_limit(shape)) return unsupported(limit);

  KernelParams kernel_params{};
  kernel_params.block_idx = params.block_idx;
  kernel_params.seqlen = int(shape.seqlen);
  kernel_params.num_proxy_heads = shape.num_proxy_heads;
  kernel_params.proxy_ratio = shape.num_proxy_heads / shape.num_proxy_kv_heads;
  // NOTES: heads per tile = the largest power of two dividing R, at most 4 (T >= 64 tokens), so a
  // tile never straddles two key heads and wastes no rows.
  int heads_per_tile = 1;
  while (heads_per_tile < 4 && kernel_params.proxy_ratio % (heads_per_tile * 2) == 0) heads_per_tile *= 2;
  kernel_params.heads_per_tile = heads_per_tile;
  kernel_params.tokens_per_tile = kTileRows / heads_per_tile;
  kernel_params.top_k = shape.top_k;
  kernel_params.subgroups = kernel_params.proxy_ratio / heads_per_tile;
  kernel_params.num_groups = int(shape.batch) * shape.num_proxy_kv_heads * kernel_params.subgroups;
  kernel_params.num_query_tiles =
      int((shape.seqlen + kernel_params.tokens_per_tile - 1) / kernel_params.tokens_per_tile);
  const int64_t num_tiles = int64_t(kernel_params.num_groups) * kernel_params.num_query_tiles;
  if (num_tiles > INT32_MAX) {
    return {StatusCode::kUnsupported, "shape: select supports at most 2^31 tiles"};
  }
  kernel_params.num_tiles = int(num_tiles);
  kernel_params.scale = float(effective_scale(params.proxy_scale, shape.proxy_head_dim));

  CUtensorMap query_map;
  CUtensorMap key_map;
  const TensorMapBox query_box{kHalfDim, uint32_t(kernel_params.tokens_per_tile), uint32_t(heads_per_tile)};
  const TensorMapBox key_box{kHalfDim, kBlockSize, 1};
  if (Status status = make_tensor_map_sw128(&query_map, params.q_proxy, params.dtype, shape.batch,
                                            shape.seqlen, shape.num_proxy_heads, kHeadDim, query_box);
      !status.ok()) {
    return status;
  }
  if (Status status = make_tensor_map_sw128(&key_map, params.k_proxy, params.dtype, shape.batch,
                                            shape.seqlen, shape.num_proxy_kv_heads, kHeadDim, key_box);
      !status.ok()) {
    return status;
  }

  auto kernel = select_kernel<Element, Bucket::kMaxKeep, Bucket::kStages>;
  int device = 0;
  int num_sms = 0;
  cudaError_t error = current_device_sms(&device, &num_sms);
  if (error == cudaSuccess) {
    error = set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), device, kSmemBytes);
  }
  if (error != cudaSuccess) return {StatusCode::kCudaError, cudaGetErrorString(error)};
  if (kernel_params.num_tiles == 0) return Status::Ok();
  const int grid = std::min(kernel_params.num_tiles, num_sms);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(query_map, key_map, kernel_params);
  error = cudaGetLastError();
  if (error != cudaSuccess) return {StatusCode::kCudaError, cudaGetErrorString(error)};
  return Status::Ok();
}

}  // namespace flashmsa::kernels::select
