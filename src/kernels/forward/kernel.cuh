// The sparse forward's tile kernel: one CTA walks the work tiles of one query chunk (persistent,
// strided over the schedule's tile list) and, per tile, attends ≤ 128 gathered query rows to the
// 128 keys of one KV block, writing a partial output and partial LSE per (row, head, slot), plus
// the proxy partial LSE per (row, slot).
//
// Comes before: schedule/kernel.cuh (tiles, entries). Comes after: forward/combine.cuh merges the
// partials into O, LSE and proxy_lse. Tile shape and shared memory: forward/config.h.
//
// Per tile (4 warps, each owning 32 query rows = two m16 MMA tiles):
//   gather     cp.async: Q rows (token-major, M heads per token), K block, proxy queries, and the
//              proxy key block into V's buffer (V is not needed yet).
//   proxy      each warp scores all proxy rows against 32 of the 128 proxy keys; per-warp row
//              (max, sum) in shared memory, merged into the proxy partial LSE.
//   mainloop   V is gathered behind the first S = Q·Kᵀ; two 64-key steps of online softmax, P kept
//              in registers as the A operand of P·V (mma.sync m16n8k16, fp32 accumulation).
//   epilogue   O / l staged through the warp's own Q rows, written as 256-byte rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/device_math.h"
#include "kernels/common/strided.h"
#include "kernels/common/ptx/warp_mma.h"
#include "kernels/forward/config.h"

namespace flashmsa::kernels::forward {

// (max, Σ exp2(x − max)) over the 32 proxy keys of one warp for row `half` of an m16n8k16
// accumulator quad (acc[n][2·half + e]: key first_key + 8n + 2·(lane % 4) + e), scores scaled by
// scale_log2 and masked to keys ≤ query and < seqlen when need_mask; exp2 is the exponential the
// caller uses.
template <typename Exp2>
__device__ __forceinline__ float2 proxy_row_stats(const float (&acc)[4][4], int half, int first_key, int query,
                                                  bool need_mask, int seqlen, float scale_log2, Exp2 exp2) {
  float score[8];
  float row_max = kNegInf;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key_pos = first_key + n * 8 + (threadIdx.x % 4) * 2 + e;
      float s = acc[n][half * 2 + e] * scale_log2;
      if (need_mask && (key_pos > query || key_pos >= seqlen)) s = kNegInf;
      score[n * 2 + e] = s;
      row_max = fmaxf(row_max, s);
    }
  }
  row_max = quad_max(row_max);
  const float base = row_max == kNegInf ? 0.f : row_max;
  float row_sum = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) row_sum += exp2(score[e] - base);
  return make_float2(row_max, quad_sum(row_sum));
}

template <typename Element>
struct TileArgs {
  Strided<const Element> q, k, v, q_proxy, k_proxy;
  const uint4* tiles;               // schedule tiles {key, first entry, count, 0}
  const uint32_t* tile_offsets;     // [num_keys + 1]
  const uint32_t* entries[2];       // sorted packed entries, double buffer
  const int32_t* header;            // [0]: which entry buffer is current
  int64_t first_key;                // this chunk's keys: [first_key, first_key + keys_per_chunk)
  int64_t keys_per_chunk;
  int64_t segment_keys;             // keys of one segment (chunk, b, g): schedule::keys_per_segment
  int64_t chunk_first_row;          // flattened b · S + i of the chunk's first row
  uint32_t* tile_counters;          // this chunk's counters of tiles dealt on demand, one per
                                    // segment (pipelined kernel)
  Element* partial_out;             // [chunk_rows, Hp, K, M, D] (config.h partial_index)
  float* partial_lse;               // [chunk_rows, Hp, K, M]
  float* partial_proxy_lse;         // [chunk_rows, Hp, K]
  int seqlen;
  int num_blocks;
  int batch, num_heads, num_kv_heads, num_proxy_heads;
  int heads_per_proxy;     // M
  int proxy_heads_per_kv;  // Rg = Hp / Hkv
  int proxy_ratio;         // R = Hp / Hpk
  int top_k;
  int tokens_per_tile;
  int proxy_rows;          // tokens_per_tile rounded up to 16
  float scale_log2;        // σ · log2(e)
  float proxy_scale_log2;  // σp · log2(e)
};

// Element offset of (row, 16-byte chunk) in a 128-wide 16-bit tile; the chunk index is XOR-ed with
// row % 8 so ldmatrix on 8 consecutive rows touches 8 different bank groups.
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}


// Issues the cp.async copies of a 128 × 128 key block (rows ≥ S are zero-filled).
template <typename Element>
__device__ __forceinline__ void gather_block(Element* tile, const Strided<const Element>& source,
                                             int b, int first_key, int head, int seqlen) {
  for (int index = threadIdx.x; index < kTileRows * 16; index += kThreads) {
    const int row = index >> 4;
    const int chunk = index & 15;
    const int key = first_key + row;
    const bool valid = key < seqlen;
    const Element* src = valid ? source.row(b, key, head) + chunk * 8 : source.ptr;
    ptx::cp_async_16(tile + swizzle(row, chunk), src, valid);
  }
}

template <typename Element>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    sparse_forward_tiles(const TileArgs<Element> args) {
  extern __shared__ __align__(128) unsigned char smem[];
  Element* q_tile = reinterpret_cast<Element*>(smem);                       // (128 rows, D)
  Element* k_tile = q_tile + kTileRows * kHeadDim;                          // (128 keys, D)
  Element* v_tile = k_tile + kTileRows * kHeadDim;                          // (128 keys, D)
  Element* qp_tile = v_tile + kTileRows * kHeadDim;                         // (proxy_rows, Di)
  int32_t* token_row = reinterpret_cast<int32_t*>(qp_tile + args.proxy_rows * kHeadDim);  // (128)
  int32_t* token_slot = token_row + kTileRows;                                             // (128)
  float2* proxy_stats = reinterpret_cast<float2*>(token_slot + kTileRows);  // (warps, proxy_rows)

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int M = args.heads_per_proxy;
  const int tile_rows = args.tokens_per_tile * M;
  const uint32_t* entries = args.header[0] == 1 ? args.entries[1] : args.entries[0];
  const uint32_t tile_begin = args.tile_offsets[args.first_key];
  const uint32_t tile_end = args.tile_offsets[args.first_key + args.keys_per_chunk];

  for (uint32_t tile_index = tile_begin + blockIdx.x; tile_index < tile_end;
       tile_index += gridDim.x) {
    // ---- tile scheduler: decode the list key and the tile's entries -------------------------
    const uint4 tile = args.tiles[tile_index];
    uint32_t key = tile.x;
    const int proxy_local = int(key % uint32_t(args.proxy_heads_per_kv));
    key /= uint32_t(args.proxy_heads_per_kv);
    const int block = int(key % uint32_t(args.num_blocks));
    key /= uint32_t(args.num_blocks);
    const int kv_head = int(key % uint32_t(args.num_kv_heads));
    key /= uint32_t(args.num_kv_heads);
    const int b = int(key % uint32_t(args.batch));
    const int proxy_head = kv_head * args.proxy_heads_per_kv + proxy_local;
    const int proxy_kv_head = proxy_head / args.proxy_ratio;
    const int count = int(tile.z);
    const int first_key = block * kBlockSize;

    if (threadIdx.x < kTileRows) {
      int32_t row = int32_t(first_key + kBlockSize - 1);  // padding tokens: never masked out
      int32_t slot = 0;
      if (int(threadIdx.x) < count) {
        const uint32_t entry = entries[tile.y + threadIdx.x];
        row = int32_t(entry >> schedule::kSlotBits);
        slot = int32_t(entry & ((1u << schedule::kSlotBits) - 1));
      }
      token_row[threadIdx.x] = row;
      token_slot[threadIdx.x] = slot;
    }
    __syncthreads();

    // ---- gather: Q rows, K block, proxy queries, proxy keys (into V's buffer) ----------------
    for (int index = threadIdx.x; index < kTileRows * 16; index += kThreads) {
      const int row = index >> 4;
      const int chunk = index & 15;
      const int token = row / M;
      const bool valid = row < tile_rows && token < count;
      const Element* src =
          valid ? args.q.row(b, token_row[token], proxy_head * M + row % M) + chunk * 8 : args.q.ptr;
      ptx::cp_async_16(q_tile + swizzle(row, chunk), src, valid);
    }
    gather_block(k_tile, args.k, b, first_key, kv_head, args.seqlen);
    for (int index = threadIdx.x; index < args.proxy_rows * 16; index += kThreads) {
      const int row = index >> 4;
      const int chunk = index & 15;
      const bool valid = row < count;
      const Element* src =
          valid ? args.q_proxy.row(b, token_row[row], proxy_head) + chunk * 8 : args.q_proxy.ptr;
      ptx::cp_async_16(qp_tile + swizzle(row, chunk), src, valid);
    }
    gather_block(v_tile, args.k_proxy, b, first_key, proxy_kv_head, args.seqlen);
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncthreads();

    // Keys past a row's query or past S need masks only in the local block and the last block.
    const bool need_mask = token_row[0] < first_key + kBlockSize - 1 || first_key + kBlockSize > args.seqlen;

    // ---- proxy: per-warp statistics over keys [32·warp, 32·warp + 32) ------------------------
    for (int m_tile = 0; m_tile < args.proxy_rows / 16; ++m_tile) {
      float acc[4][4] = {};
#pragma unroll
      for (int k_step = 0; k_step < kHeadDim / 16; ++k_step) {
        uint32_t a[4];
        ptx::ldmatrix_x4(a, qp_tile + swizzle(m_tile * 16 + lane % 16, k_step * 2 + lane / 16));
#pragma unroll
        for (int n_pair = 0; n_pair < 2; ++n_pair) {
          uint32_t bfrag[4];
          ptx::ldmatrix_x4(bfrag, v_tile + swizzle(warp * 32 + n_pair * 16 + lane % 8 + (lane / 16) * 8,
                                                   k_step * 2 + (lane / 8) % 2));
          ptx::mma_16816<Element>(acc[n_pair * 2], a, bfrag[0], bfrag[1]);
          ptx::mma_16816<Element>(acc[n_pair * 2 + 1], a, bfrag[2], bfrag[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = m_tile * 16 + half * 8 + lane / 4;
        const float2 stats = proxy_row_stats(acc, half, first_key + warp * 32, token_row[row],
                                             need_mask, args.seqlen, args.proxy_scale_log2,
                                             [](float x) { return exp2f(x); });
        if (lane % 4 == 0) proxy_stats[warp * args.proxy_rows + row] = stats;
      }
    }
    __syncthreads();  // proxy keys consumed: V's buffer is free

    gather_block(v_tile, args.v, b, first_key, kv_head, args.seqlen);
    ptx::cp_async_commit();

    if (int(threadIdx.x) < count) {
      float total_max = kNegInf;
      for (int w = 0; w < kWarps; ++w) total_max = fmaxf(total_max, proxy_stats[w * args.proxy_rows + threadIdx.x].x);
      float total = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float2 stat = proxy_stats[w * args.proxy_rows + threadIdx.x];
        if (stat.x != kNegInf) total += stat.y * exp2f(stat.x - total_max);
      }
      const int64_t flat_row = int64_t(b) * args.seqlen + token_row[threadIdx.x] - args.chunk_first_row;
      args.partial_proxy_lse[(flat_row * args.num_proxy_heads + proxy_head) * args.top_k +
                             token_slot[threadIdx.x]] = (total_max + log2f(total)) * kLn2;
    }

    // ---- mainloop: two 64-key steps of online softmax ----------------------------------------
    int row_query[2][2];
#pragma unroll
    for (int m_tile = 0; m_tile < 2; ++m_tile) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp * kRowsPerWarp + m_tile * 16 + half * 8 + lane / 4;
        row_query[m_tile][half] = token_row[min(row / M, kTileRows - 1)];
      }
    }
    float out_acc[2][kHeadDim / 8][4] = {};
    float row_max[2][2] = {{kNegInf, kNegInf}, {kNegInf, kNegInf}};
    float row_sum[2][2] = {};

#pragma unroll 1
    for (int key_step = 0; key_step < kBlockSize / kKeyChunk; ++key_step) {
      float score[2][kKeyChunk / 8][4] = {};
#pragma unroll
      for (int k_step = 0; k_step < kHeadDim / 16; ++k_step) {
        uint32_t a[2][4];
#pragma unroll
        for (int m_tile = 0; m_tile < 2; ++m_tile) {
          ptx::ldmatrix_x4(a[m_tile], q_tile + swizzle(warp * kRowsPerWarp + m_tile * 16 + lane % 16,
                                                       k_step * 2 + lane / 16));
        }
#pragma unroll
        for (int n_pair = 0; n_pair < kKeyChunk / 16; ++n_pair) {
          uint32_t bfrag[4];
          ptx::ldmatrix_x4(bfrag, k_tile + swizzle(key_step * kKeyChunk + n_pair * 16 + lane % 8 +
                                                       (lane / 16) * 8,
                                                   k_step * 2 + (lane / 8) % 2));
#pragma unroll
          for (int m_tile = 0; m_tile < 2; ++m_tile) {
            ptx::mma_16816<Element>(score[m_tile][n_pair * 2], a[m_tile], bfrag[0], bfrag[1]);
            ptx::mma_16816<Element>(score[m_tile][n_pair * 2 + 1], a[m_tile], bfrag[2], bfrag[3]);
          }
        }
      }

      // Online softmax in the log2 domain; P packed to 16 bits as the A operand of P·V.
      uint32_t p_frag[2][kKeyChunk / 16][4];
#pragma unroll
      for (int m_tile = 0; m_tile < 2; ++m_tile) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float step_max = kNegInf;
#pragma unroll
          for (int n = 0; n < kKeyChunk / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float s = score[m_tile][n][half * 2 + e] * args.scale_log2;
              if (need_mask) {
                const int key_pos = first_key + key_step * kKeyChunk + n * 8 + (lane % 4) * 2 + e;
                if (key_pos > row_query[m_tile][half] || key_pos >= args.seqlen) s = kNegInf;
              }
              score[m_tile][n][half * 2 + e] = s;
              step_max = fmaxf(step_max, s);
            }
          }
          const float correction = online_softmax_step(score[m_tile], half, quad_max(step_max), row_max[m_tile][half],
                                                           row_sum[m_tile][half]);
#pragma unroll
          for (int d = 0; d < kHeadDim / 8; ++d) {
            out_acc[m_tile][d][half * 2] *= correction;
            out_acc[m_tile][d][half * 2 + 1] *= correction;
          }
        }
#pragma unroll
        for (int k_step = 0; k_step < kKeyChunk / 16; ++k_step) {
          const float* lo = score[m_tile][2 * k_step];
          const float* hi = score[m_tile][2 * k_step + 1];
          p_frag[m_tile][k_step][0] = ptx::pack2<Element>(lo[0], lo[1]);
          p_frag[m_tile][k_step][1] = ptx::pack2<Element>(lo[2], lo[3]);
          p_frag[m_tile][k_step][2] = ptx::pack2<Element>(hi[0], hi[1]);
          p_frag[m_tile][k_step][3] = ptx::pack2<Element>(hi[2], hi[3]);
        }
      }

      if (key_step == 0) {
        ptx::cp_async_wait<0>();
        __syncthreads();  // V landed for every thread's copies
      }

#pragma unroll
      for (int k_step = 0; k_step < kKeyChunk / 16; ++k_step) {
#pragma unroll
        for (int d_pair = 0; d_pair < kHeadDim / 16; ++d_pair) {
          uint32_t bfrag[4];
          ptx::ldmatrix_x4_trans(bfrag, v_tile + swizzle(key_step * kKeyChunk + k_step * 16 + lane % 8 +
                                                             ((lane / 8) % 2) * 8,
                                                         d_pair * 2 + lane / 16));
#pragma unroll
          for (int m_tile = 0; m_tile < 2; ++m_tile) {
            ptx::mma_16816<Element>(out_acc[m_tile][d_pair * 2], p_frag[m_tile][k_step], bfrag[0], bfrag[1]);
            ptx::mma_16816<Element>(out_acc[m_tile][d_pair * 2 + 1], p_frag[m_tile][k_step], bfrag[2],
                                    bfrag[3]);
          }
        }
      }
    }

    // ---- epilogue: normalise, stage in the warp's own Q rows, write 256-byte rows ------------
    __syncwarp();
#pragma unroll
    for (int m_tile = 0; m_tile < 2; ++m_tile) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float sum = quad_sum(row_sum[m_tile][half]);
        const float inverse = sum > 0.f ? 1.f / sum : 0.f;
        const int row = warp * kRowsPerWarp + m_tile * 16 + half * 8 + lane / 4;
#pragma unroll
        for (int d = 0; d < kHeadDim / 8; ++d) {
          *reinterpret_cast<uint32_t*>(q_tile + swizzle(row, d) + (lane % 4) * 2) =
              ptx::pack2<Element>(out_acc[m_tile][d][half * 2] * inverse,
                                  out_acc[m_tile][d][half * 2 + 1] * inverse);
        }
        const int token = row / M;
        if (lane % 4 == 0 && row < tile_rows && token < count) {
          const int64_t flat_row = int64_t(b) * args.seqlen + token_row[token] - args.chunk_first_row;
          args.partial_lse[partial_index(flat_row, proxy_head, token_slot[token], row % M,
                                         args.num_proxy_heads, args.top_k, M)] =
              (row_max[m_tile][half] + log2f(sum)) * kLn2;
        }
      }
    }
    __syncwarp();
#pragma unroll 4
    for (int index = lane; index < kRowsPerWarp * 16; index += 32) {
      const int row = warp * kRowsPerWarp + (index >> 4);
      const int chunk = index & 15;
      const int token = row / M;
      if (row < tile_rows && token < count) {
        const int64_t flat_row = int64_t(b) * args.seqlen + token_row[token] - args.chunk_first_row;
        Element* dst = args.partial_out +
                       partial_index(flat_row, proxy_head, token_slot[token], row % M, args.num_proxy_heads,
                                     args.top_k, M) * kHeadDim +
                       chunk * 8;
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(q_tile + swizzle(row, chunk));
      }
    }
    __syncthreads();  // shared memory is reused by the next tile
  }
}

}  // namespace flashmsa::kernels::forward
