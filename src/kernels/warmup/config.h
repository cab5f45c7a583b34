// Tile constants, shared-memory layouts and the workspace layout of warmup mode (SPEC.md §5: dense
// causal main branch, KL over every visible token). forward_kernel.cuh and backward_kernel.cuh
// include this file; src/api/workspace.cpp includes it for the workspace size (plain C++ here).
// docs/design.md "Warmup" explains the choices.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashmsa/params.h"
#include "kernels/backward/config.h"
#include "kernels/common/limit.h"
#include "kernels/common/smem_limits.h"

namespace flashmsa::kernels::warmup {

constexpr int kHeadDim = 128;  // D = Di
constexpr int kKeyStep = 64;   // keys per mainloop step (forward and backward)

// ---------------------------------------------------------------------------------------------
// Forward: query-tile outer (FlashAttention's loop order). A tile is 128 query rows = ⌊128/M⌋
// tokens × the M heads of one proxy group (token-major), all sharing one KV head; 4 warps own 32
// rows each; K/V stream through two cp.async stages of 64 keys. The proxy LSE runs the same kernel
// with M = 1 on (q_proxy, k_proxy) and no P·V.
// ---------------------------------------------------------------------------------------------
constexpr int kForwardThreads = 128;
constexpr int kForwardRows = 128;
constexpr int kForwardRowsPerWarp = 32;
constexpr int kForwardStages = 2;
constexpr int kMaxForwardHeadsPerProxy = kForwardRows;  // M ≤ 128

// Bytes of dynamic shared memory: Q (128 rows) + K stages (+ V stages when P·V runs).
constexpr size_t forward_smem_bytes(bool with_value) {
  return size_t(kForwardRows) * kHeadDim * 2 +
         size_t(kForwardStages) * kKeyStep * kHeadDim * 2 * (with_value ? 2 : 1);
}
static_assert(2 * forward_smem_bytes(true) <= kMaxBlockSharedBytes, "warmup forward: two CTAs per SM");

// ---------------------------------------------------------------------------------------------
// Backward: two kernels, each owning its outputs (no atomics, so every run is bitwise identical).
//   dq kernel   query-tile outer: 64 rows = ⌊64/M⌋ tokens × M heads of one proxy group; K, V and
//               k_proxy stream in two stages of 64 keys; dQ and dq_proxy stay in registers.
//   dkdv kernel key-block outer: 64 keys of one KV head; the query tiles of its proxy heads stream
//               in two stages; dK, dV and the per-proxy-head dk_proxy stay in registers.
// Both recompute P (and the teacher, the mean of P over the M heads of a token, which a tile holds
// whole) and the student π from the proxy scores.
// ---------------------------------------------------------------------------------------------
constexpr int kBackwardThreads = 256;  // 8 warps
constexpr int kBackwardWarps = kBackwardThreads / 32;
constexpr int kBackwardRows = 64;
constexpr int kMaxBackwardHeadsPerProxy = kBackwardRows;  // M ≤ 64

// What the warmup kernels are not built for (kernels/common/limit.h; head dims other than 128 are
// validate's supported-combination rule). The forward's tile holds ⌊128/M⌋ tokens, the backward's
// ⌊64/M⌋; without the main branch the backward is the KL-only pass of the sparse pipeline.
inline Limit forward_limit(const ProblemShape& shape) {
  if (shape.heads_per_proxy() > kMaxForwardHeadsPerProxy) {
    return {"shape", "the warmup forward needs heads per proxy head H/Hp ≤ 128"};
  }
  return {};
}
inline Limit backward_limit(const ProblemShape& shape, bool deterministic, bool main_branch) {
  if (shape.heads_per_proxy() > kMaxBackwardHeadsPerProxy) {
    return {"fwd.shape", "the warmup backward needs heads per proxy head H/Hp ≤ 64"};
  }
  return main_branch ? Limit{} : backward::kl_only_limit(shape, deterministic);
}
constexpr int kProbStride = kKeyStep + 8;  // fp32 P rows, padded against bank conflicts

// Shared memory of the dq kernel. 16-bit tiles are [rows][cols] with 16-byte chunks XOR-swizzled
// by row (common.cuh swizzle()).
struct DqStorage {
  uint16_t query[kBackwardRows * kHeadDim];                    // Q          (64 rows, D)
  uint16_t dout[kBackwardRows * kHeadDim];                     // dO         (64 rows, D)
  uint16_t proxy_query[kBackwardRows * kHeadDim];              // q_proxy    (64 group rows, Di)
  uint16_t key[kForwardStages][kKeyStep * kHeadDim];           // K          (stage, 64 keys, D)
  uint16_t value[kForwardStages][kKeyStep * kHeadDim];         // V          (stage, 64 keys, D)
  uint16_t proxy_key[kForwardStages][kKeyStep * kHeadDim];     // k_proxy    (stage, 64 keys, Di)
  uint16_t dscore[kBackwardRows * kKeyStep];                   // dS         (64 rows, 64 keys)
  uint16_t proxy_grad[kBackwardRows * kKeyStep];               // π - t      (64 group rows, 64 keys)
  float prob32[kBackwardRows * kProbStride];                   // P in fp32  (64 rows, 64 keys)
  float row_lse[kBackwardRows];                                // LSE · log2(e)
  float row_delta[kBackwardRows];                              // Δ
  int row_token[kBackwardRows];                                // -1: padding row
  int group_token[kBackwardRows];                              // -1: padding group row
  float group_proxy_lse[kBackwardRows];
  float kl_part[kBackwardRows][2];                             // per (group row, key half)
};

// Shared memory of the dkdv kernel.
struct DkdvStorage {
  uint16_t key[kKeyStep * kHeadDim];                           // K          (64 keys, D)
  uint16_t value[kKeyStep * kHeadDim];                         // V          (64 keys, D)
  uint16_t proxy_key[kKeyStep * kHeadDim];                     // k_proxy    (64 keys, Di)
  uint16_t query[kForwardStages][kBackwardRows * kHeadDim];    // Q          (stage, 64 rows, D)
  uint16_t dout[kForwardStages][kBackwardRows * kHeadDim];     // dO         (stage, 64 rows, D)
  uint16_t proxy_query[kForwardStages][kBackwardRows * kHeadDim];  // q_proxy (stage, 64, Di)
  uint16_t prob[kBackwardRows * kKeyStep];                     // P          (64 rows, 64 keys)
  uint16_t dscore[kBackwardRows * kKeyStep];                   // dS         (64 rows, 64 keys)
  uint16_t proxy_grad[kBackwardRows * kKeyStep];               // π - t      (64 group rows, 64 keys)
  float prob32[kBackwardRows * kProbStride];                   // P in fp32  (64 rows, 64 keys)
  float row_lse[kForwardStages][kBackwardRows];
  float row_delta[kForwardStages][kBackwardRows];
  int row_token[kForwardStages][kBackwardRows];
  int group_token[kForwardStages][kBackwardRows];
  float group_proxy_lse[kForwardStages][kBackwardRows];
};

constexpr size_t kDqSmemBytes = sizeof(DqStorage) + 128;      // + alignment slack
constexpr size_t kDkdvSmemBytes = sizeof(DkdvStorage) + 128;
static_assert(kDqSmemBytes <= kMaxBlockSharedBytes, "warmup dq kernel: shared memory over the sm_90 limit");
static_assert(kDkdvSmemBytes <= kMaxBlockSharedBytes, "warmup dkdv kernel: shared memory over the sm_90 limit");

// ---------------------------------------------------------------------------------------------
// Backward workspace (backward_workspace_size() in warmup mode returns `total`); the forward needs
// none. The two-kernel backward writes every buffer fully before reading it, so nothing is zeroed;
// the KL-only backward (fwd.main_branch = false) zeroes [dq_proxy_accum, kl_sums) and accumulates
// there with atomics.
// ---------------------------------------------------------------------------------------------
constexpr int kKlSumBlocks = 256;  // first pass of the ordered KL sum

struct WorkspaceLayout {
  size_t delta = 0;           // fp32 [b, h, s]: Δ = ⟨O, dO⟩
  size_t dq_proxy_accum = 0;  // fp32 [b, s, hp, di]: Σ_j g k_proxy (KL-only backward)
  size_t dk_proxy_accum = 0;  // fp32 [b, s, hp, di]: Σ_i g q_proxy per proxy head, summed over R last
  size_t kl_rows = 0;         // fp32 [b, hp, s]: Σ_j t (log t - log π) per group row
  size_t kl_sums = 0;         // fp32 [kKlSumBlocks]
  size_t total = 0;
};

inline WorkspaceLayout workspace_layout(const ProblemShape& shape) {
  const size_t tokens = size_t(shape.batch) * size_t(shape.seqlen);
  WorkspaceLayout layout;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t offset = at;
    at += (bytes + 255) / 256 * 256;
    return offset;
  };
  layout.delta = take(4 * tokens * size_t(shape.num_heads));
  layout.dq_proxy_accum = take(4 * tokens * size_t(shape.num_proxy_heads) * size_t(shape.proxy_head_dim));
  layout.dk_proxy_accum = take(4 * tokens * size_t(shape.num_proxy_heads) * size_t(shape.proxy_head_dim));
  layout.kl_rows = take(4 * tokens * size_t(shape.num_proxy_heads));
  layout.kl_sums = take(4 * kKlSumBlocks);
  layout.total = at;
  return layout;
}

}  // namespace flashmsa::kernels::warmup
