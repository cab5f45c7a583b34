// The sparse backward's tile kernel on Hopper tensor cores (SPEC.md §3-§4): warp-specialised,
// wgmma, pipelined gathers, KV-outer over the forward's schedule. Serves the non-deterministic mode
// for M = H/Hp ∈ {2, 4, 8, 16}; kernel.cuh keeps the general kernel (deterministic mode, other M).
//
// Comes after: schedule/kernel.cuh (tiles, entries), kernel.cuh's compute_delta. Comes before:
// kernel.cuh's finish kernels and reduce_kl. Shared memory layout: config.h (PipelinedLayout).
//
// Work. A CTA owns a contiguous range of each segment's tiles, all ranges of equal weight (one CTA
// per SM; a segment is the lists of one (chunk, b, g); schedule/deal.cuh). A tile (≤ ⌊128/M⌋ tokens
// of one list (chunk, b, g, c, p)) runs as steps of 64 gathered rows: 4·⌊16/M⌋ tokens × M heads.
// The rows are permuted so that accumulator column n = 8j + 2(l % 4) + e (PTX "wgmma 64N16 D")
// holds token (l % 4)·⌊16/M⌋ + (2j + e)/M, head (2j + e) % M: the M heads of a token are the
// columns of one thread, so the KL teacher (the mean over the M heads) is a sum in registers.
//
// Roles (3 warpgroups):
//   producer   warpgroup 0. Per step: writes the step's tokens, slots, LSE, Δ and proxy LSE to the
//              stage's metadata and issues cp.async gathers of Q, dO (64 rows) and q_proxy (the
//              proxy rows in the same column order); a step is released (async-proxy fence, then
//              the stage barrier) when its copies have landed, before the next step waits for a
//              free stage.
//              On a new list it waits for the previous step to finish and loads K, V and k_proxy.
//   consumers  warpgroups 1-2; warpgroup c owns keys [64c, 64c + 64) of the block:
//              Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ     wgmma m64n64k16, both from shared memory
//              proxy scores k_proxy·q̃ᵀ     wgmma m64nPk16 (P = 8, 16 or 32 proxy columns)
//              P, dS = P(dP − Δ)           in registers (transposed: keys × rows)
//              dV += Pᵀ·dO, dK += dSᵀ·Q    wgmma m64n128k16, P and dS from registers, dO and Q
//                                          MN-major; dK, dV stay in registers for the whole unit
//                                          (chunk, b, g, c) and are reduce-added when it ends
//              dQ = dS·K                   dS through shared memory; warpgroup c computes dims
//                                          [64c, 64c + 64), stages them (fp32) in the consumed
//                                          Q/dO stage; each step token's M rows are reduce-added
//                                          with one bulk operation (cp.reduce.async.bulk); with
//                                          three stages (pipelined_stages) the stage is released
//                                          once those reads are done at the end of the next step,
//                                          at once on a list's last step
//              KL                          t = mean of P over the M heads, π = exp(s̃σp − plse),
//                                          g = π − t stored per (token, slot) as a row of 128 keys
//                                          in the input dtype (args.proxy_grad), from which
//                                          proxy_grads.cuh computes dq_proxy and dk_proxy; KL terms
//                                          per (token, slot)
//
// Synchronisation between the consumer warpgroups: two named barriers per step, one after dS and
// the KL partials are written (both warpgroups read both), one after the dQ rows are staged. The
// second also orders the next step's dS and KL partial stores after this step's readers, which
// finish before it.
//
// The KL-only mode (below) keeps the proxy gradients in this kernel: g and the q_proxy rows are
// staged for flush_tokens tokens, then dk_proxy += g·q̃ (m64n128) and dq_proxyᵀ = k̃ᵀ·gᵀ (m64n64).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "flashmsa/api.h"
#include "kernels/backward/config.h"
#include "kernels/backward/mma.cuh"
#include "kernels/backward/proxy_grads.cuh"
#include "kernels/backward/schedule.cuh"
#include "kernels/common/device_cache.h"
#include "kernels/common/device_math.h"
#include "kernels/common/strided.h"
#include "kernels/common/ptx/barrier.h"
#include "kernels/common/ptx/tma.h"
#include "kernels/common/ptx/warp_mma.h"
#include "kernels/common/ptx/wgmma.h"
#include "kernels/forward/pipelined_kernel.cuh"
#include "kernels/schedule/deal.cuh"

namespace flashmsa::kernels::backward {

using forward::decode_list_key;
using forward::ListKey;
using forward::load_key_block;
using forward::set_shape_fields;
using forward::sw128_offset;

template <typename Element>
struct PipelinedArgs {
  Strided<const Element> q, k, v, q_proxy, k_proxy, dout;
  const float* lse;        // [b, h, s]
  const float* proxy_lse;  // [b, hp, s]
  const float* delta;      // [b, h, s]
  const float* dq_scale;   // [b, h, s]: the scaled fp16 dQ sums' row scales (bf16 inputs)
  const uint4* tiles;
  const uint32_t* tile_offsets;
  const uint32_t* entries[2];
  const int32_t* header;
  const uint32_t* entry_offsets;  // first entry of each list key
  int64_t key_begin;  // list keys [key_begin, num_keys): whole query chunks
  int64_t num_keys;
  int64_t segment_keys;   // list keys of one segment (chunk, b, g): schedule::keys_per_segment
  const uint32_t* tile_bounds;  // [segments, schedule::kMaxDealGrid + 1]: schedule/deal.cuh
  uint4* dealt;           // [tiles]: each CTA's tiles, CTA by CTA (written by the CTA itself)
  float* dq_accum;        // [b, s, h, d]
  float* dk_accum;        // [b, s, hkv, d]
  float* dv_accum;
  float* dq_proxy_accum;  // [b, s, hp, di]
  float* dk_proxy_accum;  // [b, s, hp, di]
  float* kl_partial;      // [b, hp, s, k]
  float* kl_rows;         // [b, hp, s]: per-token KL terms (KL-only dense mode)
  Element* proxy_grad;    // sparse mode: g = π − t, [entry − entry_offsets[key_begin]][kKeys]
  int64_t dense_lists;    // KL-only dense mode: lists of every (b, p), and of one
  int64_t dense_lists_per_bh;
  int dense_chunks;       // token chunks of kDenseChunkTokens
  int seqlen, num_blocks, batch;
  int num_heads, num_kv_heads, num_proxy_heads, proxy_heads_per_kv, proxy_ratio, top_k;
  float scale_log2, proxy_scale_log2;
  int with_kl;       // KL terms (value or gradient)
  int with_kl_grad;  // dq_proxy, dk_proxy
};

// ---------------------------------------------------------------------------------------------
// The KL-only dense schedule (warmup mode with the main branch elsewhere, e.g. cuDNN; the order of
// its lists in config.h). List L runs on CTA L % grid, so at any time the CTAs work on neighbouring
// lists of one token chunk and read its Q rows (M heads × 1024 tokens, 4 MB at M = 16) from L2.
// ---------------------------------------------------------------------------------------------
struct DenseList {
  ListKey key;
  int first_token, count;
};

template <typename Args>
__device__ __forceinline__ DenseList dense_list(int64_t list, const Args& args) {
  const DenseListPosition at = dense_list_position(list, args.dense_lists_per_bh, args.dense_chunks, args.seqlen);
  DenseList out;
  out.key.b = int(at.bh / args.num_proxy_heads);
  out.key.proxy_head = int(at.bh % args.num_proxy_heads);
  out.key.kv_head = out.key.proxy_head / args.proxy_heads_per_kv;
  out.key.block = at.block;
  out.key.unit = uint32_t(list);
  out.first_token = at.first_token;
  out.count = at.count;
  return out;
}

// This CTA's share [x, y) of the tiles of the segment whose first list key is `first`
// (schedule/deal.cuh).
template <typename Args>
__device__ __forceinline__ uint2 segment_slice(const Args& args, int64_t first) {
  const uint32_t* bounds =
      args.tile_bounds + (first / args.segment_keys) * (schedule::kMaxDealGrid + 1) + blockIdx.x;
  return make_uint2(bounds[0], bounds[1]);
}

// kKlOnly: the KL-only dense mode (warmup with the main branch elsewhere). Only Sᵀ (for the teacher),
// the proxy scores, g, the KL terms and the proxy gradients run; no dO, V, Δ, dQ, dK or dV. Its
// steps have 128 rows for M ≥ 4 (config.h step_rows: Q fills the stage's dO half); dk_proxy
// accumulates over the whole list in the registers of dK; dq_proxy is staged in the V tile and
// reduce-added in bulk; the named barriers run only where staged tokens are flushed, and the two
// consumer warpgroups take turns issuing Sᵀ.
template <typename Element, int kM, bool kKlOnly>
__global__ void __launch_bounds__(kPipelinedThreads, 1)
    backward_pipelined(const PipelinedArgs<Element> args, const PipelinedLayout layout) {
  constexpr int kRows = step_rows(kKlOnly, kM);  // gathered main rows per step
  constexpr int kT = step_tokens_per_quad(kM, kRows);
  constexpr int kStepTokens = step_tokens(kM, kRows);
  constexpr int kProxyCols = proxy_columns(kM, kRows);
  constexpr int kRowElements = kStepRows * kHeadDim;
  constexpr int kStageElements = int(pipelined_stage_bytes(kKlOnly, kM) / 2);
  constexpr int kFlush = flush_tokens(kKlOnly);  // tokens staged per proxy-gradient flush
  constexpr int kStages = pipelined_stages(kKlOnly, kM);
  constexpr int kProducerRegisters = kKlOnly ? kKlOnlyProducerRegisters : pipelined_producer_registers(kM);
  // bf16 inputs sum dQ in scaled fp16 (config.h, kDqScaleTarget); fp16 inputs, whose reference is
  // 8× tighter, in fp32.
  constexpr bool kDqHalf = !kKlOnly && std::is_same<Element, __nv_bfloat16>::value;
  using Mma128 = ptx::Wgmma64x128x16<Element>;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = ptx::align_shared_1024(smem_raw);
  Element* k_tile = reinterpret_cast<Element*>(smem + layout.k);
  Element* v_tile = reinterpret_cast<Element*>(smem + layout.v);
  Element* kp_tile = reinterpret_cast<Element*>(smem + layout.kp);
  // Stage s: Q at q_stages + s·kStageElements, dO and q_proxy after it (config.h).
  Element* q_stages = reinterpret_cast<Element*>(smem + layout.stage);
  Element* do_stages = q_stages + kRowElements;
  Element* qp_stages = q_stages + 2 * kRowElements;
  Element* ds_tile = reinterpret_cast<Element*>(smem + layout.ds);
  Element* g_tile = reinterpret_cast<Element*>(smem + layout.g);
  Element* qp_flush = reinterpret_cast<Element*>(smem + layout.qp_flush);
  StepMetaOf<kRows>* meta = reinterpret_cast<StepMetaOf<kRows>*>(smem + layout.meta);
  float* kl_parts = reinterpret_cast<float*>(smem + layout.kl);  // (warpgroup, warp, token)
  int32_t* flush_token = reinterpret_cast<int32_t*>(smem + layout.flush_token);
  int32_t* row_token = reinterpret_cast<int32_t*>(smem + layout.rows);  // step row -> token in step
  int32_t* row_head = row_token + kRows;                                  // step row -> head in group
  int32_t* proxy_row_tokens = row_head + kRows;                            // proxy row -> token in step
  uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + layout.barriers);
  uint64_t* q_full = barriers;
  uint64_t* q_empty = barriers + kStages;
  uint64_t* kv_full = barriers + 2 * kStages;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&q_full[s], kPipelinedProducerThreads);
      ptx::mbarrier_init(&q_empty[s], 2 * 128);
    }
    ptx::mbarrier_init(kv_full, kPipelinedProducerThreads);
    ptx::fence_barrier_init();
  }
  if (threadIdx.x < kRows) {
    row_token[threadIdx.x] = step_row_token(threadIdx.x, kM, kRows);
    row_head[threadIdx.x] = step_row_head(threadIdx.x, kM);
    if (threadIdx.x < kProxyRowsPerStage) proxy_row_tokens[threadIdx.x] = proxy_row_token(threadIdx.x, kM, kRows);
  } else if (kKlOnly && threadIdx.x >= 128) {
    // π − t of unused staged columns must be finite: they meet zero q_proxy rows.
    for (int i = threadIdx.x - 128; i < kKeys * 64 / 8; i += 256) {
      reinterpret_cast<uint4*>(g_tile)[i] = make_uint4(0, 0, 0, 0);
    }
  }
  __syncthreads();

  const uint32_t* entries = nullptr;
  uint32_t lo = 0;
  int num_tiles = 0;
  if constexpr (kKlOnly) {
    // A "tile" is one whole list of the dense schedule: lists blockIdx.x + t·gridDim.x.
    num_tiles = args.dense_lists > int64_t(blockIdx.x)
                    ? int((args.dense_lists - 1 - int64_t(blockIdx.x)) / gridDim.x + 1)
                    : 0;
  } else {
    entries = args.header[0] == 1 ? args.entries[1] : args.entries[0];
    // Dealing: every segment's tiles are split into gridDim.x contiguous ranges of equal weight
    // (deal_tile_bounds: list starts weigh extra), and a CTA walks its range of each segment in
    // turn, so at any time the CTAs work in one or two segments: the dQ rows they reduce into and
    // the Q, dO rows they gather are one KV group's of one query chunk (134 MB each at paper
    // 16K-row chunks) instead of every chunk's, and more of them hit L2. The CTA first copies its
    // ranges to its own run of `dealt`, which the producer then reads in order; the run starts
    // after those of CTAs 0 … x − 1, at Σ over segments of bounds[x] − the segment's first tile.
    for (int64_t first = args.key_begin; first < args.num_keys; first += args.segment_keys) {
      const uint2 slice = segment_slice(args, first);
      lo += slice.x - args.tile_offsets[first];
    }
    uint32_t at = lo;
    for (int64_t first = args.key_begin; first < args.num_keys; first += args.segment_keys) {
      const uint2 slice = segment_slice(args, first);
      for (uint32_t i = threadIdx.x; i < slice.y - slice.x; i += blockDim.x) args.dealt[at + i] = args.tiles[slice.x + i];
      at += slice.y - slice.x;
    }
    num_tiles = int(at - lo);
    __syncthreads();
  }
  const int warpgroup = ptx::warpgroup_index();

  if (warpgroup == 0) {
    // ===================================== producer =====================================
    ptx::warpgroup_registers_decrease<kProducerRegisters>();
    const int thread = threadIdx.x;
    // Sparse mode: the Q and dO rows a tile gathers leave L2 first, dQ's accumulator lines (the
    // fp16 sums' bulk reduce-adds, read and written by every tile that holds their row) last.
    // Measured at 128K paper (one H100): ≈ 1 ms of the backward's 69. The KL-only mode keeps the
    // normal policy.
    [[maybe_unused]] const uint64_t gather_policy = ptx::l2_policy_evict_first();
    const int chunk = thread & 15;
    const int first_row = thread >> 4;  // rows first_row + 8·i
    uint32_t last_key = 0xffffffffu;  // also the list whose K, V and k_proxy shared memory holds
    // Sparse mode: the lists of one unit may share K, V and k_proxy (forward::lists_share_blocks).
    const bool share_blocks = !kKlOnly && forward::lists_share_blocks(args);
    int pending = -1;
    bool pending_new_blocks = false;
    auto release_pending = [&]() {
      ptx::fence_proxy_async_shared();
      if (pending_new_blocks) ptx::mbarrier_arrive(kv_full);
      ptx::mbarrier_arrive(&q_full[pending % kStages]);
      pending = -1;
    };
    // Entries run one step ahead: thread i < 32 holds the entry of the step's token i, thread
    // n < 64 that of step row n's token; the LSE, Δ and proxy LSE loads are issued before the stage
    // is free and stored after the gathers are issued.
    auto load_entries = [&](const uint4& at_tile, int k, uint32_t* token_entry, uint32_t* row_entry) {
      const int count = min(kStepTokens, int(at_tile.z) - k * kStepTokens);
      const int local = thread < kRows ? row_token[thread] : kStepTokens;
      if constexpr (kKlOnly) {
        // Dense lists hold consecutive tokens from at_tile.y, all in slot 0.
        const uint32_t base = at_tile.y + uint32_t(k * kStepTokens);
        *token_entry = thread < count ? (base + uint32_t(thread)) << schedule::kSlotBits : 0xffffffffu;
        *row_entry = local < count ? (base + uint32_t(local)) << schedule::kSlotBits : 0xffffffffu;
      } else {
        const uint32_t* base = entries + at_tile.y + k * kStepTokens;
        *token_entry = thread < count ? base[thread] : 0xffffffffu;
        *row_entry = local < count ? base[local] : 0xffffffffu;
      }
    };
    // Tile t of this CTA: (list key, first entry, tokens); a dense list as (list, first token, tokens).
    auto tile_at = [&](int t) {
      if constexpr (kKlOnly) {
        const int64_t list = int64_t(blockIdx.x) + int64_t(t) * gridDim.x;
        const DenseList dense = dense_list(list, args);
        return make_uint4(uint32_t(list), uint32_t(dense.first_token), uint32_t(dense.count), 0u);
      } else {
        return args.dealt[lo + t];
      }
    };
    int step = 0;
    uint4 tile = num_tiles > 0 ? tile_at(0) : make_uint4(0, 0, 0, 0);
    uint32_t token_entry = 0xffffffffu;
    uint32_t row_entry = 0xffffffffu;
    if (num_tiles > 0) load_entries(tile, 0, &token_entry, &row_entry);
    ListKey key{};  // decoded once per list
    for (int t = 0; t < num_tiles; ++t) {
      const uint4 next_tile = t + 1 < num_tiles ? tile_at(t + 1) : make_uint4(0xffffffffu, 0, 0, 0);
      const uint32_t key_value = tile.x;
      if (key_value != last_key) {
        if constexpr (kKlOnly) {
          key = dense_list(int64_t(blockIdx.x) + int64_t(t) * gridDim.x, args).key;
        } else {
          key = decode_list_key(key_value, args);
        }
      }
      const int first_key = key.block * kBlockSize;
      const int tile_count = int(tile.z);
      const int steps = (tile_count + kStepTokens - 1) / kStepTokens;
      for (int k = 0; k < steps; ++k, ++step) {
        const int s = step % kStages;
        const bool new_list = key_value != last_key;
        // A new list of the unit whose K, V and k_proxy are loaded keeps them when its lists share
        // them: no drain, no reload.
        const bool new_blocks =
            new_list &&
            (step == 0 || !share_blocks || key.unit != last_key / uint32_t(args.proxy_heads_per_kv));
        const int count = min(kStepTokens, tile_count - k * kStepTokens);
        const int token = token_entry != 0xffffffffu ? int(token_entry >> schedule::kSlotBits) : -1;
        const int row_token_pos = row_entry != 0xffffffffu ? int(row_entry >> schedule::kSlotBits) : -1;
        float plse = __builtin_huge_valf();
        if (token >= 0 && args.with_kl) {
          plse = args.proxy_lse[(int64_t(key.b) * args.num_proxy_heads + key.proxy_head) * args.seqlen + token];
        }
        float lse = __builtin_huge_valf();
        float delta = 0.f;
        float dq_scale = 1.f;
        if (row_token_pos >= 0) {
          const int64_t at =
              (int64_t(key.b) * args.num_heads + key.proxy_head * kM + row_head[thread]) * args.seqlen + row_token_pos;
          lse = args.lse[at];
          if constexpr (!kKlOnly) delta = args.delta[at];
          if constexpr (kDqHalf) dq_scale = args.dq_scale[at];
        }
        // The previous step is released as soon as its copies land, before this step waits for its
        // stage: with two stages, waiting for the stage first would make the consumers wait for this
        // step's issue after every step.
        if (pending >= 0) {
          ptx::cp_async_wait<0>();
          release_pending();
        }
        ptx::mbarrier_wait(&q_empty[s], ((step / kStages) & 1) ^ 1);
        if (new_blocks && step > 0) {
          // K, V and k_proxy are overwritten only after the previous step is done.
          ptx::mbarrier_wait(&q_empty[(step - 1) % kStages], ((step - 1) / kStages) & 1);
        }
        StepMetaOf<kRows>& m = meta[s];
        if (thread < kMaxStepTokens) {
          m.token[thread] = token;
          m.slot[thread] = int(token_entry & ((1u << schedule::kSlotBits) - 1));
          if (thread == 0) {
            const bool tile_last = k + 1 == steps;
            const bool unit_last =
                tile_last && (next_tile.x == 0xffffffffu ||
                              next_tile.x / uint32_t(args.proxy_heads_per_kv) != key.unit);
            // Where lists share K, V and k_proxy, the last step before they are replaced (its stage
            // is released at once, so the producer's drain can complete).
            const bool list_last = share_blocks ? unit_last : tile_last && next_tile.x != key_value;
            m.key = key_value;
            m.first_entry = tile.y + uint32_t(k * kStepTokens);
            m.count = count;
            m.b = key.b;
            m.kv_head = key.kv_head;
            m.block = key.block;
            m.proxy_head = key.proxy_head;
            m.flags = (new_blocks ? kStepNewBlocks : 0) | (list_last ? kStepListLast : 0) |
                      (unit_last ? kStepUnitLast : 0) | (tile_last && t + 1 == num_tiles ? kStepLast : 0);
          }
        }
        ptx::named_barrier_sync(1, kPipelinedProducerThreads);
        if (new_blocks) {
          load_key_block<2>(k_tile, args.k, key.b, first_key, key.kv_head, args.seqlen, thread);
          if constexpr (!kKlOnly) {
            load_key_block<2>(v_tile, args.v, key.b, first_key, key.kv_head, args.seqlen, thread);
          }
          if (args.with_kl) {
            load_key_block<2>(kp_tile, args.k_proxy, key.b, first_key, key.proxy_head / args.proxy_ratio, args.seqlen,
                       thread);
          }
        }
        // Q and dO rows n = first_row + 8·i (same swizzle phase: the destination moves by 1024
        // bytes). In the permuted order (config.h) row n is token (first_row / 2)·T + 2i / M of the
        // step and head first_row % 2 + 2i % M of the group: the token and head offsets of a copy
        // are compile-time constants plus this thread's first token and head.
        {
          Element* q_dst = q_stages + s * kStageElements + sw128_offset(kRows, first_row, chunk);
          Element* do_dst = do_stages + s * kStageElements + sw128_offset(kStepRows, first_row, chunk);
          const int first_token = (first_row / 2) * kT;
          const int head = key.proxy_head * kM + first_row % 2;
          const Element* q_head = args.q.row(key.b, 0, head) + chunk * 8;
          const Element* do_head = args.dout.row(key.b, 0, head) + chunk * 8;
#pragma unroll
          for (int i = 0; i < kRows / 8; ++i) {
            static_assert(kM % 2 == 0, "rows 2i and 2i + 1 of a column pair share their token");
            const int local = first_token + 2 * i / kM;
            const bool valid = local < count;
            int64_t token;
            if constexpr (kKlOnly) {
              // A dense step's tokens are consecutive from the step's first (no metadata read).
              token = valid ? int64_t(tile.y) + int64_t(k) * kStepTokens + local : 0;
            } else {
              token = valid ? m.token[local] : 0;
            }
            const int64_t head_offset = int64_t(2 * i % kM);
            const Element* q_src = q_head + token * args.q.seq_stride + head_offset * args.q.head_stride;
            const Element* do_src = do_head + token * args.dout.seq_stride + head_offset * args.dout.head_stride;
            if constexpr (kKlOnly) {
              ptx::cp_async_16(q_dst + i * 8 * 64, q_src, valid);
            } else {
              ptx::cp_async_16(q_dst + i * 8 * 64, q_src, valid, gather_policy);
              ptx::cp_async_16(do_dst + i * 8 * 64, do_src, valid, gather_policy);
            }
          }
        }
        if (args.with_kl) {
          Element* qp_dst = qp_stages + s * kStageElements;
          for (int n = first_row; n < kProxyCols; n += 8) {
            const int local = proxy_row_tokens[n];
            const bool valid = local >= 0 && local < count;
            const Element* src = args.q_proxy.ptr;
            if constexpr (kKlOnly) {
              if (valid) src = args.q_proxy.row(key.b, int(tile.y) + k * kStepTokens + local, key.proxy_head) + chunk * 8;
            } else {
              src = valid ? args.q_proxy.row(key.b, m.token[local], key.proxy_head) + chunk * 8 : args.q_proxy.ptr;
            }
            ptx::cp_async_16(qp_dst + sw128_offset(kProxyCols, n, chunk), src, valid);
          }
        }
        if (thread < kMaxStepTokens) m.proxy_lse[thread] = plse * kLog2e;
        if (thread < kRows) {
          m.lse[thread] = lse * kLog2e;
          m.delta[thread] = delta;
          if constexpr (kDqHalf) m.dq_scale[thread] = dq_scale;
        }
        if (k + 1 < steps) {
          load_entries(tile, k + 1, &token_entry, &row_entry);
        } else if (t + 1 < num_tiles) {
          load_entries(next_tile, 0, &token_entry, &row_entry);
        }
        ptx::cp_async_commit();
        pending = step;
        pending_new_blocks = new_blocks;
        last_key = key_value;
      }
      tile = next_tile;
    }
    if (pending >= 0) {
      ptx::cp_async_wait<0>();
      release_pending();
    }
    return;
  }

  // ===================================== consumers =====================================
  ptx::warpgroup_registers_increase<consumer_registers_beside(kProducerRegisters)>();
  [[maybe_unused]] const uint64_t dq_policy = ptx::l2_policy_evict_last();  // see the producer's gather_policy
  const int consumer = warpgroup - 1;            // keys [64·consumer, 64·consumer + 64)
  const int wg_thread = threadIdx.x & 127;
  const int consumer_thread = threadIdx.x - 128;  // 0 … 255
  const int warp = wg_thread / 32;
  const int lane = threadIdx.x % 32;
  const int quad = lane % 4;
  const int key_row0 = consumer * 64 + warp * 16 + lane / 4;  // block rows key_row0, key_row0 + 8
  // Row 8·(lane / 16) + lane % 8, key chunk 2·warp + (lane / 8) % 2 of this warpgroup's dS half; the
  // swizzle phase is row % 8, so the 16-row k-steps move the address by 16 rows.
  const uint32_t ds_address = ptx::smem_address(
      ds_tile + consumer * kStepRows * 64 + sw128_offset(kStepRows, 8 * (lane / 16) + lane % 8, 2 * warp + (lane / 8) % 2));
  constexpr uint32_t kMidBarrier = 2;   // dS (KL-only: g, staged rows), KL partials written by both
  constexpr uint32_t kStepBarrier = 3;  // KL-only: both warpgroups done reading the last flush
  constexpr uint32_t kDqBarrier = 4;    // the step's dQ rows staged by both
  // KL-only, and the sparse mode with config.h kSparseConsumerTurns: the warpgroups take turns
  // issuing Sᵀ (warpgroup c waits on barrier kTurnBarrier + c, then lets the other go), so one's
  // product runs under the other's exponentials.
  constexpr bool kTurns = kKlOnly || kSparseConsumerTurns;
  constexpr uint32_t kTurnBarrier = 5;
  constexpr int kDqIssueLanes = (kStepTokens + 7) / 8;  // tokens per consumer warp, rounded up
  // Lanes that issue bulk reduce-adds: dQ of a step's tokens (sparse), dq_proxy of the staged ones.
  constexpr int kBulkIssueLanes = kKlOnly ? kFlush / 8 : kDqIssueLanes;
  // This thread's two accumulator rows (warp·16 + lane/4 + 8h) in the dQ staging.
  constexpr uint32_t kDqRowBytes = kDqHalf ? kDqStageRowBytes16 : kDqStageRowBytes;
  const uint32_t dq_row_offset[2] = {dq_stage_row_offset(warp * 16 + lane / 4, kM, kDqRowBytes),
                                     dq_stage_row_offset(warp * 16 + lane / 4 + 8, kM, kDqRowBytes)};

  // The accumulators are never zeroed: a unit's (KL-only: a list's) first product overwrites them
  // (scale-d 0), so no flush leaves a register copy behind.
  float dk[64];
  float dv[64];
  bool unit_fresh = true;  // dK, dV (KL-only: dk_proxy) hold nothing of the current unit (list) yet
  // acc (+)= (this warpgroup's 64 rows of a key tile) · rowsᵀ over the 128 dims: both operands
  // K-major, `rows_per_half` rows per 64-dim half of the row tile.
  auto key_gemm = [&](auto& acc, const Element* key_tile, const Element* row_tile, int rows_per_half) {
    constexpr int kN = int(sizeof(acc) / sizeof(float)) * 2;
#pragma unroll
    for (int k_step = 0; k_step < kHeadDim / 16; ++k_step) {
      const int half = k_step / 4;
      const uint32_t advance = (k_step % 4) * 32;
      const uint64_t desc_a = ptx::advance_desc(
          ptx::make_sw128_kmajor_desc(key_tile + half * kKeys * 64 + consumer * 64 * 64), advance);
      const uint64_t desc_b =
          ptx::advance_desc(ptx::make_sw128_kmajor_desc(row_tile + half * rows_per_half * 64), advance);
      ptx::WgmmaSS<Element, kN>::run(acc, desc_a, desc_b, k_step > 0 ? 1u : 0u);
    }
  };
  // dk_proxy[keys] += g·q̃ over the staged tokens: A = g (keys × tokens, K-major), B = the staged
  // q̃ rows (tokens × di, MN-major).
  auto dk_proxy_product = [&](float (&acc)[64], bool fresh) {
#pragma unroll
    for (int k_step = 0; k_step < kFlush / 16; ++k_step) {
      const uint64_t desc_g = ptx::advance_desc(ptx::make_sw128_kmajor_desc(g_tile + consumer * 64 * 64), k_step * 32);
      const uint64_t desc_qp = ptx::make_sw128_mnmajor_desc(qp_flush + k_step * 16 * 64, kFlush * 128);
      ptx::WgmmaSS<Element, 128, 0, 1>::run(acc, desc_g, desc_qp, k_step > 0 || !fresh ? 1u : 0u);
    }
  };
  // dq_proxyᵀ[dims] = k̃ᵀ·gᵀ: A = k̃ (di × keys, MN-major), B = g (keys × tokens, MN-major).
  auto dq_proxy_product = [&](float (&acc)[32]) {
#pragma unroll
    for (int k_step = 0; k_step < kKeys / 16; ++k_step) {
      const uint64_t desc_kp =
          ptx::make_sw128_mnmajor_desc(kp_tile + consumer * kKeys * 64 + k_step * 16 * 64, kKeys * 128);
      const uint64_t desc_g = ptx::make_sw128_mnmajor_desc(g_tile + k_step * 16 * 64, kKeys * 128);
      ptx::WgmmaSS<Element, 64, 1, 1>::run(acc, desc_kp, desc_g, k_step > 0 ? 1u : 0u);
    }
  };
  // The staged tokens' dq_proxy rows (accumulator columns < kFlush) as fp32 rows of
  // kDqProxyStageStride floats at `stage` (free of bank conflicts); then, after a fence and a barrier
  // of both warpgroups, one 512-byte bulk reduce-add per staged token, by lane t / 8 of consumer
  // warp t % 8.
  auto stage_dq_proxy = [&](const float (&acc)[32], float* stage) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int dim = consumer * 64 + warp * 16 + lane / 4 + 8 * h;
#pragma unroll
      for (int j = 0; j < kFlush / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) stage[(8 * j + 2 * quad + e) * kDqProxyStageStride + dim] = acc[4 * j + 2 * h + e];
      }
    }
  };
  auto reduce_add_dq_proxy = [&](const float* stage, const ListKey& key, int tokens) {
    if (lane < kFlush / 8) {
      const int column = (consumer * 4 + warp) + 8 * lane;
      const int token = column < tokens ? flush_token[column] : -1;
      if (token >= 0) {
        ptx::bulk_reduce_add_f32(args.dq_proxy_accum + ((int64_t(key.b) * args.seqlen + token) * args.num_proxy_heads +
                                                        key.proxy_head) * kHeadDim,
                                 stage + column * kDqProxyStageStride, kHeadDim * 4);
      }
      ptx::bulk_commit_group();
    }
  };
  // Sparse mode: the first entry of the launch's chunk, row 0 of args.proxy_grad.
  const uint32_t entry_base = !kKlOnly && args.with_kl_grad ? args.entry_offsets[args.key_begin] : 0u;
  int lists_seen = 0;
  int staged = 0;  // tokens of (π − t, q_proxy) staged for the proxy gradients
  int held_stage = -1;  // three stages: the previous step's stage, released at the end of this one
  bool flushed = false;  // KL-only: the previous step flushed the staged tokens
  // Warpgroup 0 takes the first turn; every later turn is handed over after an issue, except the
  // last one of warpgroup 1, so each barrier sees as many arrivals as waits.
  if (kTurns && consumer == 1 && num_tiles > 0) ptx::named_barrier_arrive(kTurnBarrier, 256);

  for (int step = 0;; ++step) {
    const int s = step % kStages;
    if (num_tiles == 0) break;
    ptx::mbarrier_wait(&q_full[s], (step / kStages) & 1);
    const StepMetaOf<kRows>& m = meta[s];
    const uint32_t key_value = m.key;
    const int count = m.count;
    const int flags = m.flags;
    if (flags & kStepNewBlocks) {
      // kv_full completes once per load of K, V and k_proxy.
      ptx::mbarrier_wait(kv_full, lists_seen & 1);
      ++lists_seen;
    }
    ListKey key;  // decoded by the producer
    key.b = m.b;
    key.kv_head = m.kv_head;
    key.block = m.block;
    key.proxy_head = m.proxy_head;
    const int first_key = key.block * kBlockSize;
    const bool need_mask = m.token[0] < first_key + kBlockSize - 1;
    const Element* q_tile = q_stages + s * kStageElements;
    const Element* do_tile = do_stages + s * kStageElements;
    const Element* qp_tile = qp_stages + s * kStageElements;

    // ---- Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, proxy scores (async) --------------------------------------------
    float score[kRows / 2];
    float dprob[32];
    float proxy[kProxyCols / 2];
    if constexpr (kTurns) ptx::named_barrier_sync(kTurnBarrier + consumer, 256);
    ptx::wgmma_fence();
    key_gemm(score, k_tile, q_tile, kRows);
    if constexpr (!kKlOnly) key_gemm(dprob, v_tile, do_tile, kStepRows);
    ptx::wgmma_commit_group();
    if (args.with_kl) {
      key_gemm(proxy, kp_tile, qp_tile, kProxyCols);
      ptx::wgmma_commit_group();
    }
    if constexpr (kTurns) {
      if (consumer == 0 || !(flags & kStepLast)) ptx::named_barrier_arrive(kTurnBarrier + 1 - consumer, 256);
    }
    ptx::wgmma_wait_group<0>();
    ptx::fence_accumulators(score);
    if constexpr (!kKlOnly) ptx::fence_accumulators(dprob);

    // ---- P = exp(S σ − LSE) on j ≤ i, dS = P (dP − Δ), the teacher sums ----------------------------
    // Element 4j + 2h + e: block row key_row0 + 8h, step row (column) 8j + 2·quad + e.
    float teacher[2][kT];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < kT; ++i) teacher[h][i] = 0.f;
    }
    // Three passes, so the exponentials issue back to back and the mask costs one uniform branch.
#pragma unroll
    for (int j = 0; j < kRows / 8; ++j) {
      const float2 lse = *reinterpret_cast<const float2*>(&m.lse[8 * j + 2 * quad]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = score[4 * j + 2 * h + e];
          x = exp2_approx(fmaf(x, args.scale_log2, -(e ? lse.y : lse.x)));
        }
      }
    }
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int local = row_token[8 * j + 2 * quad + e];
          const int token = local < count ? m.token[local] : -1;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (first_key + key_row0 + 8 * h > token) score[4 * j + 2 * h + e] = 0.f;
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kRows / 8; ++j) {
      const float2 delta = *reinterpret_cast<const float2*>(&m.delta[8 * j + 2 * quad]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int index = 4 * j + 2 * h + e;
          const float p = score[index];
          if constexpr (!kKlOnly) dprob[index] = p * (dprob[index] - (e ? delta.y : delta.x));
          teacher[h][(2 * j + e) / kM] += p;
        }
      }
    }
    if constexpr (!kKlOnly) {
      uint32_t p_frag[4][4];
      uint32_t ds_frag[4][4];
#pragma unroll
      for (int k_step = 0; k_step < 4; ++k_step) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          p_frag[k_step][r] = ptx::pack2<Element>(score[8 * k_step + 2 * r], score[8 * k_step + 2 * r + 1]);
          ds_frag[k_step][r] = ptx::pack2<Element>(dprob[8 * k_step + 2 * r], dprob[8 * k_step + 2 * r + 1]);
        }
      }

      // ---- dV += Pᵀ·dO, dK += dSᵀ·Q (async; dO, Q MN-major) --------------------------------------------
      ptx::wgmma_fence();
#pragma unroll
      for (int k_step = 0; k_step < 4; ++k_step) {
        const uint64_t desc_do = ptx::make_sw128_mnmajor_desc(do_tile + k_step * 16 * 64, kStepRows * 128);
        Mma128::template run<1>(dv, p_frag[k_step], desc_do, k_step > 0 || !unit_fresh ? 1u : 0u);
      }
#pragma unroll
      for (int k_step = 0; k_step < 4; ++k_step) {
        const uint64_t desc_q = ptx::make_sw128_mnmajor_desc(q_tile + k_step * 16 * 64, kStepRows * 128);
        Mma128::template run<1>(dk, ds_frag[k_step], desc_q, k_step > 0 || !unit_fresh ? 1u : 0u);
      }
      ptx::wgmma_commit_group();

      // ---- dS to shared memory as (row, key), transposed by stmatrix: lane 8i + j stores step row
      // 16·k_step + 8·(i / 2) + j, keys 8·(i % 2) … of this warp's 16 -------------------------------------
      // No barrier here: the previous step's dQ GEMM and KL sums, which read the dS and the KL
      // partials this step overwrites, completed in both warpgroups before its kDqBarrier.
#pragma unroll
      for (int k_step = 0; k_step < 4; ++k_step) ptx::stmatrix_x4_trans(ds_address + k_step * 16 * 128, ds_frag[k_step]);
    } else {
      // Steps between two flushes write disjoint columns of g, rows of the staged q_proxy and KL
      // partials; only the step after a flush waits for both warpgroups to be done reading them.
      if (flushed) ptx::named_barrier_sync(kStepBarrier, 256);
    }

    // ---- KL: π, g = π − t, the KL terms; g and the q_proxy rows staged --------------------------------
    if (args.with_kl) {
      ptx::fence_accumulators(proxy);
      float kl[kT];
#pragma unroll
      for (int i = 0; i < kT; ++i) kl[i] = 0.f;
#pragma unroll
      for (int i = 0; i < kT; ++i) {
        const int local = quad * kT + i;
        const float plse = m.proxy_lse[local];
        const int token = m.token[local];
        float g[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int index = 4 * (i / 2) + 2 * h + (i % 2);
          const float x = fmaf(proxy[index], args.proxy_scale_log2, -plse);  // log2 π
          float pi = exp2_approx(x);
          if (need_mask && first_key + key_row0 + 8 * h > token) pi = 0.f;
          const float t = teacher[h][i] * (1.f / kM);
          // t·log t → 0 as t → 0: below 2^-100 the term (< 2^-93) is dropped, which keeps the
          // one-instruction log2 off denormals and the sum free of a branch.
          kl[i] += t > 0x1p-100f ? t * ((log2_approx(t) - x) * kLn2) : 0.f;
          g[h] = pi - t;
          if constexpr (kKlOnly) {
            if (args.with_kl_grad) {
              const int key_local = consumer * 64 + warp * 16 + lane / 4 + 8 * h;
              g_tile[sw128_offset(kKeys, key_local, (staged + local) / 8) + (staged + local) % 8] =
                  from_float<Element>(g[h]);
            }
          }
        }
        if constexpr (!kKlOnly) {
          if (args.with_kl_grad) {
            // The token's g row (proxy_grads.cuh multiplies it). This thread holds keys r = lane / 4
            // and r + 8 of the warp's 16, the lane with r ^ 1 their neighbours: after one exchange an
            // even r stores keys (r, r + 1) and an odd r keys (r + 7, r + 8), 4 bytes each.
            const bool even = ((lane / 4) & 1) == 0;
            const float other = __shfl_xor_sync(0xffffffffu, even ? g[1] : g[0], 4);
            if (local < count) {
              const int key_local = consumer * 64 + warp * 16 + lane / 4 + (even ? 0 : 7);
              *reinterpret_cast<uint32_t*>(args.proxy_grad + int64_t(m.first_entry + uint32_t(local) - entry_base) * kKeys +
                                           key_local) = even ? pack2<Element>(g[0], other) : pack2<Element>(other, g[1]);
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kT; ++i) {
        kl[i] += __shfl_xor_sync(0xffffffffu, kl[i], 4);
        kl[i] += __shfl_xor_sync(0xffffffffu, kl[i], 8);
        kl[i] += __shfl_xor_sync(0xffffffffu, kl[i], 16);
        // KL-only: per staged token, summed when the staged tokens are flushed.
        const int column = (kKlOnly ? staged : 0) + quad * kT + i;
        if (lane < 4) kl_parts[(consumer * 4 + warp) * kMaxStepTokens + column] = kl[i];
      }
      if (kKlOnly && args.with_kl_grad) {
        // The step's q_proxy rows to staged rows staged + token: all staged rows when a flush begins
        // (zeros past the step and for padding tokens), then the step's rows. Staged row r, chunk c is
        // always copied by thread (16r + c) % 256, so the steps of one flush need no barrier between them.
        for (int index = consumer_thread; index < kFlush * 16; index += 256) {
          const int row = index / 16;
          const int local = row - staged;
          if (local < 0 || (staged > 0 && local >= kStepTokens)) continue;
          const int chunk = index % 16;
          uint4 value = make_uint4(0, 0, 0, 0);
          if (local < count) {
            const int n = proxy_row_of_token(local, kM, kRows);
            value = *reinterpret_cast<const uint4*>(qp_tile + sw128_offset(kProxyCols, n, chunk));
          }
          *reinterpret_cast<uint4*>(qp_flush + sw128_offset(kFlush, row, chunk)) = value;
        }
      }
      if (kKlOnly && consumer_thread < kStepTokens) flush_token[staged + consumer_thread] = m.token[consumer_thread];
    }
    if constexpr (kKlOnly) {
      // ---- KL-only: the staged tokens are flushed every kFlush tokens and at the list's end ----
      // Between flushes the stage is released right after the KL terms (nothing reads it later).
      staged += count;
      flushed = (flags & kStepListLast) || staged + kStepTokens > kFlush;
      if (!flushed) {
        ptx::mbarrier_arrive(&q_empty[s]);
        continue;
      }
      // The previous flush's dq_proxy bulk reads of the staging (below) are done long before.
      if (lane < kBulkIssueLanes) ptx::bulk_wait_group_read<0>();
      ptx::fence_proxy_async_shared();  // g and the staged rows are wgmma operands
      ptx::named_barrier_sync(kMidBarrier, 256);
      // k_proxy is read below; the producer replaces it only after the list's last step.
      if (!(flags & kStepListLast)) ptx::mbarrier_arrive(&q_empty[s]);
      const int64_t proxy_bh = int64_t(key.b) * args.num_proxy_heads + key.proxy_head;
      if (consumer_thread < staged) {
        // One KL term per (token, list), added to the token's row.
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) sum += kl_parts[w * kMaxStepTokens + consumer_thread];
        const int token = flush_token[consumer_thread];
        if (token >= 0) atomicAdd(args.kl_rows + proxy_bh * args.seqlen + token, sum);
      }
      if (args.with_kl_grad) {
        // dk_proxy over the whole list accumulates in the registers the sparse mode gives dK (stale
        // g columns past the staged tokens meet zero q̃ rows); dq_proxy of the staged tokens.
        ptx::wgmma_fence();
        dk_proxy_product(dk, unit_fresh);
        unit_fresh = false;
        ptx::wgmma_commit_group();
        float acc[32];
        dq_proxy_product(acc);
        ptx::wgmma_commit_group();
        ptx::wgmma_wait_group<0>();
        ptx::fence_accumulators(dk);
        ptx::fence_accumulators(acc);
        // dq_proxy staged in the V tile, which this mode never loads (the N = 64 product's upper
        // half is unused).
        float* dqp_stage = reinterpret_cast<float*>(v_tile);
        stage_dq_proxy(acc, dqp_stage);
        ptx::fence_proxy_async_shared();
        ptx::named_barrier_sync(kDqBarrier, 256);
        reduce_add_dq_proxy(dqp_stage, key, staged);
        if (flags & kStepListLast) {
          reduce_add_dk_proxy_rows(args, dk, key.b, key.proxy_head, first_key + key_row0);
          unit_fresh = true;
        }
      }
      staged = 0;
      if (flags & kStepListLast) ptx::mbarrier_arrive(&q_empty[s]);
      if (flags & kStepLast) {
        if (lane < kBulkIssueLanes) ptx::bulk_wait_group<0>();
        break;
      }
      continue;
    }
    // dV and dK complete before the barrier: their register operands (P, dS) are then free for the
    // dQ accumulators, and after the barrier neither warpgroup reads this step's Q or dO again, so
    // the stage can take the dQ staging.
    ptx::wgmma_wait_group<0>();
    ptx::fence_accumulators(dk);
    ptx::fence_accumulators(dv);
    ptx::fence_proxy_async_shared();  // dS is a wgmma operand
    ptx::named_barrier_sync(kMidBarrier, 256);
    {
      // ---- dQ = dS·K: this warpgroup's 64 dims, K MN-major ----------------------------------------------
      float dq[32];
      ptx::wgmma_fence();
#pragma unroll
      for (int k_step = 0; k_step < kKeys / 16; ++k_step) {
        const int half = k_step / 4;
        const uint64_t desc_ds = ptx::advance_desc(
            ptx::make_sw128_kmajor_desc(ds_tile + half * kStepRows * 64), (k_step % 4) * 32);
        const uint64_t desc_k =
            ptx::make_sw128_mnmajor_desc(k_tile + consumer * kKeys * 64 + k_step * 16 * 64, kKeys * 128);
        ptx::WgmmaSS<Element, 64, 0, 1>::run(dq, desc_ds, desc_k, k_step > 0 ? 1u : 0u);
      }
      ptx::wgmma_commit_group();
      if (args.with_kl && consumer == 0 && wg_thread < count) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) sum += kl_parts[w * kMaxStepTokens + wg_thread];
        args.kl_partial[((int64_t(key.b) * args.num_proxy_heads + key.proxy_head) * args.seqlen + m.token[wg_thread]) *
                            args.top_k + m.slot[wg_thread]] = sum;
      }
      ptx::wgmma_wait_group<0>();
      ptx::fence_accumulators(dq);
      // dQ through the consumed stage: both warpgroups store their 64 dims of every row into the
      // token-major staging (dq_stage_row_offset), then token t is reduce-added, M contiguous rows,
      // by lane t / 8 of consumer warp t % 8. The stage is released once those reads are done. For
      // bf16 inputs the rows are fp16 of dQ times the row's scale (config.h, kDqScaleTarget).
      unsigned char* dq_stage = reinterpret_cast<unsigned char*>(q_stages + s * kStageElements);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kDqHalf) {
          const float row_scale = m.dq_scale[warp * 16 + lane / 4 + 8 * h];
          __half* row = reinterpret_cast<__half*>(dq_stage + dq_row_offset[h]) + consumer * 64 + 2 * quad;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            *reinterpret_cast<__half2*>(row + 8 * j) =
                __floats2half2_rn(dq[4 * j + 2 * h] * row_scale, dq[4 * j + 2 * h + 1] * row_scale);
          }
        } else {
          float* row = reinterpret_cast<float*>(dq_stage + dq_row_offset[h]) + consumer * 64 + 2 * quad;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            *reinterpret_cast<float2*>(row + 8 * j) = make_float2(dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]);
          }
        }
      }
      ptx::fence_proxy_async_shared();
      ptx::named_barrier_sync(kDqBarrier, 256);
      if (lane < kDqIssueLanes) {
        const int local = (consumer * 4 + warp) + 8 * lane;
        if (local < count) {
          const int64_t first_row =
              ((int64_t(key.b) * args.seqlen + m.token[local]) * args.num_heads + key.proxy_head * kM) * kHeadDim;
          const unsigned char* staged_rows = dq_stage + dq_stage_token_offset(local, kM, kDqRowBytes);
          if constexpr (kDqHalf) {
            ptx::bulk_reduce_add_f16(reinterpret_cast<__half*>(args.dq_accum) + first_row, staged_rows, kM * kDqRowBytes,
                                     dq_policy);
          } else {
            ptx::bulk_reduce_add_f32(args.dq_accum + first_row, staged_rows, kM * kDqRowBytes);
          }
        }
        ptx::bulk_commit_group();
      }
    }
    // The stage is free once the bulk operations have read it. With three stages that wait moves to
    // the end of the next step (the producer is then filling the third stage), except on a list's
    // last step: the producer loads the next list's K, V only after that step is released.
    const bool hold = kStages == 3 && (flags & (kStepListLast | kStepLast)) == 0;
    if (lane < kBulkIssueLanes) {
      if (hold) {
        ptx::bulk_wait_group_read<1>();
      } else {
        ptx::bulk_wait_group_read<0>();
      }
    }
    if (held_stage >= 0) ptx::mbarrier_arrive(&q_empty[held_stage]);
    if (hold) {
      held_stage = s;
    } else {
      ptx::mbarrier_arrive(&q_empty[s]);
      held_stage = -1;
    }

    // ---- dK, dV of the unit: reduce-added when it ends --------------------------------------------------
    if (flags & kStepUnitLast) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key_pos = first_key + key_row0 + 8 * h;
        if (key_pos < args.seqlen) {
          const int64_t at = ((int64_t(key.b) * args.seqlen + key_pos) * args.num_kv_heads + key.kv_head) * kHeadDim +
                             2 * quad;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            reduce_add2(args.dk_accum + at + 8 * j, dk[4 * j + 2 * h], dk[4 * j + 2 * h + 1]);
            reduce_add2(args.dv_accum + at + 8 * j, dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
          }
        }
      }
    }
    // The next step starts a unit's dK, dV with a product that overwrites the accumulators: zeroing
    // them here instead makes the compiler move all 128 between two register sets every step.
    unit_fresh = (flags & kStepUnitLast) != 0;
    if (flags & kStepLast) {
      if (lane < kBulkIssueLanes) ptx::bulk_wait_group<0>();
      break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: one launch over every chunk's tiles of the forward's schedule (params.fwd.schedule).
// ---------------------------------------------------------------------------------------------
template <typename Element, int kM, bool kKlOnly = false>
cudaError_t launch_pipelined_m(const PipelinedArgs<Element>& args, int device, int grid, cudaStream_t stream) {
  const PipelinedLayout layout = make_pipelined_layout(kKlOnly, kM);
  const void* kernel = reinterpret_cast<const void*>(backward_pipelined<Element, kM, kKlOnly>);
  if (cudaError_t error = set_max_dynamic_smem(kernel, device, int(layout.total)); error != cudaSuccess) return error;
  backward_pipelined<Element, kM, kKlOnly><<<unsigned(grid), kPipelinedThreads, layout.total, stream>>>(args, layout);
  return cudaGetLastError();
}

template <typename Element, bool kKlOnly>
cudaError_t launch_pipelined(const PipelinedArgs<Element>& args, int heads_per_proxy, int grid_limit,
                             cudaStream_t stream) {
  int device = 0;
  int sm_count = 0;
  if (cudaError_t error = current_device_sms(&device, &sm_count); error != cudaSuccess) return error;
  const int grid = grid_limit > 0 && grid_limit < sm_count ? grid_limit : sm_count;
  switch (heads_per_proxy) {
    case 2:
      return launch_pipelined_m<Element, 2, kKlOnly>(args, device, grid, stream);
    case 4:
      return launch_pipelined_m<Element, 4, kKlOnly>(args, device, grid, stream);
    case 8:
      return launch_pipelined_m<Element, 8, kKlOnly>(args, device, grid, stream);
    default:
      return launch_pipelined_m<Element, 16, kKlOnly>(args, device, grid, stream);
  }
}

// The KL-only dense pass (warmup with the main branch elsewhere): Σ_j g k_proxy into
// dq_proxy_accum [b, s, hp, di], Σ_i g q_proxy into dk_proxy_accum [b, s, hp, di] and the KL terms
// into kl_rows [b, hp, s], all zeroed by the caller and added to with fp32 atomics. The caller has
// checked kl_only_limit (config.h: M = H/Hp ∈ {2, 4, 8, 16}, 32-bit entries and list numbers);
// reads q, k, q_proxy, k_proxy, fwd.lse (natural log) and fwd.proxy_lse.
template <typename Element>
Status run_pipelined_kl_dense(const BackwardParams& params, float softmax_scale, float proxy_scale,
                              float* dq_proxy_accum, float* dk_proxy_accum, float* kl_rows, cudaStream_t stream) {
  const ProblemShape& shape = params.fwd.shape;
  PipelinedArgs<Element> args{};
  args.q = strided<const Element>(params.fwd.q);
  args.k = strided<const Element>(params.fwd.k);
  args.q_proxy = strided<const Element>(params.fwd.q_proxy);
  args.k_proxy = strided<const Element>(params.fwd.k_proxy);
  args.lse = params.fwd.lse;
  args.proxy_lse = params.fwd.proxy_lse;
  args.dq_proxy_accum = dq_proxy_accum;
  args.dk_proxy_accum = dk_proxy_accum;
  args.kl_rows = kl_rows;
  args.dense_chunks = int(dense_chunks(shape.seqlen));
  args.dense_lists_per_bh = dense_lists_per_bh(shape.seqlen);
  args.dense_lists = args.dense_lists_per_bh * shape.batch * shape.num_proxy_heads;
  set_shape_fields(args, shape);
  args.top_k = 1;
  args.scale_log2 = softmax_scale * kLog2e;
  args.proxy_scale_log2 = proxy_scale * kLog2e;
  args.with_kl = 1;
  args.with_kl_grad = params.kl_grad != nullptr ? 1 : 0;
  const int grid_limit = int(std::min<int64_t>(args.dense_lists, 1 << 30));
  const cudaError_t error = launch_pipelined<Element, true>(args, shape.heads_per_proxy(), grid_limit, stream);
  if (error == cudaSuccess) return Status::Ok();
  return {StatusCode::kCudaError, std::string("warmup KL-only backward: ") + cudaGetErrorString(error)};
}

template <typename Element>
Status run_pipelined_tiles(const Problem& pb, cudaStream_t stream) {
  const BackwardParams& params = pb.params;
  const ProblemShape& shape = params.fwd.shape;
  const schedule::ScheduleLayout schedule_layout = schedule::make_schedule_layout(shape);
  const char* schedule_base = static_cast<const char*>(params.fwd.schedule);
  PipelinedArgs<Element> args;
  args.q = strided<const Element>(params.fwd.q);
  args.k = strided<const Element>(params.fwd.k);
  args.v = strided<const Element>(params.fwd.v);
  args.q_proxy = strided<const Element>(params.fwd.q_proxy);
  args.k_proxy = strided<const Element>(params.fwd.k_proxy);
  args.dout = strided<const Element>(params.dout);
  args.lse = params.fwd.lse;
  args.proxy_lse = params.fwd.proxy_lse;
  args.delta = pb.ws.delta;
  args.dq_scale = pb.ws.dq_scale;
  args.tiles = reinterpret_cast<const uint4*>(schedule_base + schedule_layout.tiles);
  args.tile_offsets = reinterpret_cast<const uint32_t*>(schedule_base + schedule_layout.tile_offsets);
  for (int i = 0; i < 2; ++i) {
    args.entries[i] = reinterpret_cast<const uint32_t*>(schedule_base + schedule_layout.values[i]);
  }
  args.header = reinterpret_cast<const int32_t*>(schedule_base + schedule_layout.header);
  args.segment_keys = schedule::keys_per_segment(shape);
  args.dealt = pb.ws.dealt_tiles;
  args.dq_accum = pb.ws.dq_accum;
  args.dk_accum = pb.ws.dk_accum;
  args.dv_accum = pb.ws.dv_accum;
  args.dq_proxy_accum = pb.ws.dq_proxy_accum;
  args.dk_proxy_accum = pb.ws.dk_proxy_accum;
  args.kl_partial = pb.ws.kl_partial;
  set_shape_fields(args, shape);
  args.top_k = shape.top_k;
  args.scale_log2 = pb.scale_log2;
  args.proxy_scale_log2 = pb.proxy_scale * kLog2e;
  args.with_kl = pb.with_kl ? 1 : 0;
  args.with_kl_grad = params.kl_grad != nullptr ? 1 : 0;

  args.entry_offsets = reinterpret_cast<const uint32_t*>(schedule_base + schedule_layout.entry_offsets);
  args.proxy_grad = static_cast<Element*>(pb.ws.proxy_grad);

  ProxyGradArgs<Element> proxy{};
  proxy.q_proxy = args.q_proxy;
  proxy.k_proxy = args.k_proxy;
  proxy.g = args.proxy_grad;
  proxy.entries[0] = args.entries[0];
  proxy.entries[1] = args.entries[1];
  proxy.header = args.header;
  proxy.tiles = args.tiles;
  proxy.tile_offsets = args.tile_offsets;
  proxy.entry_offsets = args.entry_offsets;
  proxy.dq_proxy_accum = pb.ws.dq_proxy_accum;
  proxy.dk_proxy_accum = pb.ws.dk_proxy_accum;
  set_shape_fields(proxy, shape);

  // With the KL gradient, chunk by chunk the tile kernel and then the proxy-gradient kernel over the
  // chunk's g rows (config.h); without, one launch over all chunks.
  const int64_t launch_keys = args.with_kl_grad ? schedule::keys_per_chunk(shape) : schedule_layout.num_keys;
  int device = 0;
  int sm_count = 0;
  FLASHMSA_BACKWARD_CHECK(current_device_sms(&device, &sm_count), "device query");
  const int grid = std::min(sm_count, schedule::kMaxDealGrid);
  args.tile_bounds = pb.ws.tile_bounds;
  {
    const int64_t segments = schedule_layout.num_keys / args.segment_keys;
    const schedule::DealWeights weights{kTileWeight, kListWeight, 1, 1};
    schedule::deal_tile_bounds<schedule::kDealThreads><<<unsigned(segments), schedule::kDealThreads, 0, stream>>>(
        args.tile_offsets, args.segment_keys, grid, weights, pb.ws.tile_bounds);
    FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "tile bounds");
  }
  for (int64_t begin = 0; begin < schedule_layout.num_keys; begin += launch_keys) {
    const int64_t end = std::min(begin + launch_keys, schedule_layout.num_keys);
    args.key_begin = begin;
    args.num_keys = end;
    const cudaError_t error =
        launch_pipelined<Element, false>(args, pb.heads_per_proxy, grid, stream);
    if (error != cudaSuccess) {
      return {StatusCode::kCudaError, std::string("backward: pipelined tiles: ") + cudaGetErrorString(error)};
    }
    if (args.with_kl_grad) {
      proxy.key_begin = begin;
      proxy.key_end = end;
      proxy.tile_counter = pb.ws.tile_counters + begin / launch_keys;
      if (Status status = launch_proxy_grads(proxy, stream); !status.ok()) return status;
    }
  }
  return Status::Ok();
}

}  // namespace flashmsa::kernels::backward
