// The sparse forward's tile kernel on Hopper tensor cores: warp-specialised, wgmma, two-stage
// pipelined gathers. Same work tiles, same partial outputs as kernel.cuh (which remains the path
// for M = H/Hp = 1, whose 128 proxy rows per tile do not fit this kernel's shared memory).
//
// Comes before: schedule/kernel.cuh (tiles, entries). Comes after: forward/combine.cuh. Shared
// memory layout: forward/config.h (PipelinedLayout).
//
// Roles (3 warpgroups, one CTA per SM, each CTA walks contiguous ranges of the chunk's tiles, so
// consecutive tiles usually share their key block and K, V, k_proxy are loaded once per list; the
// chunk's segments (b, g) one after another, and in each an equal share of 7/8 of its tiles, then
// ranges of the last 1/8 taken from the segment's counter as CTAs run out, config.h kDealtShare;
// the producer ends the consumers' loop with a stage of count −1):
//   producer   warpgroup 0. Per tile: writes the tile's (row, slot) list to the stage's metadata
//              and issues cp.async gathers of the Q rows (token-major, the M heads of a token
//              adjacent) and the proxy query rows into stage t % stages (3 stages where shared
//              memory allows); a stage is released one tile late: once tile t's copies are
//              issued, each thread waits for its copies of tile t − 1 (cp.async.wait_group 1) and
//              arrives on that stage's barrier. When the list key changes it first waits for the
//              previous tile to finish, then loads K, V and the proxy keys. Tile descriptors are
//              read two tiles ahead, entries one tile ahead.
//   consumers  warpgroups 1-2, 64 query rows each:
//              S = Q·Kᵀ      wgmma m64n128k16, both operands from shared memory (8 k-steps)
//              proxy         meanwhile, on alternate tiles, one warpgroup's 4 warps score the proxy
//                            rows against 32 proxy keys each (mma.sync) and keep per-row (max, sum)
//              softmax       one pass (a tile sees exactly one 128-key block), masks only in the
//                            local and the last block; P rounded to the input dtype in registers
//              O = P·V       wgmma m64n128k16 with P from registers, V MN-major in shared memory
//              epilogue      O / l staged through the warpgroup's own Q rows, 256-byte rows to the
//                            partial buffer; partial LSE; the proxy partial LSE of the tile's rows.
//
// NOTES: every copy is a 16-byte cp.async written with the 128-byte swizzle the wgmma descriptors
// expect (16-byte chunk index XOR row % 8 inside 1024-byte atoms), so any strides and any head
// map work, and keys past S are zero-filled. The producer fences the async proxy before it arrives
// on a stage's barrier, since wgmma reads shared memory through the async proxy and cp.async
// writes it through the generic one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/ptx/barrier.h"
#include "kernels/common/ptx/tma.h"
#include "kernels/common/ptx/warp_mma.h"
#include "kernels/common/ptx/wgmma.h"
#include "kernels/forward/kernel.cuh"

namespace flashmsa::kernels::forward {

// Per-stage metadata written by the producer and read by the consumers.
struct StageMeta {
  // Producer only: address of q at (b, token, first head of the group); padding tokens hold the
  // list's row 0, so every copy's source address is valid (padding copies read 0 bytes).
  uint64_t q_address[kPipelinedMaxTokens];
  int64_t out_offset[kPipelinedMaxTokens];  // element offset in the partials of (token, slot, first head)
  int32_t token_row[kPipelinedMaxTokens];   // query position of each token (padding: never masked)
  int32_t token_slot[kPipelinedMaxTokens];  // slot of the block in that token's block_idx row
  uint32_t key;                   // the schedule's list key (b, g, c, proxy head)
  int32_t count;                  // tokens in the tile
  int32_t new_blocks;             // 1: K, V and the proxy keys were loaded for this tile (wait on kv_full)
  int32_t unused;
};
static_assert(sizeof(StageMeta) == kStageMetaBytes, "forward/config.h sizes the metadata stages");

// Element offset of (row, 16-byte chunk) in a 128-dim tile stored as two 64-dim halves of
// `rows_per_half` rows of 128 bytes, with the 128-byte swizzle.
__device__ __forceinline__ int sw128_offset(int rows_per_half, int row, int chunk) {
  return (chunk >> 3) * rows_per_half * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// The sizes and head maps that the pipelined kernels' argument blocks (forward and backward) read
// alike, and that decode_list_key needs.
template <typename Args>
void set_shape_fields(Args& args, const ProblemShape& shape) {
  args.seqlen = int(shape.seqlen);
  args.num_blocks = int(shape.num_blocks());
  args.batch = int(shape.batch);
  args.num_heads = shape.num_heads;
  args.num_kv_heads = shape.num_kv_heads;
  args.num_proxy_heads = shape.num_proxy_heads;
  args.proxy_heads_per_kv = shape.num_proxy_heads / shape.num_kv_heads;
  args.proxy_ratio = shape.proxy_ratio();
}

// A schedule list key (schedule/config.h) decoded; `unit` is the key without the proxy head:
// (chunk, b, g, c), whose lists share K and V. Args: any argument block with the four counts.
struct ListKey {
  int b, kv_head, block, proxy_head;
  uint32_t unit;
};

template <typename Args>
__device__ __forceinline__ ListKey decode_list_key(uint32_t key, const Args& args) {
  ListKey out;
  const int proxy_local = int(key % uint32_t(args.proxy_heads_per_kv));
  key /= uint32_t(args.proxy_heads_per_kv);
  out.unit = key;
  out.block = int(key % uint32_t(args.num_blocks));
  key /= uint32_t(args.num_blocks);
  out.kv_head = int(key % uint32_t(args.num_kv_heads));
  key /= uint32_t(args.num_kv_heads);
  out.b = int(key % uint32_t(args.batch));
  out.proxy_head = out.kv_head * args.proxy_heads_per_kv + proxy_local;
  return out;
}

// Token and head of gathered query row first_row + 8·i (first_row < 8; rows are token-major with
// the M heads of a token adjacent). Compile-time M that divides 8 or is a multiple of 8 folds both
// to constants plus first_row terms; kM = 0 (any other M) divides at run time.
template <int kM>
constexpr bool kDividesEight = kM > 0 && 8 % (kM > 0 ? kM : 1) == 0;

template <int kM>
__device__ __forceinline__ void gathered_row(int first_row, int i, int M, int& token, int& head) {
  if constexpr (kM >= 8 && kM % 8 == 0) {
    token = i * 8 / kM;
    head = first_row + i * 8 % kM;
  } else if constexpr (kDividesEight<kM>) {  // M divides 8
    token = first_row / kM + i * 8 / kM;
    head = first_row % kM;
  } else {
    token = (first_row + 8 * i) / M;
    head = (first_row + 8 * i) % M;
  }
}

// One producer thread's share (of 128) of the cp.async copies of a 128-key block (keys ≥ S
// zero-filled); kUnroll trades the copies in flight against the producer's registers.
template <int kUnroll = 4, typename Element>
__device__ __forceinline__ void load_key_block(Element* tile, const Strided<const Element>& source, int b,
                                               int first_key, int head, int seqlen, int thread) {
#pragma unroll kUnroll
  for (int index = thread; index < kTileRows * 16; index += kPipelinedProducerThreads) {
    const int row = index >> 4;
    const int chunk = index & 15;
    const bool valid = first_key + row < seqlen;
    const Element* src = valid ? source.row(b, first_key + row, head) + chunk * 8 : source.ptr;
    ptx::cp_async_16(tile + sw128_offset(kTileRows, row, chunk), src, valid);
  }
}

// Whether the lists of one unit (b, g, c) (its proxy heads, the key's fastest digit) share one load
// of K, V and the proxy keys: more than one proxy head per KV head, all reading one proxy-key head
// (R a multiple of Hp / Hkv, as when Hpk ≤ Hkv). Otherwise each list loads its own.
template <typename Args>
__device__ __forceinline__ bool lists_share_blocks(const Args& args) {
  return args.proxy_heads_per_kv > 1 && args.proxy_ratio % args.proxy_heads_per_kv == 0;
}

// kM: M = H/Hp at compile time (2, 4, 8, 16), or 0 to read it from args (any M ≥ 2).
template <typename Element, int kM>
__global__ void __launch_bounds__(kPipelinedThreads, 1)
    sparse_forward_pipelined(const TileArgs<Element> args, const PipelinedLayout layout) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = ptx::align_shared_1024(smem_raw);
  constexpr int kTileElements = kTileRows * kHeadDim;
  Element* q_stages = reinterpret_cast<Element*>(smem + layout.q);  // (stage, 2 halves, 128 rows, 64)
  Element* k_tile = reinterpret_cast<Element*>(smem + layout.k);
  Element* v_tile = reinterpret_cast<Element*>(smem + layout.v);
  Element* kp_tile = reinterpret_cast<Element*>(smem + layout.kp);
  Element* qp_stages = reinterpret_cast<Element*>(smem + layout.qp);  // (stage, 2 halves, prows, 64)
  float2* stats = reinterpret_cast<float2*>(smem + layout.stats);     // (stage, 4 warps, prows)
  StageMeta* meta = reinterpret_cast<StageMeta*>(smem + layout.meta);  // (stage)
  uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + layout.barriers);
  uint64_t* q_full = barriers;                         // (stage) producer -> consumers
  uint64_t* q_empty = barriers + kPipelinedMaxStages;  // (stage) consumers -> producer
  uint64_t* kv_full = barriers + 2 * kPipelinedMaxStages;  // K, V, proxy keys of a new list landed
  const int stages = layout.stages;
  const int prows = layout.proxy_rows;
  const int qp_stage_elements = prows * kHeadDim;

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      ptx::mbarrier_init(&q_full[s], kPipelinedProducerThreads);
      ptx::mbarrier_init(&q_empty[s], 2 * 128);
    }
    ptx::mbarrier_init(kv_full, kPipelinedProducerThreads);
    ptx::fence_barrier_init();
  }
  __syncthreads();

  const int M = kM > 0 ? kM : args.heads_per_proxy;
  const uint32_t* entries = args.header[0] == 1 ? args.entries[1] : args.entries[0];
  const int warpgroup = ptx::warpgroup_index();

  if (warpgroup == 0) {
    // ===================================== producer =====================================
    ptx::warpgroup_registers_decrease<kPipelinedProducerRegisters>();
    const int thread = threadIdx.x;
    const int chunk = thread & 15;         // this thread copies 16-byte chunk `chunk` …
    const int first_row = thread >> 4;     // … of rows first_row + 8·i
    // A row's Q is gathered once per selected block, by tiles of the same segment: evict-last keeps
    // more of it in L2 between them (128K paper, one H100: 44.2 → 43.9 ms; evict-first 48.3 ms).
    const uint64_t q_policy = ptx::l2_policy_evict_last();
    // Loop-invariant parts of this thread's query copies: the first row's head and chunk, and the
    // step of 8 heads (rows r and r + 8 of one token, for M ≥ 16).
    int token0 = 0;
    int head0 = 0;
    gathered_row<kM>(first_row, 0, M, token0, head0);
    const int64_t q_thread_bytes = (int64_t(head0) * args.q.head_stride + chunk * 8) * int64_t(sizeof(Element));
    const int64_t head_step_bytes = 8 * args.q.head_stride * int64_t(sizeof(Element));
    const int64_t out_row_stride = int64_t(args.num_heads) * args.top_k * kHeadDim;
    const uint32_t q_dst = sw128_offset(kTileRows, first_row, chunk);
    // Per list (decoded when the key changes): the key, and the offsets shared by its tiles.
    ListKey key{};
    int64_t q_list = 0;    // q element offset of (b, 0, first head of the proxy group)
    int64_t out_list = 0;  // partial element offset of (row −chunk_first_row + b·S, proxy head, slot 0)
    const Element* qp_list = args.q_proxy.ptr;  // q_proxy row 0 of (b, proxy head), this thread's chunk
    uint32_t last_key = 0xffffffffu;  // also the list whose K, V and proxy keys shared memory holds
    // Descriptors run two tiles ahead, entries one tile ahead of the copies.
    uint4 tile = make_uint4(0, 0, 0, 0);
    uint4 next_tile = make_uint4(0, 0, 0, 0);
    uint32_t entry = 0;
    // The chunk is walked segment (b, g) after segment. Tiles are not equal (a list change drains
    // the pipeline), so 1/kDealtShare of a segment's tiles are dealt on demand: each CTA first walks
    // an equal share of the others, in order, then ranges of split.grab tiles from the rest through
    // the segment's counter, until none is left. Only the segment index lives across the tile loop;
    // its bounds and split are read again where a range is dealt.
    const int segments = int(args.keys_per_chunk / args.segment_keys);
    int segment = 0;
    uint32_t lo = 0;
    int num_tiles = 0;
    // The segment whose first list key is seg_key: its first tile and split.
    auto segment_split = [&](int64_t seg_key, uint32_t& seg_begin) {
      seg_begin = args.tile_offsets[seg_key];
      return split_tiles(args.tile_offsets[seg_key + args.segment_keys] - seg_begin, gridDim.x);
    };
    // This CTA's equal share of the segment's fixed tiles.
    auto take_fixed_share = [&](uint32_t seg_begin, const TileSplit& split) {
      lo = seg_begin + share_bound(split.fixed, blockIdx.x, gridDim.x);
      num_tiles = int(share_bound(split.fixed, blockIdx.x + 1, gridDim.x) - share_bound(split.fixed, blockIdx.x, gridDim.x));
    };
    {
      uint32_t seg_begin = 0;
      const TileSplit split = segment_split(args.first_key, seg_begin);
      take_fixed_share(seg_begin, split);
    }
    uint32_t* grab_slots = reinterpret_cast<uint32_t*>(smem + layout.grab);  // (2) thread 0 -> producer
    int grabs = 0;
    bool any_tile = false;
    // The stage's copies are released to the consumers one tile late: after the next tile's copies
    // are issued, the thread waits for the previous group, fences the async proxy (wgmma reads
    // through it what cp.async wrote through the generic proxy) and arrives.
    bool pending = false;
    int pending_stage = 0;
    bool pending_new_blocks = false;
    auto release_pending = [&]() {
      ptx::fence_proxy_async_shared();
      if (pending_new_blocks) ptx::mbarrier_arrive(kv_full);
      ptx::mbarrier_arrive(&q_full[pending_stage]);
      pending = false;
    };
    // Stage s = t % stages and its barrier phase (t / stages) & 1, and the same for tile t − 1.
    int s = 0;
    uint32_t phase = 0;
    int previous_s = 0;
    uint32_t previous_phase = 0;
    for (;;) {
      if (num_tiles > 0) {
        tile = args.tiles[lo];
        entry = thread < int(tile.z) ? entries[tile.y + thread] : 0u;
      }
      if (num_tiles > 1) next_tile = args.tiles[lo + 1];
      for (int t = 0; t < num_tiles; ++t) {
        const uint32_t key_value = tile.x;
        const bool new_list = key_value != last_key;
        // A new list of the unit whose K, V and proxy keys are loaded keeps them when its lists share
        // them (lists_share_blocks): no drain, no reload.
        bool new_blocks = false;
        if (new_list) {
          key = decode_list_key(key_value, args);
          new_blocks = !any_tile || !lists_share_blocks(args) ||
                       key.unit != last_key / uint32_t(args.proxy_heads_per_kv);
          q_list = int64_t(key.b) * args.q.batch_stride + int64_t(key.proxy_head) * M * args.q.head_stride;
          out_list = partial_index(int64_t(key.b) * args.seqlen - args.chunk_first_row, key.proxy_head, 0, 0,
                                   args.num_proxy_heads, args.top_k, M) * kHeadDim;
          qp_list = args.q_proxy.ptr + int64_t(key.b) * args.q_proxy.batch_stride +
                    int64_t(key.proxy_head) * args.q_proxy.head_stride + chunk * 8;
        }
        const int count = int(tile.z);
        const int first_key = key.block * kBlockSize;
        ptx::mbarrier_wait(&q_empty[s], phase ^ 1);
        if (new_blocks && any_tile) {
          // K, V and the proxy keys are overwritten only after the previous tile is done.
          if (pending) {
            ptx::cp_async_wait<0>();
            release_pending();
          }
          ptx::mbarrier_wait(&q_empty[previous_s], previous_phase);
        }

        StageMeta& stage_meta = meta[s];
        if (thread < kPipelinedMaxTokens) {
          const bool has_entry = thread < count;
          const int32_t row = has_entry ? int32_t(entry >> schedule::kSlotBits) : int32_t(first_key + kBlockSize - 1);
          const int32_t slot = has_entry ? int32_t(entry & ((1u << schedule::kSlotBits) - 1)) : 0;
          stage_meta.token_row[thread] = row;
          stage_meta.token_slot[thread] = slot;
          const int64_t q_offset = has_entry ? q_list + int64_t(row) * args.q.seq_stride : q_list;
          stage_meta.q_address[thread] = reinterpret_cast<uint64_t>(args.q.ptr + q_offset);
          stage_meta.out_offset[thread] = out_list + int64_t(row) * out_row_stride + slot * M * kHeadDim;
          if (thread == 0) {
            stage_meta.key = key_value;
            stage_meta.count = count;
            stage_meta.new_blocks = new_blocks;
          }
        }
        ptx::named_barrier_sync(4, kPipelinedProducerThreads);

        if (new_blocks) {
          load_key_block(k_tile, args.k, key.b, first_key, key.kv_head, args.seqlen, thread);
          load_key_block(v_tile, args.v, key.b, first_key, key.kv_head, args.seqlen, thread);
          load_key_block(kp_tile, args.k_proxy, key.b, first_key, key.proxy_head / args.proxy_ratio,
                         args.seqlen, thread);
        }
        // Rows first_row + 8·i: the destination advances by 8 rows (1024 bytes, same swizzle phase);
        // the source is the token's row plus the head's offset, both folded where M is known.
        {
          Element* dst = q_stages + s * kTileElements + q_dst;
#pragma unroll
          for (int i = 0; i < kTileRows / 8; ++i) {
            int token = 0;
            int head = 0;
            gathered_row<kM>(first_row, i, M, token, head);
            const bool valid = token < count;
            int64_t head_offset;
            if constexpr (kM >= 8 && kM % 8 == 0) {
              head_offset = (head - head0) / 8 * head_step_bytes;
            } else if constexpr (kDividesEight<kM>) {
              head_offset = 0;
            } else {
              head_offset = int64_t(head - head0) * args.q.head_stride * int64_t(sizeof(Element));
            }
            const uint64_t address = stage_meta.q_address[min(token, kPipelinedMaxTokens - 1)];
            ptx::cp_async_16(dst + i * 8 * 64, reinterpret_cast<const Element*>(address + q_thread_bytes + head_offset),
                             valid, q_policy);
          }
        }
        Element* qp_dst = qp_stages + s * qp_stage_elements;
        for (int row = first_row; row < prows; row += 8) {
          const bool valid = row < count;
          const Element* src = qp_list + int64_t(stage_meta.token_row[row]) * args.q_proxy.seq_stride;
          ptx::cp_async_16(qp_dst + sw128_offset(prows, row, chunk), valid ? src : args.q_proxy.ptr, valid);
        }
        ptx::cp_async_commit();
        if (pending) {
          ptx::cp_async_wait<1>();
          release_pending();
        }
        pending = true;
        any_tile = true;
        pending_stage = s;
        pending_new_blocks = new_blocks;
        last_key = key_value;
        previous_s = s;
        previous_phase = phase;
        if (++s == stages) {
          s = 0;
          phase ^= 1;
        }

        if (t + 1 < num_tiles) {
          tile = next_tile;
          entry = thread < int(tile.z) ? entries[tile.y + thread] : 0u;
          if (t + 2 < num_tiles) next_tile = args.tiles[lo + t + 2];
        }
      }
      // The next range: thread 0 takes it from the segment's counter; two slots, so a fast thread 0
      // never overwrites the one the others are still reading. Once the segment's counter is spent,
      // the fixed share of the next segment.
      int64_t seg_key = args.first_key + int64_t(segment) * args.segment_keys;
      uint32_t seg_begin = 0;
      TileSplit split = segment_split(seg_key, seg_begin);
      uint32_t taken = 0;
      if (split.dealt > 0) {
        if (thread == 0) grab_slots[grabs & 1] = atomicAdd(args.tile_counters + segment, split.grab);
        ptx::named_barrier_sync(4, kPipelinedProducerThreads);
        taken = grab_slots[grabs & 1];
        ++grabs;
      }
      if (taken < split.dealt) {
        lo = seg_begin + split.fixed + taken;
        num_tiles = int(min(split.grab, split.dealt - taken));
        continue;
      }
      if (++segment == segments) break;
      seg_key += args.segment_keys;
      split = segment_split(seg_key, seg_begin);
      take_fixed_share(seg_begin, split);
    }
    if (pending) {
      ptx::cp_async_wait<0>();
      release_pending();
    }
    // No tile left: the consumers stop at a stage whose count is −1.
    ptx::mbarrier_wait(&q_empty[s], phase ^ 1);
    if (thread == 0) meta[s].count = -1;
    ptx::mbarrier_arrive(&q_full[s]);
    return;
  }

  // ===================================== consumers =====================================
  ptx::warpgroup_registers_increase<kPipelinedConsumerRegisters>();
  using Mma = ptx::Wgmma64x128x16<Element>;
  const int consumer = warpgroup - 1;                // 0 or 1: rows 64·consumer …
  const int consumer_thread = threadIdx.x - 128;     // 0 … 255
  const int wg_thread = consumer_thread & 127;
  const int warp = wg_thread / 32;                   // warp inside the warpgroup
  const int lane = threadIdx.x % 32;
  const int row0 = consumer * 64 + warp * 16 + lane / 4;  // accumulator rows: row0, row0 + 8
  int acc_token[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) acc_token[half] = min((row0 + half * 8) / M, kPipelinedMaxTokens - 1);
  // The epilogue's store rows: consumer·64 + 8·i + wg_thread / 16, i < 8 (fixed per thread).
  int store_token[8];
  int store_offset[8];  // (head in the group) · D + this thread's 16-byte chunk
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = consumer * 64 + 8 * i + wg_thread / 16;
    store_token[i] = min(row / M, kPipelinedMaxTokens - 1);
    store_offset[i] = (row % M) * kHeadDim + (wg_thread % 16) * 8;
  }
  // The epilogue's staging stores (stmatrix, one per 16 output columns): lane l addresses row
  // 8·((l/8) % 2) + l % 8 of its warp's 16 and 16-byte chunk 2k + l/16 of k-pair k; the swizzle
  // repeats with k % 4, and k ≥ 4 lands in the second 64-column half.
  uint32_t staging_offset[4];  // bytes from the stage's start
  const int staging_row = consumer * 64 + warp * 16 + ((lane / 8) % 2) * 8 + lane % 8;
#pragma unroll
  for (int k = 0; k < 4; ++k) staging_offset[k] = 2 * sw128_offset(kTileRows, staging_row, 2 * k + lane / 16);
  // Operand descriptors: this warpgroup's Q rows in stage 0, the key block, the value block;
  // a stage, a 64-dim half and a k-step only move the start address.
  const uint64_t desc_q0 = ptx::make_sw128_kmajor_desc(q_stages + consumer * 64 * 64);
  const uint64_t desc_k0 = ptx::make_sw128_kmajor_desc(k_tile);
  const uint64_t desc_v0 = ptx::make_sw128_mnmajor_desc(v_tile, kTileRows * 128);
  uint32_t last_key = 0xffffffffu;
  int lists_seen = 0;
  ListKey key{};
  // Turns (config.h kConsumerTurns): a warpgroup waits for its turn before it issues a product and
  // hands the turn to the other once the product is committed. Warpgroup 1 hands warpgroup 0 the
  // first turn; warpgroup 0 takes the last hand-over after the loop, so both barriers end empty.
  if constexpr (kConsumerTurns) {
    if (consumer == 1) ptx::named_barrier_arrive(kTurnBarrier + (1 - consumer), 2 * 128);
  }

  int s = 0;  // t % stages
  uint32_t phase = 0;  // (t / stages) & 1
  for (int t = 0;; ++t) {
    ptx::mbarrier_wait(&q_full[s], phase);
    const StageMeta& stage_meta = meta[s];
    const uint32_t key_value = stage_meta.key;
    const int count = stage_meta.count;
    if (count < 0) break;
    if (stage_meta.new_blocks) {
      // kv_full completes once per load of K, V and the proxy keys.
      ptx::mbarrier_wait(kv_full, lists_seen & 1);
      ++lists_seen;
    }
    if (key_value != last_key) {
      last_key = key_value;
      key = decode_list_key(key_value, args);
    }
    const int first_key = key.block * kBlockSize;
    // Keys past a row's query or past S exist only in the local block and the last block.
    const bool need_mask =
        stage_meta.token_row[0] < first_key + kBlockSize - 1 || first_key + kBlockSize > args.seqlen;
    const int valid_rows = count * M;
    Element* q_tile = q_stages + s * kTileElements;

    // ---- S = Q·Kᵀ (async) ---------------------------------------------------------------------
    // NOTES: both warpgroups always run their GEMMs, also when a short last tile leaves one of them
    // only padding rows: a wgmma under a branch the compiler cannot prove warpgroup-uniform is
    // serialised (ptxas C7518), which costs more than the rare wasted tile half.
    float score[64];
    if constexpr (kConsumerTurns) ptx::named_barrier_sync(kTurnBarrier + consumer, 2 * 128);
    ptx::wgmma_fence();
#pragma unroll
    for (int k_step = 0; k_step < kHeadDim / 16; ++k_step) {
      const uint32_t step_bytes = (k_step / 4) * kTileRows * 128 + (k_step % 4) * 32;  // half, then k
      const uint64_t desc_q = ptx::advance_desc(desc_q0, uint32_t(s) * kTileElements * 2 + step_bytes);
      Mma::run(score, desc_q, ptx::advance_desc(desc_k0, step_bytes), k_step > 0 ? 1u : 0u);
    }
    ptx::wgmma_commit_group();
    if constexpr (kConsumerTurns) ptx::named_barrier_arrive(kTurnBarrier + (1 - consumer), 2 * 128);

    // ---- proxy scores (mma.sync, under the wgmma), by one warpgroup per tile, alternating ---------
    const bool proxy_turn = (t & 1) == consumer;
    if (proxy_turn) {
      const Element* qp_tile = qp_stages + s * qp_stage_elements;
      float2* warp_stats = stats + (s * 4 + warp) * prows;
      for (int m_tile = 0; m_tile < (count + 15) / 16; ++m_tile) {
        float acc[4][4] = {};
#pragma unroll
        for (int k_step = 0; k_step < kHeadDim / 16; ++k_step) {
          uint32_t a[4];
          ptx::ldmatrix_x4(a, qp_tile + sw128_offset(prows, m_tile * 16 + lane % 16, k_step * 2 + lane / 16));
#pragma unroll
          for (int n_pair = 0; n_pair < 2; ++n_pair) {
            uint32_t b[4];
            ptx::ldmatrix_x4(b, kp_tile + sw128_offset(kTileRows, warp * 32 + n_pair * 16 + lane % 8 + (lane / 16) * 8,
                                                       k_step * 2 + (lane / 8) % 2));
            ptx::mma_16816<Element>(acc[2 * n_pair], a, b[0], b[1]);
            ptx::mma_16816<Element>(acc[2 * n_pair + 1], a, b[2], b[3]);
          }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m_tile * 16 + half * 8 + lane / 4;
          const float2 row_stats =
              proxy_row_stats(acc, half, first_key + warp * 32, stage_meta.token_row[row], need_mask,
                              args.seqlen, args.proxy_scale_log2, [](float x) { return exp2_approx(x); });
          if (lane % 4 == 0) warp_stats[row] = row_stats;
        }
      }
    }

    // ---- softmax over the block, then O = P·V (async) -----------------------------------------
    float out[64];
    float scaled_max[2] = {0.f, 0.f};
    float row_sum[2] = {0.f, 0.f};
    {
      ptx::wgmma_wait_group<0>();
      ptx::fence_accumulators(score);
      int query[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) query[half] = stage_meta.token_row[acc_token[half]];
      if (need_mask) {  // a separate pass under a uniform branch: most tiles skip it entirely
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int key_pos = first_key + 8 * j + 2 * (lane % 4) + e;
              if (key_pos > query[half] || key_pos >= args.seqlen) score[4 * j + 2 * half + e] = kNegInf;
            }
          }
        }
      }
      float row_max[2] = {kNegInf, kNegInf};
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          row_max[half] = fmaxf(row_max[half], fmaxf(score[4 * j + 2 * half], score[4 * j + 2 * half + 1]));
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        row_max[half] = quad_max(row_max[half]);
        scaled_max[half] = row_max[half] == kNegInf ? 0.f : row_max[half] * args.scale_log2;
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = score[4 * j + 2 * half + e];
            x = exp2_approx(fmaf(x, args.scale_log2, -scaled_max[half]));
            row_sum[half] += x;
          }
        }
      }
      uint32_t p_frag[8][4];
#pragma unroll
      for (int k_step = 0; k_step < 8; ++k_step) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          p_frag[k_step][r] = ptx::pack2<Element>(score[8 * k_step + 2 * r], score[8 * k_step + 2 * r + 1]);
        }
      }
      if constexpr (kConsumerTurns) ptx::named_barrier_sync(kTurnBarrier + consumer, 2 * 128);
      ptx::wgmma_fence();
#pragma unroll
      for (int k_step = 0; k_step < 8; ++k_step) {
        Mma::template run<1>(out, p_frag[k_step], ptx::advance_desc(desc_v0, k_step * 16 * 128),
                             k_step > 0 ? 1u : 0u);
      }
      ptx::wgmma_commit_group();
      if constexpr (kConsumerTurns) ptx::named_barrier_arrive(kTurnBarrier + (1 - consumer), 2 * 128);
#pragma unroll
      for (int half = 0; half < 2; ++half) row_sum[half] = quad_sum(row_sum[half]);
      ptx::wgmma_wait_group<0>();
      ptx::fence_accumulators(out);
    }

    // ---- epilogue: O / l through this warpgroup's Q rows, partial LSE --------------------------
    float inverse[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) inverse[half] = row_sum[half] > 0.f ? rcp_approx(row_sum[half]) : 0.f;
    const uint32_t tile_address = ptx::smem_address(q_tile);
#pragma unroll
    for (int k = 0; k < 8; ++k) {  // register r: rows half r % 2, columns 16k + 8·(r / 2) …
      uint32_t frag[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        frag[r] = ptx::pack2<Element>(out[8 * k + 2 * r] * inverse[r % 2], out[8 * k + 2 * r + 1] * inverse[r % 2]);
      }
      ptx::stmatrix_x4(tile_address + staging_offset[k % 4] + (k / 4) * kTileRows * 128, frag);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + half * 8;
      if (lane % 4 == 0 && row < valid_rows) {
        const uint64_t out_offset = uint64_t(stage_meta.out_offset[acc_token[half]]);  // a multiple of D
        const int64_t index = int64_t(out_offset / kHeadDim) + row % M;
        args.partial_lse[index] = (scaled_max[half] + log2_approx(row_sum[half])) * kLn2;
      }
    }
    ptx::named_barrier_sync(2 + consumer, 128);  // staged rows and (proxy turn) warp statistics

    // Proxy partial LSE of the tile's tokens.
    if (proxy_turn && wg_thread < count) {
      const float2* tile_stats = stats + s * 4 * prows;
      float total_max = kNegInf;
#pragma unroll
      for (int w = 0; w < 4; ++w) total_max = fmaxf(total_max, tile_stats[w * prows + wg_thread].x);
      float total_sum = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 stat = tile_stats[w * prows + wg_thread];
        if (stat.x != kNegInf) total_sum += stat.y * exp2_approx(stat.x - total_max);
      }
      const int64_t flat_row = int64_t(key.b) * args.seqlen + stage_meta.token_row[wg_thread] - args.chunk_first_row;
      args.partial_proxy_lse[(flat_row * args.num_proxy_heads + key.proxy_head) * args.top_k +
                             stage_meta.token_slot[wg_thread]] = (total_max + log2_approx(total_sum)) * kLn2;
    }

    // Rows r and r + 8 share their swizzle phase, so the staged chunk moves by 8 rows per store.
    const Element* staged = q_tile + sw128_offset(kTileRows, consumer * 64 + wg_thread / 16, wg_thread % 16);
    int64_t token_offset[8];  // read before the stores, which the compiler cannot prove disjoint from it
#pragma unroll
    for (int i = 0; i < 8; ++i) token_offset[i] = stage_meta.out_offset[store_token[i]];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (consumer * 64 + 8 * i + wg_thread / 16 < valid_rows) {
        Element* dst = args.partial_out + token_offset[i] + store_offset[i];
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(staged + i * 8 * 64);
      }
    }
    ptx::mbarrier_arrive(&q_empty[s]);
    if (++s == stages) {
      s = 0;
      phase ^= 1;
    }
  }
  if constexpr (kConsumerTurns) {
    if (consumer == 0) ptx::named_barrier_sync(kTurnBarrier + consumer, 2 * 128);
  }
}

}  // namespace flashmsa::kernels::forward
