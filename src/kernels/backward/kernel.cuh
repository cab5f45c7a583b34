// Sparse backward (SPEC.md §3-§4): dq, dk, dv over the selected sets T and the KL gradient to
// q_proxy and k_proxy, plus the KL value (docs/design.md "Backward").
//
// Pipeline on one stream, no host synchronisation (CUDA-graph capturable):
//   compute_delta       Δ_hi = ⟨O_hi, dO_hi⟩
//   schedule.cuh        the reverse index: per (b, p, block) the sorted rows that selected it
//   backward_tiles      KV-outer: a work item is (b, KV head g, block c, ≤ 32 tiles of its rows).
//                       K, V, k_proxy of the block stay in shared memory; each tile gathers 64
//                       main rows (group rows (b, p, i) × their M heads), recomputes P, dP, dS
//                       on tensor cores (mma.sync m16n8k16) and
//                         - accumulates dK, dV of the block in registers (reduce-added at the end),
//                         - reduce-adds dQ of its rows into an fp32 buffer,
//                         - from the fp32 P: the teacher t, the student π, g = π - t, the KL terms,
//                           dq_proxy (reduce-add) and, staged over tiles, dk_proxy.
//   finish_*            fp32 accumulators -> gradients in the input dtype with σ, ḡσp/n applied
//   reduce_kl           ordered sum of the per-slot KL terms -> fwd.kl
// Deterministic mode: one work item per (b, g, c), and dQ / dq_proxy go to per-slot buffers summed
// in slot order, so every sum has a fixed order.
// config.h holds the constants and layouts, mma.cuh the PTX wrappers; launch.cu dispatches.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "flashmsa/api.h"
#include "kernels/backward/config.h"
#include "kernels/common/backward_common.cuh"
#include "kernels/common/device_cache.h"
#include "kernels/backward/mma.cuh"
#include "kernels/backward/pipelined_kernel.cuh"
#include "kernels/backward/schedule.cuh"

namespace flashmsa::kernels::backward {


// ---------------------------------------------------------------------------------------------
// The tile kernel: roles inside one CTA of 8 warps.
// ---------------------------------------------------------------------------------------------

// Per-item state of a CTA: the unit, its K/V block and the proxy stage.
struct ItemState {
  int64_t batch;
  int kv_head;
  int64_t block;
  int64_t first_key;   // block · 128
  int stage_rows;      // rows used in the proxy stage
  int stage_proxy_head;
  int loaded_proxy_key_head;
};

// Copies 128 rows of a [b, s, heads, 128] tensor (keys first_key …) into a swizzled smem tile;
// rows past S become zeros.
template <typename T>
__device__ __forceinline__ void load_key_block(uint16_t* tile, const TensorRef& ref, int64_t batch,
                                               int64_t first_key, int head, int64_t seqlen) {
  for (int chunk = threadIdx.x; chunk < kKeys * 16; chunk += kThreads) {
    const int row = chunk >> 4;
    const int col = (chunk & 15) * 8;
    const int64_t key = first_key + row;
    const bool valid = key < seqlen;
    const T* source = valid ? strided<const T>(ref).row(batch, key, head) + col : static_cast<const T*>(ref.ptr);
    cp_async_16(&tile[swizzle(row, col)], source, valid);
  }
}

// dk_proxy of the staged rows: Σ_r g_r,key q_proxy_r,di, reduce-added per proxy head.
template <typename T>
__device__ void flush_proxy_stage(const Problem& pb, SharedStorage& smem, ItemState& state) {
  const ProblemShape& shape = pb.params.fwd.shape;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int k_steps = (state.stage_rows + 15) / 16;
  for (int quarter = 0; quarter < 4; ++quarter) {
    float acc[4][4] = {};  // (16 keys, 32 di) of this warp
    for (int ks = 0; ks < k_steps; ++ks) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, &smem.proxy_grad[swizzle(16 * ks + (lane & 7) + (lane >> 4) * 8,
                                                    16 * warp + ((lane >> 3) & 1) * 8)]);
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, &smem.proxy_query[swizzle(16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                       32 * quarter + 16 * np + (lane >> 4) * 8)]);
        mma_16816<T>(acc[2 * np], a, b[0], b[1]);
        mma_16816<T>(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    for (int half = 0; half < 2; ++half) {
      const int64_t key = state.first_key + 16 * warp + (lane >> 2) + 8 * half;
      if (key >= shape.seqlen) continue;
      float* row = pb.ws.dk_proxy_accum +
                   ((state.batch * shape.seqlen + key) * shape.num_proxy_heads + state.stage_proxy_head) *
                       kHeadDim;
      for (int nt = 0; nt < 4; ++nt) {
        reduce_add2(row + 32 * quarter + 8 * nt + 2 * (lane & 3), acc[nt][2 * half], acc[nt][2 * half + 1]);
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kStageRows * kKeys / 8; e += kThreads) {
    reinterpret_cast<uint4*>(smem.proxy_grad)[e] = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();
  state.stage_rows = 0;
}

// One tile: group rows [first, first + count) of the list (b, proxy_head, block).
template <typename T>
__device__ void run_tile(const Problem& pb, SharedStorage& smem, ItemState& state, int proxy_head,
                         const int32_t* entries, int count, float (&acc_dk)[16][4],
                         float (&acc_dv)[16][4]) {
  const BackwardParams& params = pb.params;
  const ProblemShape& shape = params.fwd.shape;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int M = pb.heads_per_proxy;
  const int per_slab = pb.group_rows_per_slab;
  const int per_tile = pb.group_rows_per_tile;

  // ---- proxy stage bookkeeping and the k_proxy block of this proxy head ----------------------
  if (pb.with_kl) {
    if (state.stage_rows > 0 &&
        (proxy_head != state.stage_proxy_head || state.stage_rows + per_tile > kStageRows)) {
      flush_proxy_stage<T>(pb, smem, state);
    }
    state.stage_proxy_head = proxy_head;
    const int proxy_key_head = proxy_head / (shape.num_proxy_heads / shape.num_proxy_kv_heads);
    if (proxy_key_head != state.loaded_proxy_key_head) {
      load_key_block<T>(smem.proxy_key, params.fwd.k_proxy, state.batch, state.first_key,
                        proxy_key_head, shape.seqlen);
      state.loaded_proxy_key_head = proxy_key_head;
    }
  }

  // ---- tile rows: group row gr -> (token, slot); tile row r -> (token, head, LSE, Δ) -----------
  if (tid < per_tile) {
    int token = -1;
    if (tid < count) {
      const int32_t entry = entries[tid];
      token = entry >> kSlotBits;
      smem.group_slot[tid] = entry & ((1 << kSlotBits) - 1);
      smem.group_proxy_lse[tid] =
          pb.with_kl ? params.fwd.proxy_lse[(state.batch * shape.num_proxy_heads + proxy_head) *
                                                shape.seqlen + token]
                     : 0.f;
    }
    smem.group_token[tid] = token;
  }
  __syncthreads();
  if (tid < kTileRows) {
    const int slab_row = tid % kSlabRows;
    const int local = slab_row / M;
    const int group_row = (tid / kSlabRows) * per_slab + local;
    const int token = local < per_slab ? smem.group_token[group_row] : -1;
    smem.row_token[tid] = token;
    if (token >= 0) {
      const int head = proxy_head * M + slab_row % M;
      const int64_t at = (state.batch * shape.num_heads + head) * shape.seqlen + token;
      smem.row_head[tid] = head;
      smem.row_lse[tid] = params.fwd.lse[at] * kLog2e;
      smem.row_delta[tid] = pb.ws.delta[at];
    } else {
      smem.row_head[tid] = 0;
      smem.row_lse[tid] = 0.f;
      smem.row_delta[tid] = 0.f;
    }
  }
  __syncthreads();

  // ---- gather Q, dO (64 rows) and q_proxy (into the stage) -----------------------------------
  for (int chunk = tid; chunk < kTileRows * 16; chunk += kThreads) {
    const int row = chunk >> 4;
    const int col = (chunk & 15) * 8;
    const int token = smem.row_token[row];
    const bool valid = token >= 0;
    const T* q = valid ? strided<const T>(params.fwd.q).row(state.batch, token, smem.row_head[row]) + col
                       : static_cast<const T*>(params.fwd.q.ptr);
    const T* dout = valid ? strided<const T>(params.dout).row(state.batch, token, smem.row_head[row]) + col
                          : static_cast<const T*>(params.dout.ptr);
    cp_async_16(&smem.query[swizzle(row, col)], q, valid);
    cp_async_16(&smem.dout[swizzle(row, col)], dout, valid);
  }
  if (pb.with_kl) {
    for (int chunk = tid; chunk < per_tile * 16; chunk += kThreads) {
      const int group_row = chunk >> 4;
      const int col = (chunk & 15) * 8;
      const int token = smem.group_token[group_row];
      const bool valid = token >= 0;
      const T* source = valid ? strided<const T>(params.fwd.q_proxy).row(state.batch, token, proxy_head) + col
                              : static_cast<const T*>(params.fwd.q_proxy.ptr);
      cp_async_16(&smem.proxy_query[swizzle(state.stage_rows + group_row, col)], source, valid);
    }
  }
  cp_async_wait_all();
  __syncthreads();

  // ---- S = Q Kᵀ and dP = dO Vᵀ: warp (slab, key half) owns 16 rows × 64 keys ------------------
  const int slab = warp & 3;
  const int key_half = warp >> 2;
  {
    float acc_s[8][4] = {};
    float acc_dp[8][4] = {};
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t a_q[4];
      uint32_t a_do[4];
      const int a_offset = swizzle(16 * slab + (lane & 15), 16 * ks + (lane >> 4) * 8);
      ldmatrix_x4(a_q, &smem.query[a_offset]);
      ldmatrix_x4(a_do, &smem.dout[a_offset]);
      for (int np = 0; np < 4; ++np) {
        const int b_offset = swizzle(64 * key_half + 16 * np + (lane & 7) + (lane >> 4) * 8,
                                     16 * ks + ((lane >> 3) & 1) * 8);
        uint32_t b[4];
        ldmatrix_x4(b, &smem.key[b_offset]);
        mma_16816<T>(acc_s[2 * np], a_q, b[0], b[1]);
        mma_16816<T>(acc_s[2 * np + 1], a_q, b[2], b[3]);
        ldmatrix_x4(b, &smem.value[b_offset]);
        mma_16816<T>(acc_dp[2 * np], a_do, b[0], b[1]);
        mma_16816<T>(acc_dp[2 * np + 1], a_do, b[2], b[3]);
      }
    }
    // P = exp(z - LSE) on T (j ≤ i), dS = P (dP - Δ); both to smem in T, P also in fp32.
    for (int half = 0; half < 2; ++half) {
      const int row = 16 * slab + (lane >> 2) + 8 * half;
      const int token = smem.row_token[row];
      const float lse = smem.row_lse[row];
      const float delta = smem.row_delta[row];
      for (int nt = 0; nt < 8; ++nt) {
        const int key = 64 * key_half + 8 * nt + 2 * (lane & 3);
        float prob[2];
        float dscore[2];
        for (int e = 0; e < 2; ++e) {
          const bool valid = token >= 0 && state.first_key + key + e <= token;
          prob[e] = valid ? exp2f(acc_s[nt][2 * half + e] * pb.scale_log2 - lse) : 0.f;
          dscore[e] = prob[e] * (acc_dp[nt][2 * half + e] - delta);
        }
        *reinterpret_cast<uint32_t*>(&smem.prob[swizzle(row, key)]) = pack2<T>(prob[0], prob[1]);
        *reinterpret_cast<uint32_t*>(&smem.dscore[swizzle(row, key)]) = pack2<T>(dscore[0], dscore[1]);
        if (pb.with_kl) {
          *reinterpret_cast<float2*>(&smem.prob32[row * kProbStride + key]) = make_float2(prob[0], prob[1]);
        }
      }
    }
  }
  __syncthreads();

  // ---- dV += Pᵀ dO and dK += dSᵀ Q: warp owns 16 keys × 128 dims ----------------------------
  for (int ks = 0; ks < kTileRows / 16; ++ks) {
    uint32_t a_p[4];
    uint32_t a_ds[4];
    const int a_offset = swizzle(16 * ks + (lane & 7) + (lane >> 4) * 8, 16 * warp + ((lane >> 3) & 1) * 8);
    ldmatrix_x4_trans(a_p, &smem.prob[a_offset]);
    ldmatrix_x4_trans(a_ds, &smem.dscore[a_offset]);
    for (int np = 0; np < 8; ++np) {
      const int b_offset = swizzle(16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8, 16 * np + (lane >> 4) * 8);
      uint32_t b[4];
      ldmatrix_x4_trans(b, &smem.dout[b_offset]);
      mma_16816<T>(acc_dv[2 * np], a_p, b[0], b[1]);
      mma_16816<T>(acc_dv[2 * np + 1], a_p, b[2], b[3]);
      ldmatrix_x4_trans(b, &smem.query[b_offset]);
      mma_16816<T>(acc_dk[2 * np], a_ds, b[0], b[1]);
      mma_16816<T>(acc_dk[2 * np + 1], a_ds, b[2], b[3]);
    }
  }

  // ---- dQ = dS K: warp (slab, dim half) owns 16 rows × 64 dims, reduce-added -----------------
  {
    float acc_dq[8][4] = {};
    for (int ks = 0; ks < 8; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, &smem.dscore[swizzle(16 * slab + (lane & 15), 16 * ks + (lane >> 4) * 8)]);
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, &smem.key[swizzle(16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8,
                                               64 * key_half + 16 * np + (lane >> 4) * 8)]);
        mma_16816<T>(acc_dq[2 * np], a, b[0], b[1]);
        mma_16816<T>(acc_dq[2 * np + 1], a, b[2], b[3]);
      }
    }
    for (int half = 0; half < 2; ++half) {
      const int row = 16 * slab + (lane >> 2) + 8 * half;
      const int token = smem.row_token[row];
      if (token < 0) continue;
      const int head = smem.row_head[row];
      float* dq;
      if (params.deterministic) {
        const int group_row = slab * per_slab + (row % kSlabRows) / M;
        const int64_t slot_row = ((state.batch * shape.num_proxy_heads + proxy_head) * shape.seqlen + token) *
                                     shape.top_k + smem.group_slot[group_row];
        dq = pb.ws.dq_accum + (slot_row * M + head % M) * kHeadDim;
      } else {
        dq = pb.ws.dq_accum + ((state.batch * shape.seqlen + token) * shape.num_heads + head) * kHeadDim;
      }
      for (int nt = 0; nt < 8; ++nt) {
        const int dim = 64 * key_half + 8 * nt + 2 * (lane & 3);
        if (params.deterministic) {
          *reinterpret_cast<float2*>(dq + dim) = make_float2(acc_dq[nt][2 * half], acc_dq[nt][2 * half + 1]);
        } else {
          reduce_add2(dq + dim, acc_dq[nt][2 * half], acc_dq[nt][2 * half + 1]);
        }
      }
    }
  }

  // ---- KL: teacher, student, g = π - t, KL terms, dq_proxy; g and q_proxy stay staged ---------
  if (pb.with_kl) {
    const int base = state.stage_rows;
    const int slabs = (count + 15) / 16;
    for (int sl = 0; sl < slabs; ++sl) {
      float acc[2][4] = {};  // proxy scores: 16 group rows × this warp's 16 keys
      const int a_row = min(base + 16 * sl + (lane & 15), kStageRows - 1);
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, &smem.proxy_query[swizzle(a_row, 16 * ks + (lane >> 4) * 8)]);
        uint32_t b[4];
        ldmatrix_x4(b, &smem.proxy_key[swizzle(16 * warp + (lane & 7) + (lane >> 4) * 8,
                                               16 * ks + ((lane >> 3) & 1) * 8)]);
        mma_16816<T>(acc[0], a, b[0], b[1]);
        mma_16816<T>(acc[1], a, b[2], b[3]);
      }
      for (int half = 0; half < 2; ++half) {
        const int group_row = 16 * sl + (lane >> 2) + 8 * half;
        const bool row_valid = group_row < count;
        const int token = row_valid ? smem.group_token[group_row] : -1;
        const float proxy_lse = row_valid ? smem.group_proxy_lse[group_row] : 0.f;
        // Tile row of head m of this group row: slab, then M rows per group row.
        const int first_row = row_valid ? (group_row / per_slab) * kSlabRows + (group_row % per_slab) * M : 0;
        float kl = 0.f;
        for (int nt = 0; nt < 2; ++nt) {
          const int key = 16 * warp + 8 * nt + 2 * (lane & 3);
          float grad[2];
          for (int e = 0; e < 2; ++e) {
            grad[e] = 0.f;
            if (!row_valid || state.first_key + key + e > token) continue;
            const float log_student = acc[nt][2 * half + e] * pb.proxy_scale - proxy_lse;
            float teacher = 0.f;
            for (int m = 0; m < M; ++m) teacher += smem.prob32[(first_row + m) * kProbStride + key + e];
            teacher = teacher / float(M);
            grad[e] = expf(log_student) - teacher;
            if (teacher > 0.f) kl += teacher * (logf(teacher) - log_student);
          }
          const int stage_row = base + group_row;
          if (stage_row < kStageRows) {
            *reinterpret_cast<uint32_t*>(&smem.proxy_grad[swizzle(stage_row, key)]) = pack2<T>(grad[0], grad[1]);
          }
        }
        kl += __shfl_xor_sync(0xffffffffu, kl, 1);
        kl += __shfl_xor_sync(0xffffffffu, kl, 2);
        if ((lane & 3) == 0 && row_valid) smem.kl_part[group_row][warp] = kl;
      }
    }
    __syncthreads();
    if (tid < count) {
      float kl = 0.f;
      for (int w = 0; w < kWarps; ++w) kl += smem.kl_part[tid][w];
      const int64_t slot_row = ((state.batch * shape.num_proxy_heads + proxy_head) * shape.seqlen +
                                smem.group_token[tid]) * shape.top_k + smem.group_slot[tid];
      pb.ws.kl_partial[slot_row] = kl;
    }
    // dq_proxy = g k_proxy: warp owns 16 dims.
    for (int sl = 0; sl < slabs; ++sl) {
      float acc[2][4] = {};
      const int a_row = min(base + 16 * sl + (lane & 15), kStageRows - 1);
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, &smem.proxy_grad[swizzle(a_row, 16 * ks + (lane >> 4) * 8)]);
        uint32_t b[4];
        ldmatrix_x4_trans(b, &smem.proxy_key[swizzle(16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                     16 * warp + (lane >> 4) * 8)]);
        mma_16816<T>(acc[0], a, b[0], b[1]);
        mma_16816<T>(acc[1], a, b[2], b[3]);
      }
      for (int half = 0; half < 2; ++half) {
        const int group_row = 16 * sl + (lane >> 2) + 8 * half;
        if (group_row >= count) continue;
        const int token = smem.group_token[group_row];
        float* dq_proxy;
        if (params.deterministic) {
          const int64_t slot_row = ((state.batch * shape.num_proxy_heads + proxy_head) * shape.seqlen + token) *
                                       shape.top_k + smem.group_slot[group_row];
          dq_proxy = pb.ws.dq_proxy_accum + slot_row * kHeadDim;
        } else {
          dq_proxy = pb.ws.dq_proxy_accum +
                     ((state.batch * shape.seqlen + token) * shape.num_proxy_heads + proxy_head) * kHeadDim;
        }
        for (int nt = 0; nt < 2; ++nt) {
          const int dim = 16 * warp + 8 * nt + 2 * (lane & 3);
          if (params.deterministic) {
            *reinterpret_cast<float2*>(dq_proxy + dim) = make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]);
          } else {
            reduce_add2(dq_proxy + dim, acc[nt][2 * half], acc[nt][2 * half + 1]);
          }
        }
      }
    }
    state.stage_rows += count;
  }
  __syncthreads();  // the next tile overwrites the gathered tiles
}

// A work item: tiles [first_tile, end_tile) of unit (b, g, c), in proxy-head order.
template <typename T>
__device__ void run_item(const Problem& pb, SharedStorage& smem, int64_t unit, int item_in_unit) {
  const ProblemShape& shape = pb.params.fwd.shape;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  ItemState state;
  state.block = unit % pb.num_blocks;
  state.kv_head = int((unit / pb.num_blocks) % shape.num_kv_heads);
  state.batch = unit / (pb.num_blocks * shape.num_kv_heads);
  state.first_key = state.block * kBlockSize;
  state.stage_rows = 0;
  state.stage_proxy_head = -1;
  state.loaded_proxy_key_head = -1;

  load_key_block<T>(smem.key, pb.params.fwd.k, state.batch, state.first_key, state.kv_head, shape.seqlen);
  load_key_block<T>(smem.value, pb.params.fwd.v, state.batch, state.first_key, state.kv_head, shape.seqlen);
  if (pb.with_kl) {
    for (int e = threadIdx.x; e < kStageRows * kHeadDim / 8; e += kThreads) {
      reinterpret_cast<uint4*>(smem.proxy_grad)[e] = make_uint4(0, 0, 0, 0);
      reinterpret_cast<uint4*>(smem.proxy_query)[e] = make_uint4(0, 0, 0, 0);
    }
  }

  float acc_dk[16][4] = {};
  float acc_dv[16][4] = {};
  const int tiles = unit_tiles(pb, state.batch, state.kv_head, state.block);
  const int first_tile = item_in_unit * pb.tiles_per_item;
  const int end_tile = min(tiles, first_tile + pb.tiles_per_item);
  for (int tile = first_tile; tile < end_tile; ++tile) {
    // Which proxy head's list, and which of its entries.
    int rest = tile;
    int proxy_head = state.kv_head * pb.proxy_per_kv_head;
    int64_t list = 0;
    int list_count = 0;
    for (int q = 0; q < pb.proxy_per_kv_head; ++q, ++proxy_head) {
      list = (state.batch * shape.num_proxy_heads + proxy_head) * pb.num_blocks + state.block;
      list_count = pb.ws.list_count[list];
      const int list_tiles = (list_count + pb.group_rows_per_tile - 1) / pb.group_rows_per_tile;
      if (rest < list_tiles) break;
      rest -= list_tiles;
    }
    const int first_entry = rest * pb.group_rows_per_tile;
    const int count = min(pb.group_rows_per_tile, list_count - first_entry);
    run_tile<T>(pb, smem, state, proxy_head, pb.ws.entries + pb.ws.list_offset[list] + first_entry,
                count, acc_dk, acc_dv);
  }
  if (pb.with_kl && state.stage_rows > 0) flush_proxy_stage<T>(pb, smem, state);

  // dK, dV of the block (σ and the dtype applied by finish_key_grads).
  for (int half = 0; half < 2; ++half) {
    const int64_t key = state.first_key + 16 * warp + (lane >> 2) + 8 * half;
    if (key >= shape.seqlen) continue;
    const int64_t at = ((state.batch * shape.seqlen + key) * shape.num_kv_heads + state.kv_head) * kHeadDim;
    for (int nt = 0; nt < 16; ++nt) {
      const int dim = 8 * nt + 2 * (lane & 3);
      reduce_add2(pb.ws.dk_accum + at + dim, acc_dk[nt][2 * half], acc_dk[nt][2 * half + 1]);
      reduce_add2(pb.ws.dv_accum + at + dim, acc_dv[nt][2 * half], acc_dv[nt][2 * half + 1]);
    }
  }
}

// Persistent CTAs take work items from a shared counter (zeroed by the launcher).
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) backward_tiles_kernel(const Problem pb) {
  extern __shared__ unsigned char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 127) & ~uintptr_t(127));
  const ProblemShape& shape = pb.params.fwd.shape;
  const int64_t units = shape.batch * shape.num_kv_heads * pb.num_blocks;
  const int total_items = pb.ws.item_start[units];
  while (true) {
    if (threadIdx.x == 0) smem.item = atomicAdd(pb.ws.item_counter, 1);
    __syncthreads();
    const int item = smem.item;
    __syncthreads();
    if (item >= total_items) break;
    int64_t low = 0;  // the last unit whose first item is ≤ item
    int64_t high = units;
    while (high - low > 1) {
      const int64_t mid = (low + high) / 2;
      if (pb.ws.item_start[mid] <= item) {
        low = mid;
      } else {
        high = mid;
      }
    }
    run_item<T>(pb, smem, low, item - pb.ws.item_start[low]);
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// Finish: accumulators -> gradients in T. The query side in two kernels: without the deterministic
// mode each (b, i, head) row has one accumulator row, read by a half-warp, 8 dims per lane; in it a
// row sums its per-slot buffers, 4 dims per lane. The key side takes one row per warp.
// ---------------------------------------------------------------------------------------------
constexpr int kFinishRowsPerWarp = 4;   // query rows per warp of finish_query_grads_kernel
constexpr int kFinishHalfWarpRows = 8;  // query rows per warp of finish_query_rows_kernel

// values · factor rounded to T, one 8-byte store (out is 8-byte aligned: rows are 16-byte aligned).
template <typename T>
__device__ __forceinline__ void store4(T* out, const float (&values)[4], float factor) {
  union {
    T elements[4];
    uint2 bits;
  } packed;
#pragma unroll
  for (int e = 0; e < 4; ++e) packed.elements[e] = from_float<T>(values[e] * factor);
  *reinterpret_cast<uint2*>(out) = packed.bits;
}

__device__ __forceinline__ void add4(float (&acc)[4], const float* source) {
  const float4 x = *reinterpret_cast<const float4*>(source);
  acc[0] += x.x;
  acc[1] += x.y;
  acc[2] += x.z;
  acc[3] += x.w;
}

// Heads H (dq) then Hp (dq_proxy) per token, one accumulator row per output row: scaled fp16 sums
// (dq_half: 16 bytes per lane, the row's scale divided out) or fp32 sums (2 × 16 bytes). A warp
// takes 8 consecutive rows, two at a time (a half-warp each): a first pass issues every load of its
// rows (2 KB of fp16 or 4 KB of fp32 sums per warp), a second pass walks the rows again for the
// outputs. (4 dims per lane and 4 rows a warp at 76 registers kept 1 KB per warp in flight, 24 warps
// per SM: 1.75 TB/s.)
template <typename T>
__global__ void __launch_bounds__(kThreads, 4) finish_query_rows_kernel(const Problem pb) {
  const ProblemShape& shape = pb.params.fwd.shape;
  constexpr int kPasses = kFinishHalfWarpRows / 2;
  const int lane = threadIdx.x & 31;
  const int heads = shape.num_heads + shape.num_proxy_heads;
  const int64_t rows = int64_t(shape.batch) * shape.seqlen * heads;
  const int64_t first = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kFinishHalfWarpRows + lane / 16;
  if (first >= rows) return;
  const int dim = (lane % 16) * 8;
  const bool with_kl_grad = pb.params.kl_grad != nullptr;

  uint4 bits[kPasses][2];  // the row's sums: fp16 in [0], or fp32 in [0] and [1]
  float row_scale[kPasses];  // dq_half main-head rows: dq_scale[b, h, i], a power of two
  {
    TokenHeadCursor at(first, heads, shape.seqlen);
#pragma unroll
    for (int u = 0; u < kPasses; ++u) {
      bits[u][0] = bits[u][1] = make_uint4(0u, 0u, 0u, 0u);
      row_scale[u] = 1.f;
      if (first + 2 * u < rows) {
        const int64_t token_row = at.b * shape.seqlen + at.token;
        const float* sums = nullptr;
        if (at.head < shape.num_heads) {
          const int64_t element = (token_row * shape.num_heads + at.head) * kHeadDim + dim;
          if (pb.dq_half) {
            bits[u][0] = *reinterpret_cast<const uint4*>(reinterpret_cast<const __half*>(pb.ws.dq_accum) + element);
            row_scale[u] = pb.ws.dq_scale[(at.b * shape.num_heads + at.head) * shape.seqlen + at.token];
          } else {
            sums = pb.ws.dq_accum + element;
          }
        } else if (with_kl_grad) {
          sums = pb.ws.dq_proxy_accum + (token_row * shape.num_proxy_heads + (at.head - shape.num_heads)) * kHeadDim + dim;
        }
        if (sums != nullptr) {
          bits[u][0] = *reinterpret_cast<const uint4*>(sums);
          bits[u][1] = *reinterpret_cast<const uint4*>(sums + 4);
        }
      }
      at.advance(2, heads, shape.seqlen);
    }
  }

  const float kl_factor = kl_gradient_factor(pb.params, pb.proxy_scale);
  TokenHeadCursor at(first, heads, shape.seqlen);
#pragma unroll
  for (int u = 0; u < kPasses; ++u, at.advance(2, heads, shape.seqlen)) {
    if (first + 2 * u >= rows) break;
    const bool main_head = at.head < shape.num_heads;
    T* target = main_head ? strided<T>(pb.params.dq).row(at.b, at.token, at.head) + dim
                          : strided<T>(pb.params.dq_proxy).row(at.b, at.token, at.head - shape.num_heads) + dim;
    float values[8];
    float factor = kl_factor;
    if (main_head && pb.dq_half) {
      // 1 / 2^k exactly, by the exponent bits (row_scale is a normal power of two, config.h).
      factor = pb.softmax_scale * __int_as_float(0x7f000000 - __float_as_int(row_scale[u]));
      const __half* h = reinterpret_cast<const __half*>(&bits[u][0]);
#pragma unroll
      for (int e = 0; e < 8; ++e) values[e] = __half2float(h[e]);
    } else {
      if (main_head) factor = pb.softmax_scale;
      const float* f = reinterpret_cast<const float*>(&bits[u][0]);
#pragma unroll
      for (int e = 0; e < 8; ++e) values[e] = f[e];
    }
    union {
      T elements[8];
      uint4 bits;
    } packed;
#pragma unroll
    for (int e = 0; e < 8; ++e) packed.elements[e] = from_float<T>(values[e] * factor);
    *reinterpret_cast<uint4*>(target) = packed.bits;
  }
}

// Deterministic mode: heads H (dq) then Hp (dq_proxy) per token, each row the sum of its per-slot
// buffers in slot order (dq_proxy zero without kl_grad).
template <typename T>
__global__ void __launch_bounds__(kThreads) finish_query_grads_kernel(const Problem pb) {
  const ProblemShape& shape = pb.params.fwd.shape;
  const int lane = threadIdx.x & 31;
  const int heads = shape.num_heads + shape.num_proxy_heads;
  const int64_t rows = int64_t(shape.batch) * shape.seqlen * heads;
  const int64_t first = (int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kFinishRowsPerWarp;
  if (first >= rows) return;
  const int M = pb.heads_per_proxy;
  const int dim = lane * 4;
  const bool with_kl_grad = pb.params.kl_grad != nullptr;
  const float kl_factor = kl_gradient_factor(pb.params, pb.proxy_scale);

  TokenHeadCursor at(first, heads, shape.seqlen);
#pragma unroll 1
  for (int u = 0; u < kFinishRowsPerWarp && first + u < rows; ++u, at.advance(1, heads, shape.seqlen)) {
    const bool main_head = at.head < shape.num_heads;
    const int proxy_head = main_head ? at.head / M : at.head - shape.num_heads;
    T* target = main_head ? strided<T>(pb.params.dq).row(at.b, at.token, at.head) + dim
                          : strided<T>(pb.params.dq_proxy).row(at.b, at.token, proxy_head) + dim;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (main_head || with_kl_grad) {
      const int32_t* slots = block_idx_row(pb, at.b, proxy_head, at.token);
      const int64_t slot_row = ((at.b * shape.num_proxy_heads + proxy_head) * shape.seqlen + at.token) * shape.top_k;
      for (int slot = 0; slot < shape.top_k; ++slot) {
        if (!slot_valid(slots, slot, at.token, pb.num_blocks)) continue;
        if (main_head) {
          add4(acc, pb.ws.dq_accum + ((slot_row + slot) * M + at.head % M) * kHeadDim + dim);
        } else {
          add4(acc, pb.ws.dq_proxy_accum + (slot_row + slot) * kHeadDim + dim);
        }
      }
    }
    store4(target, acc, main_head ? pb.softmax_scale : kl_factor);
  }
}

// Heads Hkv (dk), Hkv (dv), then Hpk (dk_proxy, summed over its R proxy heads in order) per key.
template <typename T>
__global__ void __launch_bounds__(kThreads) finish_key_grads_kernel(const Problem pb) {
  const ProblemShape& shape = pb.params.fwd.shape;
  const int lane = threadIdx.x & 31;
  const int heads = 2 * shape.num_kv_heads + shape.num_proxy_kv_heads;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= shape.batch * shape.seqlen * heads) return;
  const int head = int(row % heads);
  const int64_t key = (row / heads) % shape.seqlen;
  const int64_t batch = row / (int64_t(heads) * shape.seqlen);
  const int dim = lane * 4;
  const int64_t token_row = batch * shape.seqlen + key;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (head < 2 * shape.num_kv_heads) {
    const int kv_head = head % shape.num_kv_heads;
    const bool is_dk = head < shape.num_kv_heads;
    add4(acc, (is_dk ? pb.ws.dk_accum : pb.ws.dv_accum) +
                  (token_row * shape.num_kv_heads + kv_head) * kHeadDim + dim);
    store4(strided<T>(is_dk ? pb.params.dk : pb.params.dv).row(batch, key, kv_head) + dim, acc,
           is_dk ? pb.softmax_scale : 1.f);
    return;
  }
  const int proxy_key_head = head - 2 * shape.num_kv_heads;
  const int ratio = shape.num_proxy_heads / shape.num_proxy_kv_heads;
  if (pb.params.kl_grad != nullptr) {
    for (int p = proxy_key_head * ratio; p < (proxy_key_head + 1) * ratio; ++p) {
      add4(acc, pb.ws.dk_proxy_accum + (token_row * shape.num_proxy_heads + p) * kHeadDim + dim);
    }
  }
  store4(strided<T>(pb.params.dk_proxy).row(batch, key, proxy_key_head) + dim, acc,
         kl_gradient_factor(pb.params, pb.proxy_scale));
}

// ---------------------------------------------------------------------------------------------
// Launcher
// ---------------------------------------------------------------------------------------------
inline Problem make_problem(const BackwardParams& params) {
  const ProblemShape& shape = params.fwd.shape;
  const bool dq_half = dq_half_sums(shape, params.fwd.dtype, params.deterministic);
  const WorkspaceLayout layout = workspace_layout(shape, params.deterministic, dq_half);
  char* base = static_cast<char*>(params.workspace);
  Problem pb;
  pb.params = params;
  pb.ws.chunk_counts = reinterpret_cast<int32_t*>(base + layout.chunk_counts);
  pb.ws.list_offset = reinterpret_cast<int64_t*>(base + layout.list_offset);
  pb.ws.list_count = reinterpret_cast<int32_t*>(base + layout.list_count);
  pb.ws.item_start = reinterpret_cast<int32_t*>(base + layout.item_start);
  pb.ws.item_counter = reinterpret_cast<int32_t*>(base + layout.item_counter);
  pb.ws.entries = reinterpret_cast<int32_t*>(base + layout.entries);
  pb.ws.delta = reinterpret_cast<float*>(base + layout.delta);
  pb.ws.dq_scale = reinterpret_cast<float*>(base + layout.dq_scale);
  pb.ws.kv_bound = reinterpret_cast<float*>(base + layout.kv_bound);
  pb.ws.dq_accum = reinterpret_cast<float*>(base + layout.dq_accum);
  pb.ws.dq_proxy_accum = reinterpret_cast<float*>(base + layout.dq_proxy_accum);
  pb.ws.dk_accum = reinterpret_cast<float*>(base + layout.dk_accum);
  pb.ws.dv_accum = reinterpret_cast<float*>(base + layout.dv_accum);
  pb.ws.tile_counters = reinterpret_cast<uint32_t*>(base + layout.tile_counters);
  pb.ws.dk_proxy_accum = reinterpret_cast<float*>(base + layout.dk_proxy_accum);
  pb.ws.kl_partial = reinterpret_cast<float*>(base + layout.kl_partial);
  pb.ws.kl_sums = reinterpret_cast<float*>(base + layout.kl_sums);
  pb.ws.tile_bounds = reinterpret_cast<uint32_t*>(base + layout.tile_bounds);
  pb.ws.dealt_tiles = reinterpret_cast<uint4*>(base + layout.dealt_tiles);
  pb.ws.proxy_grad = base + layout.proxy_grad;
  pb.num_blocks = shape.num_blocks();
  pb.num_chunks = ceil_div(shape.seqlen, kRowsPerChunk);
  pb.softmax_scale = float(effective_scale(params.fwd.softmax_scale, shape.head_dim));
  pb.scale_log2 = pb.softmax_scale * kLog2e;
  pb.proxy_scale = float(effective_scale(params.fwd.proxy_scale, shape.proxy_head_dim));
  pb.heads_per_proxy = shape.heads_per_proxy();
  pb.group_rows_per_slab = group_rows_per_slab(pb.heads_per_proxy);
  pb.group_rows_per_tile = group_rows_per_tile(pb.heads_per_proxy);
  pb.proxy_per_kv_head = shape.num_proxy_heads / shape.num_kv_heads;
  pb.tiles_per_item = params.deterministic ? (1 << 30) : kTilesPerItem;
  pb.with_kl = params.kl_grad != nullptr || params.fwd.kl != nullptr;
  pb.dq_half = dq_half;
  return pb;
}

template <typename T>
Status finish(const Problem& pb, cudaStream_t stream);

template <typename T>
Status run_backward(const BackwardParams& params, cudaStream_t stream) {
  const ProblemShape& shape = params.fwd.shape;
  if (params.fwd.mode != Mode::kSparse) {
    return {StatusCode::kUnsupported,
            "fwd.mode: the backward of warmup mode (dense causal, SPEC.md §5) is not built yet"};
  }
  if (const Limit limit = sparse_limit(shape, params.deterministic)) return unsupported(limit);
  const Problem pb = make_problem(params);
  const WorkspaceLayout layout = workspace_layout(shape, params.deterministic, pb.dq_half);
  char* base = static_cast<char*>(params.workspace);

  // ---- zero the accumulators: one range of the layout ---------------------------------------------
  // [dq_accum, dk_accum) holds dQ and dq_proxy (per-slot buffers, fully written, in deterministic
  // mode); [dk_accum, dk_proxy_accum) dK, dV and the tile counters; [dk_proxy_accum, kl_sums)
  // dk_proxy and the KL terms. With the scaled fp16 dQ sums the range starts at kv_bound, just
  // before dq_accum.
  const size_t zero_end = pb.with_kl ? layout.kl_sums : layout.dk_proxy_accum;
  const size_t zero_begin = pb.dq_half ? layout.kv_bound : params.deterministic ? layout.dk_accum : layout.dq_accum;
  FLASHMSA_BACKWARD_CHECK(cudaMemsetAsync(base + zero_begin, 0, zero_end - zero_begin, stream), "memset");

  // ---- Δ (and the dQ row scales) and the reverse index ------------------------------------------
  DqScaleArgs scale_args;
  if (pb.dq_half) {
    scale_args.scale = pb.ws.dq_scale;
    scale_args.kv_bound = pb.ws.kv_bound;
    scale_args.factor = 2.f * pb.softmax_scale;
    scale_args.target = kDqScaleTarget;
    scale_args.exponent_limit = kDqScaleExponentLimit;
  }
  FLASHMSA_BACKWARD_CHECK(launch_delta<T>(params, pb.ws.delta, stream, scale_args), "delta");

  if (pipelined_supported(pb.heads_per_proxy, params.deterministic)) {
    // The wgmma kernel walks the forward's schedule: no reverse index of its own.
    if (Status status = run_pipelined_tiles<T>(pb, stream); !status.ok()) return status;
    return finish<T>(pb, stream);
  }
  FLASHMSA_BACKWARD_CHECK(cudaMemsetAsync(pb.ws.item_counter, 0, 4, stream), "memset");  // work-item counter
  if (Status status = build_schedule(pb, stream); !status.ok()) return status;

  // ---- the tile kernel: one persistent CTA per SM -------------------------------------------------
  int device = 0;
  int sm_count = 0;
  FLASHMSA_BACKWARD_CHECK(current_device_sms(&device, &sm_count), "device");
  FLASHMSA_BACKWARD_CHECK(set_max_dynamic_smem(reinterpret_cast<const void*>(backward_tiles_kernel<T>), device,
                                               int(kSmemBytes)),
                          "backward_tiles smem");
  backward_tiles_kernel<T><<<unsigned(sm_count), kThreads, kSmemBytes, stream>>>(pb);
  FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "backward_tiles");
  return finish<T>(pb, stream);
}

// fp32 accumulators -> gradients in T, then the KL value.
template <typename T>
Status finish(const Problem& pb, cudaStream_t stream) {
  const BackwardParams& params = pb.params;
  const ProblemShape& shape = params.fwd.shape;
  const int64_t tokens = shape.batch * shape.seqlen;
  const int64_t query_rows = tokens * (shape.num_heads + shape.num_proxy_heads);
  if (params.deterministic) {
    finish_query_grads_kernel<T><<<unsigned(ceil_div(query_rows, int64_t(kWarps) * kFinishRowsPerWarp)), kThreads, 0,
                                    stream>>>(pb);
    FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "finish_query_grads");
  } else {
    finish_query_rows_kernel<T><<<unsigned(ceil_div(query_rows, int64_t(kWarps) * kFinishHalfWarpRows)), kThreads, 0,
                                   stream>>>(pb);
    FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "finish_query_rows");
  }
  const int64_t key_rows = tokens * (2 * shape.num_kv_heads + shape.num_proxy_kv_heads);
  finish_key_grads_kernel<T><<<unsigned(ceil_div(key_rows, kWarps)), kThreads, 0, stream>>>(pb);
  FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "finish_key_grads");
  if (params.fwd.kl != nullptr) return reduce_kl(pb, stream);
  return Status::Ok();
}

}  // namespace flashmsa::kernels::backward
