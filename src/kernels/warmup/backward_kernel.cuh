// Warmup backward (SPEC.md §3-§5 with T = every visible token): dq, dk, dv of dense causal
// attention, the KL gradient to q_proxy and k_proxy, and the KL value written to fwd.kl.
//
// Comes after: forward_kernel.cuh (out, lse, proxy_lse). Constants and layouts: config.h.
// Pipeline on one stream, no host synchronisation (CUDA-graph capturable):
//   delta_kernel        Δ_hi = ⟨O_hi, dO_hi⟩
//   dq_kernel           query-tile outer: a tile is 64 rows = ⌊64/M⌋ tokens × the M heads of proxy
//                       head p; per step of 64 keys (K, V, k_proxy two stages deep):
//                         S = QKᵀ, dP = dO Vᵀ → P, dS (mma.sync m16n8k16), dQ += dS K,
//                         teacher t = mean of P over the M heads (all threads), proxy scores → π,
//                         g = π − t, KL terms, dq_proxy += g k_proxy.
//                       dQ, dq_proxy and the per-row KL sums stay in registers, written once.
//   dkdv_kernel         key-block outer: 64 keys of KV head g; the tiles (as above) of its proxy
//                       heads with tokens ≥ the block stream two stages deep; per tile P, dS, g as
//                       above and dV += Pᵀ dO, dK += dSᵀ Q, dk_proxy(p) += gᵀ q_proxy, all in
//                       registers; dk_proxy per proxy head to an fp32 buffer, dK, dV written once.
//   finish_proxy_grad   dk_proxy = ḡσp/n · Σ over the R proxy heads of a proxy key head, in order.
//   reduce_kl_*         ordered two-pass sum of the per-row KL terms / (B·Hp·S) → fwd.kl.
// Every output element is written by exactly one thread with a sum in a fixed order, so every run
// is bitwise identical (deterministic mode needs nothing more). The price: P and dS are computed
// twice (7 tile products instead of 5).
#pragma once

#include "kernels/backward/pipelined_kernel.cuh"
#include "kernels/common/backward_common.cuh"
#include "kernels/warmup/common.cuh"

namespace flashmsa::kernels::warmup {

// Everything the backward kernels read besides the tensors.
struct BackwardArgs {
  BackwardParams params;
  float* delta;           // [b, h, s]
  float* dk_proxy_accum;  // [b, s, hp, di]
  float* dq_proxy_accum;  // [b, s, hp, di] (KL-only backward)
  float* kl_rows;         // [b, hp, s]
  float* kl_sums;         // [kKlSumBlocks]
  float softmax_scale;    // σ
  float scale_log2;       // σ · log2(e)
  float proxy_scale;      // σp
  int heads_per_proxy;    // M
  int tokens_per_tile;    // ⌊64 / M⌋
  int proxy_per_kv;       // Hp / Hkv
  int proxy_ratio;        // R = Hp / Hpk
  int64_t query_chunks;   // ⌈S / tokens_per_tile⌉
  int64_t key_blocks;     // ⌈S / 64⌉
  bool with_kl;           // KL gradient or KL value requested
};

// ---------------------------------------------------------------------------------------------
// Tile pieces shared by the two kernels. Warp w of 8: slab = w % 4 (16 rows), half = w / 4.
// ---------------------------------------------------------------------------------------------

// Row metadata of a tile (tokens first_token …, proxy head p): tile row r → token, LSE·log2(e), Δ;
// group row r → token, proxy LSE. Invalid rows get token -1. Threads 0 … 63.
__device__ __forceinline__ void load_row_meta(const BackwardArgs& args, int64_t b, int proxy_head, int first_token,
                                              int* row_token, float* row_lse, float* row_delta,
                                              int* group_token, float* group_proxy_lse) {
  const ProblemShape& shape = args.params.fwd.shape;
  const int r = threadIdx.x;
  if (r >= kBackwardRows) return;
  const int M = args.heads_per_proxy;
  const int seqlen = int(shape.seqlen);
  const int token = first_token + r / M;
  const bool valid = r < args.tokens_per_tile * M && token < seqlen;
  const int64_t at = (b * shape.num_heads + proxy_head * M + r % M) * shape.seqlen + token;
  row_token[r] = valid ? token : -1;
  row_lse[r] = valid ? args.params.fwd.lse[at] * kLog2e : 0.f;
  row_delta[r] = valid ? args.delta[at] : 0.f;
  const int group_row_token = first_token + r;
  const bool group_valid = r < args.tokens_per_tile && group_row_token < seqlen;
  group_token[r] = group_valid ? group_row_token : -1;
  group_proxy_lse[r] =
      group_valid && args.with_kl
          ? args.params.fwd.proxy_lse[(b * shape.num_proxy_heads + proxy_head) * shape.seqlen + group_row_token]
          : 0.f;
}

// cp.async of the tile's Q, dO rows (64) and, with the KL, its q_proxy rows (64, zero past the
// tile's tokens).
template <typename T>
__device__ __forceinline__ void load_query_tile(const BackwardArgs& args, int64_t b, int proxy_head,
                                                int first_token, uint16_t* query, uint16_t* dout,
                                                uint16_t* proxy_query) {
  const BackwardParams& params = args.params;
  const int M = args.heads_per_proxy;
  const int seqlen = int(params.fwd.shape.seqlen);
  const Strided<const T> q = strided<const T>(params.fwd.q);
  const Strided<const T> dO = strided<const T>(params.dout);
  const Strided<const T> q_proxy = strided<const T>(params.fwd.q_proxy);
  for (int index = threadIdx.x; index < kBackwardRows * 16; index += kBackwardThreads) {
    const int row = index >> 4;
    const int col = (index & 15) * 8;
    const int token = first_token + row / M;
    const bool valid = row < args.tokens_per_tile * M && token < seqlen;
    const int head = proxy_head * M + row % M;
    ptx::cp_async_16(query + swizzle<kHeadDim>(row, col), valid ? q.row(b, token, head) + col : q.ptr, valid);
    ptx::cp_async_16(dout + swizzle<kHeadDim>(row, col), valid ? dO.row(b, token, head) + col : dO.ptr, valid);
    if (args.with_kl) {
      const int group_row_token = first_token + row;
      const bool group_valid = row < args.tokens_per_tile && group_row_token < seqlen;
      ptx::cp_async_16(proxy_query + swizzle<kHeadDim>(row, col),
                       group_valid ? q_proxy.row(b, group_row_token, proxy_head) + col : q_proxy.ptr, group_valid);
    }
  }
}

// S = Q Kᵀ and dP = dO Vᵀ for this warp's 16 rows × 32 keys, then P = exp(S σ − LSE) on j ≤ i and
// dS = P (dP − Δ): dS (and P when `prob` is non-null) to shared memory in T, P in fp32 for the
// teacher when the KL runs.
template <typename T>
__device__ __forceinline__ void probs_and_dscores(const BackwardArgs& args, const uint16_t* query,
                                                  const uint16_t* dout, const uint16_t* key, const uint16_t* value,
                                                  const int* row_token, const float* row_lse,
                                                  const float* row_delta, int first_key, uint16_t* prob,
                                                  uint16_t* dscore, float* prob32) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int slab = warp & 3;
  const int key_half = warp >> 2;
  float acc_s[4][4] = {};
  float acc_dp[4][4] = {};
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    uint32_t a_q[4];
    uint32_t a_do[4];
    const int a_offset = swizzle<kHeadDim>(16 * slab + (lane & 15), 16 * ks + (lane >> 4) * 8);
    ptx::ldmatrix_x4(a_q, query + a_offset);
    ptx::ldmatrix_x4(a_do, dout + a_offset);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      const int b_offset =
          swizzle<kHeadDim>(32 * key_half + 16 * np + (lane & 7) + (lane >> 4) * 8, 16 * ks + ((lane >> 3) & 1) * 8);
      uint32_t bfrag[4];
      ptx::ldmatrix_x4(bfrag, key + b_offset);
      ptx::mma_16816<T>(acc_s[2 * np], a_q, bfrag[0], bfrag[1]);
      ptx::mma_16816<T>(acc_s[2 * np + 1], a_q, bfrag[2], bfrag[3]);
      ptx::ldmatrix_x4(bfrag, value + b_offset);
      ptx::mma_16816<T>(acc_dp[2 * np], a_do, bfrag[0], bfrag[1]);
      ptx::mma_16816<T>(acc_dp[2 * np + 1], a_do, bfrag[2], bfrag[3]);
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * slab + (lane >> 2) + 8 * half;
    const int token = row_token[row];
    const float lse = row_lse[row];
    const float delta = row_delta[row];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int key_col = 32 * key_half + 8 * nt + 2 * (lane & 3);
      float p[2];
      float ds[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = token >= 0 && first_key + key_col + e <= token;
        p[e] = valid ? exp2f(acc_s[nt][2 * half + e] * args.scale_log2 - lse) : 0.f;
        ds[e] = p[e] * (acc_dp[nt][2 * half + e] - delta);
      }
      *reinterpret_cast<uint32_t*>(dscore + swizzle<kKeyStep>(row, key_col)) = ptx::pack2<T>(ds[0], ds[1]);
      if (prob != nullptr) {
        *reinterpret_cast<uint32_t*>(prob + swizzle<kKeyStep>(row, key_col)) = ptx::pack2<T>(p[0], p[1]);
      }
      if (args.with_kl) {
        *reinterpret_cast<float2*>(prob32 + row * kProbStride + key_col) = make_float2(p[0], p[1]);
      }
    }
  }
}

// The teacher t = (1/M) Σ_m P over the M heads of each group row of the tile (all threads, one
// (group row, key) each), written over the group's first fp32 P row: only the thread of that
// (group row, key) reads that column of those rows.
__device__ __forceinline__ void teacher_means(const BackwardArgs& args, float* prob32) {
  const int M = args.heads_per_proxy;
  const float inverse_m = 1.f / float(M);
  for (int index = threadIdx.x; index < args.tokens_per_tile * kKeyStep; index += kBackwardThreads) {
    float* column = prob32 + (index / kKeyStep) * M * kProbStride + index % kKeyStep;
    float sum = 0.f;
    for (int m = 0; m < M; ++m) sum += column[m * kProbStride];
    column[0] = sum * inverse_m;
  }
}

// The KL step for this warp's 16 group rows × 32 keys (warps whose slab holds group rows): proxy
// scores s = q_proxy k_proxyᵀ, π = exp(s σp − PLSE), t from teacher_means(), g = π − t to shared
// memory in T; the KL terms t (log t − log π) are added to kl_sum[half].
template <typename T>
__device__ __forceinline__ void proxy_grads(const BackwardArgs& args, const uint16_t* proxy_query,
                                            const uint16_t* proxy_key, const int* group_token,
                                            const float* group_proxy_lse, const float* prob32, int first_key,
                                            uint16_t* proxy_grad, float (&kl_sum)[2]) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int slab = warp & 3;
  const int key_half = warp >> 2;
  const int M = args.heads_per_proxy;
  float acc[4][4] = {};
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    uint32_t a[4];
    ptx::ldmatrix_x4(a, proxy_query + swizzle<kHeadDim>(16 * slab + (lane & 15), 16 * ks + (lane >> 4) * 8));
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t bfrag[4];
      ptx::ldmatrix_x4(bfrag, proxy_key + swizzle<kHeadDim>(32 * key_half + 16 * np + (lane & 7) + (lane >> 4) * 8,
                                                            16 * ks + ((lane >> 3) & 1) * 8));
      ptx::mma_16816<T>(acc[2 * np], a, bfrag[0], bfrag[1]);
      ptx::mma_16816<T>(acc[2 * np + 1], a, bfrag[2], bfrag[3]);
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int group_row = 16 * slab + (lane >> 2) + 8 * half;
    const int token = group_token[group_row];
    const float proxy_lse = group_proxy_lse[group_row];
    const float* teachers = prob32 + group_row * M * kProbStride;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int key_col = 32 * key_half + 8 * nt + 2 * (lane & 3);
      float grad[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        grad[e] = 0.f;
        if (token >= 0 && first_key + key_col + e <= token) {
          const float log_student = acc[nt][2 * half + e] * args.proxy_scale - proxy_lse;
          const float teacher = teachers[key_col + e];
          grad[e] = expf(log_student) - teacher;
          if (teacher > 0.f) kl_sum[half] += teacher * (logf(teacher) - log_student);
        }
      }
      *reinterpret_cast<uint32_t*>(proxy_grad + swizzle<kKeyStep>(group_row, key_col)) =
          ptx::pack2<T>(grad[0], grad[1]);
    }
  }
}

// acc (16 rows × 64 dims, dims 64·half …) += A (16 rows × 64 keys, from a [rows][64] tile) ·
// B (64 keys × 128 dims, from a [keys][128] tile): dQ = dS K and dq_proxy = g k_proxy.
// acc (16 rows × this warp's 64 dims, dims 64·(warp / 4) …) += a (the A fragment of k-step ks) ·
// rows 16·ks … of B (a [rows][128 dims] tile).
template <typename T>
__device__ __forceinline__ void times_dims(const uint32_t (&a)[4], const uint16_t* b_tile, int ks,
                                           float (&acc)[8][4]) {
  const int lane = threadIdx.x & 31;
  const int dim_half = (threadIdx.x >> 5) >> 2;
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    uint32_t bfrag[4];
    ptx::ldmatrix_x4_trans(bfrag, b_tile + swizzle<kHeadDim>(16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                             64 * dim_half + 16 * np + (lane >> 4) * 8));
    ptx::mma_16816<T>(acc[2 * np], a, bfrag[0], bfrag[1]);
    ptx::mma_16816<T>(acc[2 * np + 1], a, bfrag[2], bfrag[3]);
  }
}

template <typename T>
__device__ __forceinline__ void rows_times_keys(const uint16_t* a_tile, const uint16_t* b_tile, float (&acc)[8][4]) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int slab = warp & 3;
#pragma unroll
  for (int ks = 0; ks < kKeyStep / 16; ++ks) {
    uint32_t a[4];
    ptx::ldmatrix_x4(a, a_tile + swizzle<kKeyStep>(16 * slab + (lane & 15), 16 * ks + (lane >> 4) * 8));
    times_dims<T>(a, b_tile, ks, acc);
  }
}

// acc (16 keys, keys 16·slab …, × 64 dims, dims 64·half …) += Aᵀ (from a [rows][64 keys] tile, its
// first 16·row_steps rows) · B (rows × 128 dims): dV = Pᵀ dO, dK = dSᵀ Q, dk_proxy = gᵀ q_proxy.
template <typename T>
__device__ __forceinline__ void keys_times_rows(const uint16_t* a_tile, const uint16_t* b_tile, int row_steps,
                                                float (&acc)[8][4]) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int key_slab = warp & 3;
  for (int ks = 0; ks < row_steps; ++ks) {
    uint32_t a[4];
    ptx::ldmatrix_x4_trans(a, a_tile + swizzle<kKeyStep>(16 * ks + (lane & 7) + (lane >> 4) * 8,
                                                         16 * key_slab + ((lane >> 3) & 1) * 8));
    times_dims<T>(a, b_tile, ks, acc);
  }
}

// ---------------------------------------------------------------------------------------------
// dq kernel: one CTA per query tile (chunk, b, p), last chunk first.
// ---------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kBackwardThreads, 1) dq_kernel(const BackwardArgs args) {
  extern __shared__ unsigned char smem_raw[];
  DqStorage& smem = *reinterpret_cast<DqStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 127) & ~uintptr_t(127));
  const BackwardParams& params = args.params;
  const ProblemShape& shape = params.fwd.shape;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int slab = warp & 3;
  const int dim_half = warp >> 2;
  const int M = args.heads_per_proxy;
  const int seqlen = int(shape.seqlen);

  // ---- tile scheduler ----------------------------------------------------------------------------
  const int64_t per_chunk = shape.batch * shape.num_proxy_heads;
  const int64_t chunk = args.query_chunks - 1 - int64_t(blockIdx.x) / per_chunk;
  const int proxy_head = int(int64_t(blockIdx.x) % per_chunk % shape.num_proxy_heads);
  const int64_t b = int64_t(blockIdx.x) % per_chunk / shape.num_proxy_heads;
  const int first_token = int(chunk) * args.tokens_per_tile;
  const int last_token = min(first_token + args.tokens_per_tile, seqlen) - 1;
  const int kv_head = proxy_head / args.proxy_per_kv;
  const int proxy_key_head = proxy_head / args.proxy_ratio;
  const int steps = last_token / kKeyStep + 1;
  const bool proxy_slab = args.with_kl && 16 * slab < args.tokens_per_tile;  // warp-uniform

  // ---- gather: row metadata, Q, dO, q_proxy, then the first key step --------------------------
  load_row_meta(args, b, proxy_head, first_token, smem.row_token, smem.row_lse, smem.row_delta, smem.group_token,
                smem.group_proxy_lse);
  load_query_tile<T>(args, b, proxy_head, first_token, smem.query, smem.dout, smem.proxy_query);
  const Strided<const T> k = strided<const T>(params.fwd.k);
  const Strided<const T> v = strided<const T>(params.fwd.v);
  const Strided<const T> k_proxy = strided<const T>(params.fwd.k_proxy);
  auto load_step = [&](int step) {
    const int stage = step & 1;
    const int64_t first_key = int64_t(step) * kKeyStep;
    load_token_rows<T>(smem.key[stage], k, b, first_key, kv_head, seqlen, kKeyStep, kBackwardThreads);
    load_token_rows<T>(smem.value[stage], v, b, first_key, kv_head, seqlen, kKeyStep, kBackwardThreads);
    if (args.with_kl) {
      load_token_rows<T>(smem.proxy_key[stage], k_proxy, b, first_key, proxy_key_head, seqlen, kKeyStep,
                         kBackwardThreads);
    }
  };
  load_step(0);
  ptx::cp_async_commit();

  float acc_dq[8][4] = {};
  float acc_dq_proxy[8][4] = {};
  float kl_sum[2] = {0.f, 0.f};

  // ---- mainloop: 64 keys per step --------------------------------------------------------------
#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    if (step + 1 < steps) {
      load_step(step + 1);
      ptx::cp_async_commit();
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();
    const int first_key = step * kKeyStep;
    probs_and_dscores<T>(args, smem.query, smem.dout, smem.key[stage], smem.value[stage], smem.row_token,
                         smem.row_lse, smem.row_delta, first_key, nullptr, smem.dscore, smem.prob32);
    __syncthreads();
    rows_times_keys<T>(smem.dscore, smem.key[stage], acc_dq);
    if (args.with_kl) {
      teacher_means(args, smem.prob32);
      __syncthreads();
      if (proxy_slab) {
        proxy_grads<T>(args, smem.proxy_query, smem.proxy_key[stage], smem.group_token, smem.group_proxy_lse,
                       smem.prob32, first_key, smem.proxy_grad, kl_sum);
      }
      __syncthreads();
      if (proxy_slab) rows_times_keys<T>(smem.proxy_grad, smem.proxy_key[stage], acc_dq_proxy);
    }
    __syncthreads();  // the next step overwrites dS, P, t, g and this stage
  }

  // ---- epilogue: dQ = σ acc, dq_proxy = ḡσp/n acc, the KL sum of each group row ----------------
  const Strided<T> dq = strided<T>(params.dq);
  const Strided<T> dq_proxy = strided<T>(params.dq_proxy);
  const float factor = kl_gradient_factor(args.params, args.proxy_scale);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * slab + (lane >> 2) + 8 * half;
    const int token = smem.row_token[row];
    if (token < 0) continue;
    T* dst = dq.row(b, token, proxy_head * M + row % M);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int dim = 64 * dim_half + 8 * nt + 2 * (lane & 3);
      *reinterpret_cast<uint32_t*>(dst + dim) =
          ptx::pack2<T>(acc_dq[nt][2 * half] * args.softmax_scale, acc_dq[nt][2 * half + 1] * args.softmax_scale);
    }
  }
  if (16 * slab < args.tokens_per_tile) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int group_row = 16 * slab + (lane >> 2) + 8 * half;
      const int token = smem.group_token[group_row];
      if (token < 0) continue;
      T* dst = dq_proxy.row(b, token, proxy_head);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int dim = 64 * dim_half + 8 * nt + 2 * (lane & 3);
        const bool with_grad = params.kl_grad != nullptr;
        *reinterpret_cast<uint32_t*>(dst + dim) =
            ptx::pack2<T>(with_grad ? acc_dq_proxy[nt][2 * half] * factor : 0.f,
                          with_grad ? acc_dq_proxy[nt][2 * half + 1] * factor : 0.f);
      }
    }
  }
  if (args.with_kl && params.fwd.kl != nullptr) {
    if (proxy_slab) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float sum = quad_sum(kl_sum[half]);
        if ((lane & 3) == 0) smem.kl_part[16 * slab + (lane >> 2) + 8 * half][dim_half] = sum;
      }
    }
    __syncthreads();
    if (tid < args.tokens_per_tile && smem.group_token[tid] >= 0) {
      args.kl_rows[(b * shape.num_proxy_heads + proxy_head) * shape.seqlen + smem.group_token[tid]] =
          smem.kl_part[tid][0] + smem.kl_part[tid][1];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dkdv kernel: one CTA per (key block of 64, b, KV head g), first blocks (the longest) first.
// ---------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kBackwardThreads, 1) dkdv_kernel(const BackwardArgs args) {
  extern __shared__ unsigned char smem_raw[];
  DkdvStorage& smem =
      *reinterpret_cast<DkdvStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 127) & ~uintptr_t(127));
  const BackwardParams& params = args.params;
  const ProblemShape& shape = params.fwd.shape;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int key_slab = warp & 3;
  const int dim_half = warp >> 2;
  const int seqlen = int(shape.seqlen);
  const int tokens_per_tile = args.tokens_per_tile;

  // ---- unit: (key block, b, g) and its tiles (proxy head major, then tokens) ---------------------
  const int64_t per_block = shape.batch * shape.num_kv_heads;
  const int first_key = int(int64_t(blockIdx.x) / per_block) * kKeyStep;
  const int kv_head = int(int64_t(blockIdx.x) % per_block % shape.num_kv_heads);
  const int64_t b = int64_t(blockIdx.x) % per_block / shape.num_kv_heads;
  const int chunks_per_head = int(ceil_div(seqlen - first_key, tokens_per_tile));
  const int tiles = chunks_per_head * args.proxy_per_kv;
  const int first_proxy_head = kv_head * args.proxy_per_kv;
  const bool proxy_slab = args.with_kl && 16 * (warp & 3) < tokens_per_tile;  // warp-uniform
  const int group_row_steps = (tokens_per_tile + 15) / 16;

  const Strided<const T> k_proxy = strided<const T>(params.fwd.k_proxy);
  load_token_rows<T>(smem.key, strided<const T>(params.fwd.k), b, first_key, kv_head, seqlen, kKeyStep,
                     kBackwardThreads);
  load_token_rows<T>(smem.value, strided<const T>(params.fwd.v), b, first_key, kv_head, seqlen, kKeyStep,
                     kBackwardThreads);
  int loaded_proxy_key_head = first_proxy_head / args.proxy_ratio;
  if (args.with_kl) {
    load_token_rows<T>(smem.proxy_key, k_proxy, b, first_key, loaded_proxy_key_head, seqlen, kKeyStep,
                       kBackwardThreads);
  }
  auto prefetch = [&](int tile) {
    const int stage = tile & 1;
    const int proxy_head = first_proxy_head + tile / chunks_per_head;
    const int first_token = first_key + (tile % chunks_per_head) * tokens_per_tile;
    load_row_meta(args, b, proxy_head, first_token, smem.row_token[stage], smem.row_lse[stage],
                  smem.row_delta[stage], smem.group_token[stage], smem.group_proxy_lse[stage]);
    load_query_tile<T>(args, b, proxy_head, first_token, smem.query[stage], smem.dout[stage],
                       smem.proxy_query[stage]);
  };
  prefetch(0);
  ptx::cp_async_commit();

  float acc_dk[8][4] = {};
  float acc_dv[8][4] = {};
  float acc_dk_proxy[8][4] = {};
  float kl_terms_unread[2] = {0.f, 0.f};
  int current_proxy_head = first_proxy_head;

  // dk_proxy of proxy head p for this block's keys, to the fp32 buffer (one writer per entry).
  auto flush_dk_proxy = [&](int proxy_head) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = first_key + 16 * key_slab + (lane >> 2) + 8 * half;
      if (key >= seqlen) continue;
      float* dst = args.dk_proxy_accum + ((b * shape.seqlen + key) * shape.num_proxy_heads + proxy_head) * kHeadDim;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int dim = 64 * dim_half + 8 * nt + 2 * (lane & 3);
        *reinterpret_cast<float2*>(dst + dim) = make_float2(acc_dk_proxy[nt][2 * half], acc_dk_proxy[nt][2 * half + 1]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk_proxy[nt][e] = 0.f;
    }
  };

  // ---- mainloop over the unit's tiles -------------------------------------------------------------
#pragma unroll 1
  for (int tile = 0; tile < tiles; ++tile) {
    const int stage = tile & 1;
    const int proxy_head = first_proxy_head + tile / chunks_per_head;
    if (tile + 1 < tiles) {
      prefetch(tile + 1);
      ptx::cp_async_commit();
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();
    if (proxy_head != current_proxy_head) {  // block-uniform
      if (args.with_kl) {
        flush_dk_proxy(current_proxy_head);
        const int proxy_key_head = proxy_head / args.proxy_ratio;
        if (proxy_key_head != loaded_proxy_key_head) {
          load_token_rows<T>(smem.proxy_key, k_proxy, b, first_key, proxy_key_head, seqlen, kKeyStep,
                             kBackwardThreads);
          ptx::cp_async_commit();
          ptx::cp_async_wait<0>();
          __syncthreads();
          loaded_proxy_key_head = proxy_key_head;
        }
      }
      current_proxy_head = proxy_head;
    }

    probs_and_dscores<T>(args, smem.query[stage], smem.dout[stage], smem.key, smem.value, smem.row_token[stage],
                         smem.row_lse[stage], smem.row_delta[stage], first_key, smem.prob, smem.dscore,
                         smem.prob32);
    __syncthreads();
    keys_times_rows<T>(smem.prob, smem.dout[stage], kBackwardRows / 16, acc_dv);
    keys_times_rows<T>(smem.dscore, smem.query[stage], kBackwardRows / 16, acc_dk);
    if (args.with_kl) {
      teacher_means(args, smem.prob32);
      __syncthreads();
      if (proxy_slab) {
        proxy_grads<T>(args, smem.proxy_query[stage], smem.proxy_key, smem.group_token[stage],
                       smem.group_proxy_lse[stage], smem.prob32, first_key, smem.proxy_grad, kl_terms_unread);
      }
      __syncthreads();
      keys_times_rows<T>(smem.proxy_grad, smem.proxy_query[stage], group_row_steps, acc_dk_proxy);
    }
    __syncthreads();  // the next tile overwrites P, dS, t, g and this stage
  }
  if (args.with_kl) flush_dk_proxy(current_proxy_head);

  // ---- epilogue: dK = σ acc, dV = acc ------------------------------------------------------------
  const Strided<T> dk = strided<T>(params.dk);
  const Strided<T> dv = strided<T>(params.dv);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = first_key + 16 * key_slab + (lane >> 2) + 8 * half;
    if (key >= seqlen) continue;
    T* dk_row = dk.row(b, key, kv_head);
    T* dv_row = dv.row(b, key, kv_head);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int dim = 64 * dim_half + 8 * nt + 2 * (lane & 3);
      *reinterpret_cast<uint32_t*>(dk_row + dim) =
          ptx::pack2<T>(acc_dk[nt][2 * half] * args.softmax_scale, acc_dk[nt][2 * half + 1] * args.softmax_scale);
      *reinterpret_cast<uint32_t*>(dv_row + dim) = ptx::pack2<T>(acc_dv[nt][2 * half], acc_dv[nt][2 * half + 1]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A proxy gradient from its fp32 accumulator [b, s, hp, di]: dst[b, s, head] = ḡσp/n · Σ of the
// `ratio` proxy heads head·ratio … in order. dk_proxy: head = proxy key head, ratio R; dq_proxy of
// the KL-only backward: ratio 1. Zero without kl_grad. One warp per (b, token, head).
// ---------------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kBackwardThreads)
    finish_proxy_grad_kernel(const BackwardArgs args, const float* accum, TensorRef dst_ref, int heads, int ratio) {
  const ProblemShape& shape = args.params.fwd.shape;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kBackwardWarps + (threadIdx.x >> 5);
  if (row >= shape.batch * shape.seqlen * heads) return;
  const int head = int(row % heads);
  const int64_t token_row = row / heads;  // b·S + token
  const int dim = lane * 4;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (args.params.kl_grad != nullptr) {
    for (int p = head * ratio; p < (head + 1) * ratio; ++p) {
      const float4 x =
          *reinterpret_cast<const float4*>(accum + (token_row * shape.num_proxy_heads + p) * kHeadDim + dim);
      acc[0] += x.x;
      acc[1] += x.y;
      acc[2] += x.z;
      acc[3] += x.w;
    }
  }
  const float factor = kl_gradient_factor(args.params, args.proxy_scale);
  T* dst = strided<T>(dst_ref).row(token_row / shape.seqlen, token_row % shape.seqlen, head) + dim;
#pragma unroll
  for (int e = 0; e < 4; ++e) dst[e] = from_float<T>(acc[e] * factor);
}

template <typename T>
cudaError_t launch_finish_proxy_grad(const BackwardArgs& args, const float* accum, TensorRef dst, int heads,
                                     int ratio, cudaStream_t stream) {
  const ProblemShape& shape = args.params.fwd.shape;
  const int64_t rows = shape.batch * shape.seqlen * heads;
  finish_proxy_grad_kernel<T><<<unsigned(ceil_div(rows, kBackwardWarps)), kBackwardThreads, 0, stream>>>(
      args, accum, dst, heads, ratio);
  return cudaGetLastError();
}

// The KL value: ordered two-pass sum of args.kl_rows / (B·Hp·S), written to fwd.kl (dtype_free.cu).
Status reduce_kl(const BackwardArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

// fwd.main_branch = false: only the KL value and dq_proxy, dk_proxy, from the caller's dense LSE,
// by the sparse backward's wgmma pipeline over the dense schedule (backward/pipelined_kernel.cuh,
// kKlOnly), accumulating with fp32 atomics, then the two finish kernels and the KL sum.
template <typename T>
Status run_kl_only(const BackwardArgs& args, const WorkspaceLayout& layout, cudaStream_t stream) {
  const BackwardParams& params = args.params;
  const ProblemShape& shape = params.fwd.shape;
  char* base = static_cast<char*>(params.workspace);
  FLASHMSA_WARMUP_CHECK(cudaMemsetAsync(base + layout.dq_proxy_accum, 0, layout.kl_sums - layout.dq_proxy_accum, stream),
                        "memset");
  if (args.with_kl) {
    if (Status status = backward::run_pipelined_kl_dense<T>(params, args.softmax_scale, args.proxy_scale,
                                                            args.dq_proxy_accum, args.dk_proxy_accum, args.kl_rows,
                                                            stream);
        !status.ok()) {
      return status;
    }
  }
  FLASHMSA_WARMUP_CHECK(
      launch_finish_proxy_grad<T>(args, args.dq_proxy_accum, params.dq_proxy, shape.num_proxy_heads, 1, stream),
      "finish_proxy_grad_kernel (dq_proxy)");
  FLASHMSA_WARMUP_CHECK(launch_finish_proxy_grad<T>(args, args.dk_proxy_accum, params.dk_proxy,
                                                    shape.num_proxy_kv_heads, args.proxy_ratio, stream),
                        "finish_proxy_grad_kernel (dk_proxy)");
  if (params.fwd.kl != nullptr) return reduce_kl(args, stream);
  return Status::Ok();
}

template <typename T>
Status run_backward(const BackwardParams& params, cudaStream_t stream) {
  const ProblemShape& shape = params.fwd.shape;
  if (shape.head_dim != kHeadDim || shape.proxy_head_dim != kHeadDim) {
    return {StatusCode::kUnsupported, "shape.head_dim: the warmup backward is built for D = Di = 128"};
  }
  if (const Limit limit = backward_limit(shape, params.deterministic, params.fwd.main_branch)) {
    return unsupported(limit);
  }
  const WorkspaceLayout layout = workspace_layout(shape);
  char* base = static_cast<char*>(params.workspace);
  BackwardArgs args;
  args.params = params;
  args.delta = reinterpret_cast<float*>(base + layout.delta);
  args.dq_proxy_accum = reinterpret_cast<float*>(base + layout.dq_proxy_accum);
  args.dk_proxy_accum = reinterpret_cast<float*>(base + layout.dk_proxy_accum);
  args.kl_rows = reinterpret_cast<float*>(base + layout.kl_rows);
  args.kl_sums = reinterpret_cast<float*>(base + layout.kl_sums);
  args.softmax_scale = float(effective_scale(params.fwd.softmax_scale, shape.head_dim));
  args.scale_log2 = args.softmax_scale * kLog2e;
  args.proxy_scale = float(effective_scale(params.fwd.proxy_scale, shape.proxy_head_dim));
  args.heads_per_proxy = shape.heads_per_proxy();
  args.tokens_per_tile = kBackwardRows / args.heads_per_proxy;
  args.proxy_per_kv = shape.num_proxy_heads / shape.num_kv_heads;
  args.proxy_ratio = shape.proxy_ratio();
  args.query_chunks = ceil_div(shape.seqlen, args.tokens_per_tile);
  args.key_blocks = ceil_div(shape.seqlen, kKeyStep);
  args.with_kl = params.kl_grad != nullptr || params.fwd.kl != nullptr;
  if (!params.fwd.main_branch) return run_kl_only<T>(args, layout, stream);

  FLASHMSA_WARMUP_CHECK(launch_delta<T>(params, args.delta, stream), "delta_kernel");

  FLASHMSA_WARMUP_CHECK(set_max_dynamic_smem(reinterpret_cast<const void*>(dq_kernel<T>), int(kDqSmemBytes)), "dq_kernel smem");
  const int64_t query_tiles = args.query_chunks * shape.batch * shape.num_proxy_heads;
  dq_kernel<T><<<unsigned(query_tiles), kBackwardThreads, kDqSmemBytes, stream>>>(args);
  FLASHMSA_WARMUP_CHECK(cudaGetLastError(), "dq_kernel");

  FLASHMSA_WARMUP_CHECK(set_max_dynamic_smem(reinterpret_cast<const void*>(dkdv_kernel<T>), int(kDkdvSmemBytes)), "dkdv_kernel smem");
  const int64_t key_units = args.key_blocks * shape.batch * shape.num_kv_heads;
  dkdv_kernel<T><<<unsigned(key_units), kBackwardThreads, kDkdvSmemBytes, stream>>>(args);
  FLASHMSA_WARMUP_CHECK(cudaGetLastError(), "dkdv_kernel");

  FLASHMSA_WARMUP_CHECK(launch_finish_proxy_grad<T>(args, args.dk_proxy_accum, params.dk_proxy,
                                                    shape.num_proxy_kv_heads, args.proxy_ratio, stream),
                        "finish_proxy_grad_kernel (dk_proxy)");

  if (params.fwd.kl != nullptr) return reduce_kl(args, stream);
  return Status::Ok();
}

}  // namespace flashmsa::kernels::warmup
