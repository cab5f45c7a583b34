// Warmup forward (SPEC.md §5): dense causal attention O, LSE and the proxy LSE over every visible
// token, query-tile outer (FlashAttention's loop order: O accumulated in registers across the key
// steps, no partials, no schedule).
//
// Comes after: nothing (warmup needs no selection). Comes before: backward_kernel.cuh, which reads
// out, lse and proxy_lse. Tile constants: config.h. The KL value is written by the backward (the
// sparse path's convention): the teacher needs every head's final LSE, which the backward reads.
//
// One kernel, two uses:
//   main        rows = ⌊128/M⌋ tokens × the M heads of one proxy group (token-major), all on one KV
//               head; P·V accumulated in registers; writes O and LSE.
//   proxy LSE   rows = 128 tokens of one proxy head against its proxy key head; no P·V; writes
//               proxy_lse.
// Per tile (4 warps, each owning 32 rows = two m16 MMA tiles):
//   gather      cp.async: the tile's Q rows, then K (and V) in steps of 64 keys, two stages deep,
//               the next step in flight while the current one is computed.
//   mainloop    S = Q·Kᵀ (mma.sync m16n8k16), causal mask on the steps that cross the diagonal,
//               online softmax in the log2 domain, P packed in registers as the A operand of P·V.
//   epilogue    O / l staged through the warp's own Q rows and written as 16-byte rows; LSE.
// Tiles are launched last chunk first: the longest rows start first.
#pragma once

#include "kernels/warmup/common.cuh"

namespace flashmsa::kernels::warmup {

template <typename T>
struct ForwardArgs {
  Strided<const T> q;  // [b, s, num_heads, 128]
  Strided<const T> k;  // [b, s, key heads, 128]
  Strided<const T> v;  // [b, s, key heads, 128]; unread without P·V
  Strided<T> out;      // [b, s, num_heads, 128]; unwritten without P·V
  float* lse;          // [b, num_heads, s]
  int seqlen;
  int64_t chunks;       // ⌈S / tokens_per_tile⌉
  int batch;
  int num_heads;        // H (main) or Hp (proxy)
  int num_groups;       // num_heads / heads_per_group
  int heads_per_group;  // M (main) or 1 (proxy)
  int groups_per_key_head;  // Hp/Hkv (main) or R = Hp/Hpk (proxy)
  int tokens_per_tile;  // ⌊128 / heads_per_group⌋
  float scale_log2;     // σ·log2(e) or σp·log2(e)
};

template <typename T, bool kWithValue>
__global__ void __launch_bounds__(kForwardThreads, 2) forward_tile_kernel(const ForwardArgs<T> args) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(smem_raw);               // (128 rows, D)
  uint16_t* k_tiles = q_tile + kForwardRows * kHeadDim;                   // (stages, 64 keys, D)
  uint16_t* v_tiles = k_tiles + kForwardStages * kKeyStep * kHeadDim;     // (stages, 64 keys, D)

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // ---- tile scheduler: (chunk, b, group), last chunk first -----------------------------------
  const int64_t per_chunk = int64_t(args.num_groups) * args.batch;
  const int64_t chunk = args.chunks - 1 - int64_t(blockIdx.x) / per_chunk;
  const int group = int(int64_t(blockIdx.x) % per_chunk % args.num_groups);
  const int64_t b = int64_t(blockIdx.x) % per_chunk / args.num_groups;
  const int M = args.heads_per_group;
  const int tile_rows = args.tokens_per_tile * M;
  const int first_token = int(chunk) * args.tokens_per_tile;
  const int last_token = min(first_token + args.tokens_per_tile, args.seqlen) - 1;
  const int key_head = group / args.groups_per_key_head;
  const int first_head = group * M;
  const int steps = last_token / kKeyStep + 1;

  // ---- gather: Q rows, then the first key step ------------------------------------------------
  for (int index = threadIdx.x; index < kForwardRows * 16; index += kForwardThreads) {
    const int row = index >> 4;
    const int col = (index & 15) * 8;
    const int token = first_token + row / M;
    const bool valid = row < tile_rows && token < args.seqlen;
    const T* src = valid ? args.q.row(b, token, first_head + row % M) + col : args.q.ptr;
    ptx::cp_async_16(q_tile + swizzle<kHeadDim>(row, col), src, valid);
  }
  auto load_step = [&](int step) {
    const int stage = step & 1;
    load_token_rows<T>(k_tiles + stage * kKeyStep * kHeadDim, args.k, b, int64_t(step) * kKeyStep,
                       key_head, args.seqlen, kKeyStep, kForwardThreads);
    if constexpr (kWithValue) {
      load_token_rows<T>(v_tiles + stage * kKeyStep * kHeadDim, args.v, b, int64_t(step) * kKeyStep,
                         key_head, args.seqlen, kKeyStep, kForwardThreads);
    }
  };
  load_step(0);
  ptx::cp_async_commit();

  // The query token of each of this thread's 4 rows; padding rows take the tile's last token, so
  // they are never fully masked (their results are not written).
  int row_token[2][2];
#pragma unroll
  for (int m_tile = 0; m_tile < 2; ++m_tile) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp * kForwardRowsPerWarp + m_tile * 16 + half * 8 + lane / 4;
      row_token[m_tile][half] = row < tile_rows ? min(first_token + row / M, last_token) : last_token;
    }
  }

  float out_acc[2][kWithValue ? kHeadDim / 8 : 1][4] = {};
  float row_max[2][2] = {{kNegInf, kNegInf}, {kNegInf, kNegInf}};
  float row_sum[2][2] = {};

  // ---- mainloop: 64 keys per step ---------------------------------------------------------------
#pragma unroll 1
  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) {
      load_step(step + 1);
      ptx::cp_async_commit();
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();  // this step's K (and V) landed for every thread's copies
    const uint16_t* k_tile = k_tiles + (step & 1) * kKeyStep * kHeadDim;
    const uint16_t* v_tile = v_tiles + (step & 1) * kKeyStep * kHeadDim;
    const int first_key = step * kKeyStep;

    float score[2][kKeyStep / 8][4] = {};
#pragma unroll
    for (int k_step = 0; k_step < kHeadDim / 16; ++k_step) {
      uint32_t a[2][4];
#pragma unroll
      for (int m_tile = 0; m_tile < 2; ++m_tile) {
        ptx::ldmatrix_x4(a[m_tile], q_tile + swizzle<kHeadDim>(warp * kForwardRowsPerWarp + m_tile * 16 + lane % 16,
                                                               k_step * 16 + (lane / 16) * 8));
      }
#pragma unroll
      for (int n_pair = 0; n_pair < kKeyStep / 16; ++n_pair) {
        uint32_t bfrag[4];
        ptx::ldmatrix_x4(bfrag, k_tile + swizzle<kHeadDim>(n_pair * 16 + lane % 8 + (lane / 16) * 8,
                                                           k_step * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
        for (int m_tile = 0; m_tile < 2; ++m_tile) {
          ptx::mma_16816<T>(score[m_tile][n_pair * 2], a[m_tile], bfrag[0], bfrag[1]);
          ptx::mma_16816<T>(score[m_tile][n_pair * 2 + 1], a[m_tile], bfrag[2], bfrag[3]);
        }
      }
    }

    // Keys past a row's token (and so every key ≥ S) are masked only where the step crosses the
    // tile's first token.
    const bool need_mask = first_key + kKeyStep - 1 > first_token;
    uint32_t p_frag[2][kKeyStep / 16][4];
#pragma unroll
    for (int m_tile = 0; m_tile < 2; ++m_tile) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float step_max = kNegInf;
#pragma unroll
        for (int n = 0; n < kKeyStep / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float s = score[m_tile][n][half * 2 + e] * args.scale_log2;
            if (need_mask && first_key + n * 8 + (lane % 4) * 2 + e > row_token[m_tile][half]) s = kNegInf;
            score[m_tile][n][half * 2 + e] = s;
            step_max = fmaxf(step_max, s);
          }
        }
        const float correction = online_softmax_step(score[m_tile], half, quad_max(step_max), row_max[m_tile][half],
                                                         row_sum[m_tile][half]);
        if constexpr (kWithValue) {
#pragma unroll
          for (int d = 0; d < kHeadDim / 8; ++d) {
            out_acc[m_tile][d][half * 2] *= correction;
            out_acc[m_tile][d][half * 2 + 1] *= correction;
          }
        }
      }
      if constexpr (kWithValue) {
#pragma unroll
        for (int k_step = 0; k_step < kKeyStep / 16; ++k_step) {
          const float* lo = score[m_tile][2 * k_step];
          const float* hi = score[m_tile][2 * k_step + 1];
          p_frag[m_tile][k_step][0] = ptx::pack2<T>(lo[0], lo[1]);
          p_frag[m_tile][k_step][1] = ptx::pack2<T>(lo[2], lo[3]);
          p_frag[m_tile][k_step][2] = ptx::pack2<T>(hi[0], hi[1]);
          p_frag[m_tile][k_step][3] = ptx::pack2<T>(hi[2], hi[3]);
        }
      }
    }

    if constexpr (kWithValue) {
#pragma unroll
      for (int k_step = 0; k_step < kKeyStep / 16; ++k_step) {
#pragma unroll
        for (int d_pair = 0; d_pair < kHeadDim / 16; ++d_pair) {
          uint32_t bfrag[4];
          ptx::ldmatrix_x4_trans(bfrag, v_tile + swizzle<kHeadDim>(k_step * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                                                   d_pair * 16 + (lane / 16) * 8));
#pragma unroll
          for (int m_tile = 0; m_tile < 2; ++m_tile) {
            ptx::mma_16816<T>(out_acc[m_tile][d_pair * 2], p_frag[m_tile][k_step], bfrag[0], bfrag[1]);
            ptx::mma_16816<T>(out_acc[m_tile][d_pair * 2 + 1], p_frag[m_tile][k_step], bfrag[2], bfrag[3]);
          }
        }
      }
    }
    __syncthreads();  // the next step's copies overwrite this stage
  }

  // ---- epilogue: LSE; O / l staged in the warp's own Q rows, written as 16-byte rows ------------
#pragma unroll
  for (int m_tile = 0; m_tile < 2; ++m_tile) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float sum = quad_sum(row_sum[m_tile][half]);
      const int row = warp * kForwardRowsPerWarp + m_tile * 16 + half * 8 + lane / 4;
      if constexpr (kWithValue) {
        const float inverse = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
        for (int d = 0; d < kHeadDim / 8; ++d) {
          *reinterpret_cast<uint32_t*>(q_tile + swizzle<kHeadDim>(row, d * 8 + (lane % 4) * 2)) =
              ptx::pack2<T>(out_acc[m_tile][d][half * 2] * inverse, out_acc[m_tile][d][half * 2 + 1] * inverse);
        }
      }
      const int token = first_token + row / M;
      if (lane % 4 == 0 && row < tile_rows && token < args.seqlen) {
        const int head = first_head + row % M;
        args.lse[(b * args.num_heads + head) * args.seqlen + token] = (row_max[m_tile][half] + log2f(sum)) * kLn2;
      }
    }
  }
  if constexpr (kWithValue) {
    __syncwarp();
#pragma unroll 4
    for (int index = lane; index < kForwardRowsPerWarp * 16; index += 32) {
      const int row = warp * kForwardRowsPerWarp + (index >> 4);
      const int col = (index & 15) * 8;
      const int token = first_token + row / M;
      if (row < tile_rows && token < args.seqlen) {
        *reinterpret_cast<uint4*>(args.out.row(b, token, first_head + row % M) + col) =
            *reinterpret_cast<const uint4*>(q_tile + swizzle<kHeadDim>(row, col));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launcher: the main tiles, then the proxy LSE tiles, on one stream.
// ---------------------------------------------------------------------------------------------
template <typename T, bool kWithValue>
Status launch_tiles(const ForwardArgs<T>& args, cudaStream_t stream, const char* what) {
  const size_t smem = forward_smem_bytes(kWithValue);
  FLASHMSA_WARMUP_CHECK(
      set_max_dynamic_smem(reinterpret_cast<const void*>(forward_tile_kernel<T, kWithValue>), int(smem)), what);
  const int64_t tiles = args.chunks * args.num_groups * args.batch;
  forward_tile_kernel<T, kWithValue><<<unsigned(tiles), kForwardThreads, smem, stream>>>(args);
  FLASHMSA_WARMUP_CHECK(cudaGetLastError(), what);
  return Status::Ok();
}

template <typename T>
Status run_forward(const ForwardParams& params, cudaStream_t stream) {
  const ProblemShape& shape = params.shape;
  if (shape.head_dim != kHeadDim || shape.proxy_head_dim != kHeadDim) {
    return {StatusCode::kUnsupported, "shape.head_dim: the warmup forward is built for D = Di = 128"};
  }
  if (const Limit limit = forward_limit(shape)) return unsupported(limit);
  const float softmax_scale = float(effective_scale(params.softmax_scale, shape.head_dim));
  const float proxy_scale = float(effective_scale(params.proxy_scale, shape.proxy_head_dim));

  ForwardArgs<T> main_args;
  main_args.q = strided<const T>(params.q);
  main_args.k = strided<const T>(params.k);
  main_args.v = strided<const T>(params.v);
  main_args.out = strided<T>(params.out);
  main_args.lse = params.lse;
  main_args.seqlen = int(shape.seqlen);
  main_args.batch = int(shape.batch);
  main_args.num_heads = shape.num_heads;
  main_args.heads_per_group = shape.heads_per_proxy();
  main_args.num_groups = shape.num_proxy_heads;
  main_args.groups_per_key_head = shape.num_proxy_heads / shape.num_kv_heads;
  main_args.tokens_per_tile = kForwardRows / main_args.heads_per_group;
  main_args.chunks = ceil_div(shape.seqlen, main_args.tokens_per_tile);
  main_args.scale_log2 = softmax_scale * kLog2e;
  if (params.main_branch) {
    if (Status status = launch_tiles<T, true>(main_args, stream, "forward_tile_kernel (main)"); !status.ok()) {
      return status;
    }
  }

  ForwardArgs<T> proxy_args = main_args;
  proxy_args.q = strided<const T>(params.q_proxy);
  proxy_args.k = strided<const T>(params.k_proxy);
  proxy_args.v = proxy_args.k;
  proxy_args.lse = params.proxy_lse;
  proxy_args.num_heads = shape.num_proxy_heads;
  proxy_args.heads_per_group = 1;
  proxy_args.num_groups = shape.num_proxy_heads;
  proxy_args.groups_per_key_head = shape.proxy_ratio();
  proxy_args.tokens_per_tile = kForwardRows;
  proxy_args.chunks = ceil_div(shape.seqlen, kForwardRows);
  proxy_args.scale_log2 = proxy_scale * kLog2e;
  return launch_tiles<T, false>(proxy_args, stream, "forward_tile_kernel (proxy LSE)");
}

}  // namespace flashmsa::kernels::warmup
