// The sparse forward's tile kernel on Hopper tensor cores: warp-specialised, wgmma, two-stage
// pipelined gathers. Same work tiles, same partial outputs as kernel.cuh (which remains the path
// for M = H/Hp = 1, whose 128 proxy rows per tile do not fit this kernel's shared memory).
//
// Comes before: schedule/kernel.cuh (tiles, entries). Comes after: forward/combine.cuh. Shared
// memory layout: forward/config.h (PipelinedLayout).
//
// Roles (3 warpgroups, one CTA per SM, each CTA owns a contiguous range of the chunk's tiles, so
// consecutive tiles usually share their key block and K, V, k_proxy are loaded once per list):
//   producer   warpgroup 0. Per tile: writes the tile's (row, slot) list to the stage's metadata
//              and issues cp.async gathers of the Q rows (token-major, the M heads of a token
//              adjacent) and the proxy query rows into stage t % stages (3 stages where shared
//              memory allows); it never waits for its copies: each thread's copies arrive on the
//              stage's barrier when they land (cp.async.mbarrier.arrive.noinc). When the list key
//              changes it first waits for the previous tile to finish, then loads K, V and the
//              proxy keys. Tile descriptors are read two tiles ahead, entries one tile ahead.
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
// map work, and keys past S are zero-filled. Consumers fence the async proxy after the stage's
// barrier, since wgmma reads shared memory through the async proxy and cp.async writes it
// through the generic one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/ptx/barrier.h"
#include "kernels/common/ptx/warp_mma.h"
#include "kernels/common/ptx/wgmma.h"
#include "kernels/forward/kernel.cuh"

namespace flashmsa::kernels::forward {

// Per-stage metadata written by the producer and read by the consumers.
struct StageMeta {
  int64_t q_offset[kPipelinedMaxTokens];    // element offset in q of (b, token, first head of the group)
  int64_t out_offset[kPipelinedMaxTokens];  // element offset in the partials of (token, first head, slot)
  int32_t token_row[kPipelinedMaxTokens];   // query position of each token (padding: never masked)
  int32_t token_slot[kPipelinedMaxTokens];  // slot of the block in that token's block_idx row
  uint32_t key;                   // the schedule's list key (b, g, c, proxy head)
  int32_t count;                  // tokens in the tile
  int32_t unused[2];
};
static_assert(sizeof(StageMeta) == kStageMetaBytes, "forward/config.h sizes the metadata stages");

// Element offset of (row, 16-byte chunk) in a 128-dim tile stored as two 64-dim halves of
// `rows_per_half` rows of 128 bytes, with the 128-byte swizzle.
__device__ __forceinline__ int sw128_offset(int rows_per_half, int row, int chunk) {
  return (chunk >> 3) * rows_per_half * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
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

template <typename Element>
__global__ void __launch_bounds__(kPipelinedThreads, 1)
    sparse_forward_pipelined(const TileArgs<Element> args, const PipelinedLayout layout) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (ptx::smem_address(smem_raw) & 1023)) & 1023);
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

  const int M = args.heads_per_proxy;
  const uint32_t* entries = args.header[0] == 1 ? args.entries[1] : args.entries[0];
  const uint32_t begin = args.tile_offsets[args.first_key];
  const uint32_t total = args.tile_offsets[args.first_key + args.keys_per_chunk] - begin;
  const uint32_t lo = begin + uint32_t(uint64_t(total) * blockIdx.x / gridDim.x);
  const int num_tiles = int(begin + uint32_t(uint64_t(total) * (blockIdx.x + 1) / gridDim.x) - lo);
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    // ===================================== producer =====================================
    ptx::warpgroup_registers_decrease<kPipelinedProducerRegisters>();
    const int thread = threadIdx.x;
    const int chunk = thread & 15;         // this thread copies 16-byte chunk `chunk` …
    const int first_row = thread >> 4;     // … of rows first_row + 8·i
    const int tile_rows = args.tokens_per_tile * M;
    uint32_t last_key = 0xffffffffu;
    // Descriptors run two tiles ahead, entries one tile ahead of the copies.
    uint4 tile = make_uint4(0, 0, 0, 0);
    uint4 next_tile = make_uint4(0, 0, 0, 0);
    uint32_t entry = 0;
    if (num_tiles > 0) {
      tile = args.tiles[lo];
      if (thread < int(tile.z)) entry = entries[tile.y + thread];
    }
    if (num_tiles > 1) next_tile = args.tiles[lo + 1];
    // The stage's copies are released to the consumers one tile late: after the next tile's copies
    // are issued, the thread waits for the previous group, fences the async proxy (wgmma reads
    // through it what cp.async wrote through the generic proxy) and arrives.
    int pending = -1;
    bool pending_new_list = false;
    auto release_pending = [&]() {
      ptx::fence_proxy_async_shared();
      if (pending_new_list) ptx::mbarrier_arrive(kv_full);
      ptx::mbarrier_arrive(&q_full[pending % stages]);
      pending = -1;
    };
    const int64_t head_step = 8 * args.q.head_stride;  // rows r and r + 8 of one token
    for (int t = 0; t < num_tiles; ++t) {
      const int s = t % stages;
      const uint32_t key_value = tile.x;
      const ListKey key = decode_list_key(key_value, args);
      const int count = int(tile.z);
      const int first_key = key.block * kBlockSize;
      const bool new_list = key_value != last_key;
      ptx::mbarrier_wait(&q_empty[s], ((t / stages) & 1) ^ 1);
      if (new_list && t > 0) {
        // K, V and the proxy keys are overwritten only after the previous tile is done.
        if (pending >= 0) {
          ptx::cp_async_wait<0>();
          release_pending();
        }
        ptx::mbarrier_wait(&q_empty[(t - 1) % stages], ((t - 1) / stages) & 1);
      }

      StageMeta& stage_meta = meta[s];
      if (thread < kPipelinedMaxTokens) {
        const bool has_entry = thread < count;
        const int32_t row = has_entry ? int32_t(entry >> schedule::kSlotBits) : int32_t(first_key + kBlockSize - 1);
        const int32_t slot = has_entry ? int32_t(entry & ((1u << schedule::kSlotBits) - 1)) : 0;
        const int64_t flat_row = int64_t(key.b) * args.seqlen + row - args.chunk_first_row;
        stage_meta.token_row[thread] = row;
        stage_meta.token_slot[thread] = slot;
        stage_meta.q_offset[thread] = int64_t(key.b) * args.q.batch_stride + int64_t(row) * args.q.seq_stride +
                                      int64_t(key.proxy_head) * M * args.q.head_stride;
        stage_meta.out_offset[thread] =
            ((flat_row * args.num_heads + int64_t(key.proxy_head) * M) * args.top_k + slot) * kHeadDim;
        if (thread == 0) {
          stage_meta.key = key_value;
          stage_meta.count = count;
        }
      }
      ptx::named_barrier_sync(4, kPipelinedProducerThreads);

      if (new_list) {
        load_key_block(k_tile, args.k, key.b, first_key, key.kv_head, args.seqlen, thread);
        load_key_block(v_tile, args.v, key.b, first_key, key.kv_head, args.seqlen, thread);
        load_key_block(kp_tile, args.k_proxy, key.b, first_key, key.proxy_head / args.proxy_ratio,
                       args.seqlen, thread);
      }
      // Rows first_row + 8·i: the destination advances by 8 rows (1024 bytes, same swizzle phase);
      // the source by 8 heads inside a token, or restarts at the next token's offset.
      {
        Element* dst = q_stages + s * kTileElements + sw128_offset(kTileRows, first_row, chunk);
        const int valid_rows = min(count * M, tile_rows);
        int token = first_row / M;
        int head = first_row % M;
        const Element* src = args.q.ptr + stage_meta.q_offset[token] + head * args.q.head_stride + chunk * 8;
#pragma unroll 4
        for (int row = first_row; row < kTileRows; row += 8) {
          const bool valid = row < valid_rows;
          ptx::cp_async_16(dst, valid ? src : args.q.ptr, valid);
          dst += 8 * 64;
          head += 8;
          if (head < M) {
            src += head_step;
          } else {
            while (head >= M) {
              head -= M;
              ++token;
            }
            src = args.q.ptr + stage_meta.q_offset[min(token, kPipelinedMaxTokens - 1)] + head * args.q.head_stride +
                  chunk * 8;
          }
        }
      }
      Element* qp_dst = qp_stages + s * qp_stage_elements;
      for (int row = first_row; row < prows; row += 8) {
        const bool valid = row < count;
        const Element* src =
            valid ? args.q_proxy.row(key.b, stage_meta.token_row[row], key.proxy_head) + chunk * 8 : args.q_proxy.ptr;
        ptx::cp_async_16(qp_dst + sw128_offset(prows, row, chunk), src, valid);
      }
      ptx::cp_async_commit();
      if (pending >= 0) {
        ptx::cp_async_wait<1>();
        release_pending();
      }
      pending = t;
      pending_new_list = new_list;
      last_key = key_value;

      if (t + 1 < num_tiles) {
        tile = next_tile;
        entry = thread < int(tile.z) ? entries[tile.y + thread] : 0u;
        if (t + 2 < num_tiles) next_tile = args.tiles[lo + t + 2];
      }
    }
    if (pending >= 0) {
      ptx::cp_async_wait<0>();
      release_pending();
    }
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
  int store_offset[8];  // (head in the group) · K · D + this thread's 16-byte chunk
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = consumer * 64 + 8 * i + wg_thread / 16;
    store_token[i] = min(row / M, kPipelinedMaxTokens - 1);
    store_offset[i] = (row % M) * args.top_k * kHeadDim + (wg_thread % 16) * 8;
  }
  uint32_t last_key = 0xffffffffu;
  int lists_seen = 0;

  for (int t = 0; t < num_tiles; ++t) {
    const int s = t % stages;
    ptx::mbarrier_wait(&q_full[s], (t / stages) & 1);
    const StageMeta& stage_meta = meta[s];
    const uint32_t key_value = stage_meta.key;
    const int count = stage_meta.count;
    if (key_value != last_key) {
      ptx::mbarrier_wait(kv_full, lists_seen & 1);
      ++lists_seen;
      last_key = key_value;
    }
    const ListKey key = decode_list_key(key_value, args);
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
    ptx::wgmma_fence();
#pragma unroll
    for (int k_step = 0; k_step < kHeadDim / 16; ++k_step) {
      const int half = k_step / 4;
      const uint64_t desc_q = ptx::advance_desc(
          ptx::make_sw128_kmajor_desc(q_tile + half * kTileRows * 64 + consumer * 64 * 64), (k_step % 4) * 32);
      const uint64_t desc_k =
          ptx::advance_desc(ptx::make_sw128_kmajor_desc(k_tile + half * kTileRows * 64), (k_step % 4) * 32);
      Mma::run(score, desc_q, desc_k, k_step > 0 ? 1u : 0u);
    }
    ptx::wgmma_commit_group();

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
      ptx::wgmma_fence();
#pragma unroll
      for (int k_step = 0; k_step < 8; ++k_step) {
        const uint64_t desc_v = ptx::make_sw128_mnmajor_desc(v_tile + k_step * 16 * 64, kTileRows * 128);
        Mma::template run<1>(out, p_frag[k_step], desc_v, k_step > 0 ? 1u : 0u);
      }
      ptx::wgmma_commit_group();
#pragma unroll
      for (int half = 0; half < 2; ++half) row_sum[half] = quad_sum(row_sum[half]);
      ptx::wgmma_wait_group<0>();
      ptx::fence_accumulators(out);
    }

    // ---- epilogue: O / l through this warpgroup's Q rows, partial LSE --------------------------
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + half * 8;
      const float inverse = row_sum[half] > 0.f ? 1.f / row_sum[half] : 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<uint32_t*>(q_tile + sw128_offset(kTileRows, row, j) + (lane % 4) * 2) =
            ptx::pack2<Element>(out[4 * j + 2 * half] * inverse, out[4 * j + 2 * half + 1] * inverse);
      }
      if (lane % 4 == 0 && row < valid_rows) {
        const int64_t index = stage_meta.out_offset[acc_token[half]] / kHeadDim + int64_t(row % M) * args.top_k;
        args.partial_lse[index] = (scaled_max[half] + log2f(row_sum[half])) * kLn2;
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
        if (stat.x != kNegInf) total_sum += stat.y * exp2f(stat.x - total_max);
      }
      const int64_t flat_row = int64_t(key.b) * args.seqlen + stage_meta.token_row[wg_thread] - args.chunk_first_row;
      args.partial_proxy_lse[(flat_row * args.num_proxy_heads + key.proxy_head) * args.top_k +
                             stage_meta.token_slot[wg_thread]] = (total_max + log2f(total_sum)) * kLn2;
    }

    // Rows r and r + 8 share their swizzle phase, so the staged chunk moves by 8 rows per store.
    const Element* staged = q_tile + sw128_offset(kTileRows, consumer * 64 + wg_thread / 16, wg_thread % 16);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (consumer * 64 + 8 * i + wg_thread / 16 < valid_rows) {
        Element* dst = args.partial_out + stage_meta.out_offset[store_token[i]] + store_offset[i];
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(staged + i * 8 * 64);
      }
    }
    ptx::mbarrier_arrive(&q_empty[s]);
  }
}

}  // namespace flashmsa::kernels::forward
