// Tile constants, shared-memory layout and workspace layout of the backward (SPEC.md §3-§4).
// kernel.cuh includes this file; docs/design.md "Backward" explains the choices.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashmsa/params.h"
#include "kernels/common/limit.h"
#include "kernels/common/smem_limits.h"
#include "kernels/schedule/config.h"

namespace flashmsa::kernels::backward {

constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kHeadDim = 128;  // D = Di
constexpr int kKeys = kBlockSize;

// A tile is 64 gathered main rows: 4 slabs of 16 rows (one mma.m16 row block each). A slab holds
// whole group rows (one (b, p, i) = M consecutive heads), so the teacher mean over the M heads of a
// group row never crosses a slab: ⌊16/M⌋ group rows per slab, capped at 8 so that a tile carries at
// most 32 group rows (the proxy stage below).
constexpr int kTileRows = 64;
constexpr int kSlabRows = 16;
constexpr int kSlabs = kTileRows / kSlabRows;
constexpr int kMaxGroupRowsPerSlab = 8;
constexpr int kMaxTileGroupRows = kSlabs * kMaxGroupRowsPerSlab;
constexpr int kMaxHeadsPerProxy = kSlabRows;  // M ≤ 16

constexpr int group_rows_per_slab(int heads_per_proxy) {
  return kSlabRows / heads_per_proxy < kMaxGroupRowsPerSlab ? kSlabRows / heads_per_proxy
                                                            : kMaxGroupRowsPerSlab;
}
constexpr int group_rows_per_tile(int heads_per_proxy) {
  return kSlabs * group_rows_per_slab(heads_per_proxy);
}

// The KL gradient to k_proxy, Σ_i g_ij q_proxy_i, is staged: the (π - t) rows and the q_proxy rows
// of up to 32 group rows (several tiles of one proxy head) are kept and multiplied once.
constexpr int kStageRows = 32;

// Non-deterministic mode splits a KV block's rows into work items of at most this many tiles, so
// hot blocks spread over many CTAs (their dK/dV partials meet through fp32 reduce-adds). The item
// flush (2 × 64 KB of reduce-adds) costs ≈ 6% of the gathered bytes of 32 tiles.
constexpr int kTilesPerItem = 32;

// The reverse index is built from per-chunk counts: a chunk is this many consecutive query rows.
constexpr int kRowsPerChunk = 512;

// fp32 copy of P for the teacher sum, rows padded against bank conflicts.
constexpr int kProbStride = kKeys + 8;

// Entries of the reverse index: token << kSlotBits | slot.
constexpr int kSlotBits = 6;

struct SharedStorage {
  // 16-bit tiles, [rows][128] each, 16-byte chunks XOR-swizzled by row (see swizzle()).
  uint16_t key[kKeys * kHeadDim];               // K of the block            (128 keys, D)
  uint16_t value[kKeys * kHeadDim];             // V of the block            (128 keys, D)
  uint16_t proxy_key[kKeys * kHeadDim];         // k_proxy of the block      (128 keys, Di)
  uint16_t query[kTileRows * kHeadDim];         // gathered Q                (64 rows, D)
  uint16_t dout[kTileRows * kHeadDim];          // gathered dO               (64 rows, D)
  uint16_t prob[kTileRows * kKeys];             // P in the input dtype      (64 rows, 128 keys)
  uint16_t dscore[kTileRows * kKeys];           // dS in the input dtype     (64 rows, 128 keys)
  uint16_t proxy_query[kStageRows * kHeadDim];  // staged q_proxy rows       (32, Di)
  uint16_t proxy_grad[kStageRows * kKeys];      // staged π - t              (32, 128 keys)
  float prob32[kTileRows * kProbStride];        // P in fp32 for the teacher (64 rows, 128 keys)
  float row_lse[kTileRows];                     // LSE · log2(e) per tile row
  float row_delta[kTileRows];                   // Δ per tile row
  int row_token[kTileRows];                     // query token, -1 for a padding row
  int row_head[kTileRows];                      // main head
  int group_token[kMaxTileGroupRows];           // per group row of the tile; -1 padding
  int group_slot[kMaxTileGroupRows];
  float group_proxy_lse[kMaxTileGroupRows];
  float kl_part[kMaxTileGroupRows][kWarps];     // per (group row, warp) KL partial sums
  int item;                                     // the work item this CTA runs next
};

constexpr size_t kSmemBytes = sizeof(SharedStorage) + 128;  // + alignment slack
static_assert(kSmemBytes <= kMaxBlockSharedBytes, "backward shared memory over the sm_90 limit");

// ---------------------------------------------------------------------------------------------
// The pipelined tile kernel (pipelined_kernel.cuh): non-deterministic mode, M = H/Hp ∈ {2, 4, 8,
// 16}. It walks the forward's schedule (tiles of one list (chunk, b, g, c, p)) as steps of 64
// gathered rows: ⌊16/M⌋ tokens per lane quad, so a token's M heads sit in the columns one thread
// holds in the transposed (keys × rows) accumulators.
// ---------------------------------------------------------------------------------------------
constexpr int kPipelinedThreads = 3 * 128;  // producer warpgroup + two consumer warpgroups
constexpr int kPipelinedProducerThreads = 128;
// Dealing the tiles of a segment (chunk, b, g) to the CTAs: contiguous ranges of equal weight, a
// tile weighing kTileWeight and each non-empty list kListWeight more (a list change drains the
// pipeline, loads K, V and k̃, and a unit's end reduce-adds dK, dV); schedule/deal.cuh.
constexpr uint32_t kTileWeight = 4;
constexpr uint32_t kListWeight = 8;
// Register split: the producer warpgroup's count sets the consumers' to what is left of the 64K
// registers (setmaxnreg takes multiples of 8). With M ≥ 8 the consumers fit in 224 without
// spilling and the producer, which spills at 40, gets 56; with M ≤ 4 the consumers need 232.
constexpr int pipelined_producer_registers(int m) { return m >= 8 ? 56 : 40; }
constexpr int consumer_registers_beside(int producer) { return (65536 - 128 * producer) / 256 / 8 * 8; }
// KL-only mode: the consumers hold no dK or dV (only dk_proxy of the list), so the producer, which
// spills at 40, gets more (consumers 216).
constexpr int kKlOnlyProducerRegisters = 72;
constexpr int kStepRows = 64;        // gathered main rows per step (the N of Sᵀ = K·Qᵀ)
// KL-only mode with M ≥ 4 takes 128 rows per step: Q fills the stage's dO half too, and the per-step
// costs (barriers, hand-off, proxy products) are paid per 128 rows.
constexpr int kKlOnlyStepRows = 128;
constexpr int step_rows(bool kl_only, int m) { return kl_only && m >= 4 ? kKlOnlyStepRows : kStepRows; }
constexpr int kMaxStepTokens = 32;   // step_tokens(M) for M ≥ 2
constexpr int kProxyRowsPerStage = 32;  // the most proxy rows a step has (M = 2)
// KL-only mode: tokens of (π − t, q_proxy) staged before dk_proxy, dq_proxy are computed and
// reduce-added. The sparse mode stages none: it stores g rows for proxy_grads.cuh.
constexpr int kFlushTokens = 32;
constexpr int flush_tokens(bool kl_only) { return kl_only ? kFlushTokens : 0; }

inline bool pipelined_supported(int heads_per_proxy, bool deterministic) {
  const int m = heads_per_proxy;
  return !deterministic && (m == 2 || m == 4 || m == 8 || m == 16);
}

// Whether the backward sums dQ in scaled fp16 (kernel.cuh make_problem): bf16 inputs on the wgmma
// kernel.
inline bool dq_half_sums(const ProblemShape& shape, DType dtype, bool deterministic) {
  return dtype == DType::kBF16 && pipelined_supported(shape.heads_per_proxy(), deterministic);
}

// The permuted row order of a step of R rows (M a power of two ≤ 16, T = R/(4M) tokens per lane
// quad; R = 64 unless given). Row n of a step is column n = 8j + 2q + e of the transposed
// accumulators, held by the threads with lane % 4 = q as their column c = 2j + e; it carries token
// q·T + c/M, head c % M. The proxy rows (one per token) follow the same rule with M = 1, so a
// token's M main columns and its proxy column belong to the same thread.
constexpr int step_tokens_per_quad(int m, int rows = kStepRows) { return rows / 4 / m; }
constexpr int step_tokens(int m, int rows = kStepRows) { return 4 * step_tokens_per_quad(m, rows); }
constexpr int proxy_columns(int m, int rows = kStepRows) {
  return step_tokens_per_quad(m, rows) <= 2 ? 8 : (step_tokens_per_quad(m, rows) <= 4 ? 16 : 32);
}
constexpr int row_quad(int n) { return (n % 8) / 2; }
constexpr int row_column(int n) { return 2 * (n / 8) + n % 2; }
constexpr int step_row_token(int n, int m, int rows = kStepRows) {
  return row_quad(n) * step_tokens_per_quad(m, rows) + row_column(n) / m;
}
constexpr int step_row_head(int n, int m) { return row_column(n) % m; }
// Proxy row n -> its token, -1 for a padding row; and the proxy row of token t.
constexpr int proxy_row_token(int n, int m, int rows = kStepRows) {
  return row_column(n) < step_tokens_per_quad(m, rows) && n < proxy_columns(m, rows)
             ? row_quad(n) * step_tokens_per_quad(m, rows) + row_column(n)
             : -1;
}
constexpr int proxy_row_of_token(int t, int m, int rows = kStepRows) {
  const int c = t % step_tokens_per_quad(m, rows);
  return 8 * (c / 2) + 2 * (t / step_tokens_per_quad(m, rows)) + c % 2;
}

// The KL-only dense schedule (pipelined_kernel.cuh, kKlOnly). Per (b, p) the tokens are cut into
// chunks of kDenseChunkTokens; a list is (token chunk j, visible block c) with the tokens of j at or
// after c's first key, in the order (b, p, j, c). A full chunk j sees blocks 0 … 8j + 7, the last
// chunk every block.
constexpr int kDenseChunkBlocks = 8;
constexpr int kDenseChunkTokens = kDenseChunkBlocks * kBlockSize;
constexpr int64_t dense_lists_before(int64_t j) { return kDenseChunkBlocks * j * (j + 1) / 2; }
constexpr int64_t dense_chunks(int64_t seqlen) { return (seqlen + kDenseChunkTokens - 1) / kDenseChunkTokens; }
constexpr int64_t dense_lists_per_bh(int64_t seqlen) {
  return dense_lists_before(dense_chunks(seqlen) - 1) + (seqlen + kBlockSize - 1) / kBlockSize;
}

// What the sparse backward is not built for (kernels/common/limit.h, fields named as in
// BackwardParams; the schedule's own limits come first): M ≤ 16, and the mma.sync kernel's reverse
// index packs (i << 6 | slot) into an int32.
inline Limit sparse_limit(const ProblemShape& shape, bool deterministic) {
  if (shape.heads_per_proxy() > kMaxHeadsPerProxy) {
    return {"fwd.shape", "the backward is built for at most 16 main heads per proxy head (H/Hp ≤ 16)"};
  }
  if (!pipelined_supported(shape.heads_per_proxy(), deterministic) &&
      shape.seqlen >= (int64_t(1) << (31 - schedule::kSlotBits))) {
    return {"fwd.shape.seqlen",
            "the mma.sync backward (deterministic mode, H/Hp outside {2, 4, 8, 16}) needs S < 2^25"};
  }
  return {};
}

// What the KL-only dense pass (warmup with the main branch elsewhere) is not built for: it sums
// with fp32 atomics on the wgmma pipeline (M in {2, 4, 8, 16}), its entries are (i << 6) in 32
// bits and its lists are numbered in 32 bits.
inline Limit kl_only_limit(const ProblemShape& shape, bool deterministic) {
  if (deterministic) {
    return {"deterministic",
            "the KL-only warmup backward (fwd.main_branch = false) sums with atomics; use "
            "fwd.main_branch = true for bitwise-reproducible gradients"};
  }
  if (!pipelined_supported(shape.heads_per_proxy(), false)) {
    return {"fwd.shape",
            "the KL-only warmup backward (fwd.main_branch = false) is built for H/Hp in {2, 4, 8, 16}"};
  }
  if (shape.seqlen >= (int64_t(1) << (32 - schedule::kSlotBits))) {
    return {"fwd.shape.seqlen", "the KL-only warmup backward needs S < 2^26"};
  }
  if (dense_lists_per_bh(shape.seqlen) * shape.batch * shape.num_proxy_heads >= (int64_t(1) << 32) - 1) {
    return {"fwd.shape", "the KL-only warmup backward numbers its lists in 32 bits"};
  }
  return {};
}

struct DenseListPosition {
  int64_t bh;  // b·Hp + p
  int chunk, block, first_token, count;
};
// List `list` of the order above (lists_per_bh, chunks from the two functions above).
constexpr DenseListPosition dense_list_position(int64_t list, int64_t lists_per_bh, int64_t chunks, int64_t seqlen) {
  DenseListPosition at{};
  at.bh = list / lists_per_bh;
  const int64_t r = list - at.bh * lists_per_bh;
  int64_t lo = 0;  // the largest chunk j with dense_lists_before(j) ≤ r
  int64_t hi = chunks - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (dense_lists_before(mid) <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  at.chunk = int(lo);
  at.block = int(r - dense_lists_before(lo));
  const int64_t chunk_first = lo * kDenseChunkTokens;
  const int64_t block_first = int64_t(at.block) * kBlockSize;
  at.first_token = int(chunk_first > block_first ? chunk_first : block_first);
  const int64_t chunk_end = chunk_first + kDenseChunkTokens < seqlen ? chunk_first + kDenseChunkTokens : seqlen;
  at.count = int(chunk_end - at.first_token);
  return at;
}

// The staged tokens' dq_proxy rows go to the bulk reduce-adds as fp32 rows of kHeadDim + 4 floats,
// so the accumulator stores are free of bank conflicts: through the V tile in the KL-only mode (never
// loaded there), through the flushing step's stage, once its dQ rows are read, in the sparse mode.
constexpr int kDqProxyStageStride = kHeadDim + 4;
static_assert(kFlushTokens * kDqProxyStageStride * 4 <= kKeys * kHeadDim * 2, "dq_proxy staging fits in the V tile");
static_assert(kDqProxyStageStride * 4 % 16 == 0, "bulk copies need 16-byte aligned rows");
// A stage's bytes: Q and dO (64 rows each; the KL-only mode's 128 Q rows) and the step's q_proxy
// rows (proxy_columns: 8, 16 or 32), 16-bit, 128-byte swizzle.
constexpr uint32_t pipelined_stage_bytes(bool kl_only, int m) {
  return uint32_t(2 * kStepRows + proxy_columns(m, step_rows(kl_only, m))) * kHeadDim * 2;
}
// dQ staging inside a consumed stage: the step's 64 rows as whole rows of both consumer
// warpgroups' 64 dims (fp32, 512 bytes; scaled fp16, 256 bytes, for bf16 inputs: kDqHalfRows),
// token-major with a token's M heads in head order, exactly as dq_accum holds them, so one bulk
// reduce-add per token moves M rows of contiguous bytes. The tokens of step quad q (row_quad) start
// 32·q bytes later: the 8 rows one accumulator store touches are 4 tokens of different quads × 2
// heads, so they start at 4 distinct offsets modulo 128 bytes (two wavefronts per store).
constexpr uint32_t kDqStageRowBytes = kHeadDim * 4;
constexpr uint32_t kDqStageRowBytes16 = kHeadDim * 2;
constexpr uint32_t kDqQuadPad = 32;
constexpr uint32_t dq_stage_token_offset(int token, int m, uint32_t row_bytes = kDqStageRowBytes) {
  return uint32_t(token) * uint32_t(m) * row_bytes + uint32_t(token / step_tokens_per_quad(m)) * kDqQuadPad;
}
constexpr uint32_t dq_stage_row_offset(int n, int m, uint32_t row_bytes = kDqStageRowBytes) {
  return dq_stage_token_offset(step_row_token(n, m), m, row_bytes) + uint32_t(step_row_head(n, m)) * row_bytes;
}
// The scaled fp16 dQ sums (bf16 inputs on the wgmma kernel; docs/design.md "Backward"): every
// contribution to row (b, i, h) is multiplied by dq_scale[b, h, i] = 2^(kDqScaleTarget − ⌈log2 B⌉)
// before it is rounded to fp16 and reduce-added, where B = 2σ·‖dO_i‖₂·max_j ‖V_j‖₂·max |K| bounds
// |dQ| and every partial sum of it, so the sums stay far inside fp16's range (≤ 2^13 of 65504) and
// its normal range reaches 27 binary orders of magnitude below the bound.
constexpr int kDqScaleTarget = 13;
constexpr int kDqScaleExponentLimit = 100;  // |⌈log2 B⌉| clamp, so the scale stays a normal fp32
constexpr uint32_t kDqStageBytes = kStepRows * kDqStageRowBytes + 3 * kDqQuadPad;
static_assert(kDqStageBytes <= pipelined_stage_bytes(false, 16), "dQ staging must fit in the smallest stage");

// Per-stage metadata written by the producer, read by the consumers, for steps of kRows rows.
template <int kRows>
struct StepMetaOf {
  float lse[kRows];              // LSE · log2(e) per step row; +inf for padding rows (P = 0)
  float delta[kRows];            // Δ per step row
  float dq_scale[kRows];         // dq_scale per step row (scaled fp16 dQ sums; else unused)
  int32_t token[kMaxStepTokens]; // query position per step token; -1 for padding
  int32_t slot[kMaxStepTokens];
  float proxy_lse[kMaxStepTokens];  // proxy LSE · log2(e); +inf for padding
  uint32_t key;                  // the schedule's list key
  int32_t count;                 // tokens in the step
  int32_t flags;                 // kStepListLast | kStepUnitLast | kStepLast | kStepNewBlocks
  int32_t b, kv_head, block, proxy_head;  // the key decoded (forward::decode_list_key)
  uint32_t first_entry;          // the schedule entry of the step's first token
};
using StepMeta = StepMetaOf<kStepRows>;
constexpr int kStepListLast = 1;   // K, V, k_proxy are replaced after this step, or no step follows
constexpr int kStepUnitLast = 2;   // the next step is of another (chunk, b, g, c): dK, dV are flushed
constexpr int kStepLast = 4;       // the CTA's last step
constexpr int kStepNewBlocks = 8;  // K, V, k_proxy were loaded for this step: wait on kv_full

// The two consumer warpgroups take turns issuing a step's first products (Sᵀ, dPᵀ and the proxy
// scores) in the sparse mode too, as the KL-only mode always does, when the build defines
// FLASHMSA_BACKWARD_CONSUMER_TURNS=1 (CMake option of that name, off by default; docs/design.md
// "Next", item 19).
#ifndef FLASHMSA_BACKWARD_CONSUMER_TURNS
#define FLASHMSA_BACKWARD_CONSUMER_TURNS 0
#endif
constexpr bool kSparseConsumerTurns = FLASHMSA_BACKWARD_CONSUMER_TURNS != 0;

// Byte offsets inside the pipelined kernel's shared memory (from a 1024-byte aligned base).
struct PipelinedLayout {
  uint32_t k = 0, v = 0, kp = 0;  // (2 halves, 128 keys, 64) 16-bit, 128-byte swizzle
  uint32_t stage = 0;             // (stage) Q (2 halves, 64 rows, 64), dO (same), q_proxy (2 halves,
                                  // proxy_columns rows, 64); once the step's products have read them,
                                  // the stage holds its fp32 dQ for the bulk reduce-adds (dq_stage_*)
  uint32_t stage_bytes = 0;       // pipelined_stage_bytes
  int stages = 0;                 // 2 or 3 (pipelined_stages)
  uint32_t ds = 0;                // (2 key halves, 64 rows, 64 keys): dS, the A of dQ = dS·K
  uint32_t g = 0;                 // KL-only: (128 keys, 64 tokens): π − t of the staged tokens
  uint32_t qp_flush = 0;          // KL-only: (2 halves, flush_tokens, 64): their q_proxy rows
  uint32_t meta = 0;              // (stage) StepMetaOf<R>, R = step_rows
  uint32_t kl = 0;                // fp32 (2 warpgroups, 4 warps, 32 tokens): KL partial sums
  uint32_t flush_token = 0;       // KL-only: int32 (flush_tokens): query position of each staged token
  uint32_t rows = 0;              // int32 (R + R + 32, R ≤ 128): step row -> token, head; proxy row -> token
  uint32_t barriers = 0;
  uint32_t total = 0;             // bytes to request, including the alignment slack
};

// The sparse mode has no staged proxy rows (the proxy gradients are a kernel of their own), and
// the room they took holds a third stage where it fits: a stage is then released one step after its
// dQ bulk reduce-adds are issued instead of waiting for their reads (pipelined_kernel.cuh).
constexpr PipelinedLayout make_pipelined_layout(bool kl_only, int m, int stages) {
  PipelinedLayout layout;
  const uint32_t flush = uint32_t(flush_tokens(kl_only));
  const uint32_t key_tile = kKeys * kHeadDim * 2;
  uint32_t at = 0;
  layout.k = at;
  at += key_tile;
  layout.v = at;
  at += key_tile;
  layout.kp = at;
  at += key_tile;
  layout.stage = at;
  layout.stage_bytes = pipelined_stage_bytes(kl_only, m);
  layout.stages = stages;
  at += uint32_t(stages) * layout.stage_bytes;
  layout.ds = at;
  at += kStepRows * kKeys * 2;
  layout.g = at;
  at += kl_only ? kKeys * 64 * 2 : 0u;
  layout.qp_flush = at;
  at += flush * kHeadDim * 2;
  layout.meta = at;
  at += uint32_t(stages) * uint32_t(step_rows(kl_only, m) == kKlOnlyStepRows ? sizeof(StepMetaOf<kKlOnlyStepRows>)
                                                                                : sizeof(StepMetaOf<kStepRows>));
  layout.kl = at;
  at += 2 * 4 * kMaxStepTokens * 4;
  layout.flush_token = at;
  at += flush * 4;
  layout.rows = at;
  at += (2 * kKlOnlyStepRows + kProxyRowsPerStage) * 4;
  layout.barriers = at;
  at += (2 * uint32_t(stages) + 1) * 8;
  layout.total = at + 1024;
  return layout;
}
constexpr int pipelined_stages(bool kl_only, int m) {
  return !kl_only && make_pipelined_layout(false, m, 3).total <= kMaxBlockSharedBytes ? 3 : 2;
}
constexpr PipelinedLayout make_pipelined_layout(bool kl_only, int m) {
  return make_pipelined_layout(kl_only, m, pipelined_stages(kl_only, m));
}

// ---------------------------------------------------------------------------------------------
// Workspace: byte offsets of every buffer, from shapes alone (backward_workspace_size() returns
// `total`). Plain C++ so src/api/workspace.cpp can include it.
// ---------------------------------------------------------------------------------------------
constexpr int kKlSumBlocks = 256;  // first pass of the ordered KL sum

// The wgmma kernel's KL gradient goes through g = π − t rows: one row of 128 keys in the input
// dtype per (token, proxy head, slot) of a list, written by the tile kernel and multiplied by the
// proxy-gradient kernel (proxy_grads.cuh). The backward runs the two kernels query chunk by query
// chunk, so the rows of one chunk are live: at most chunk_rows · Hp · K rows (268 MB at the paper
// configuration's 16K-row chunks, 1 GB with 16 proxy heads), read back while much of them is still
// in L2.
inline int64_t proxy_grad_chunk_entries(const ProblemShape& shape) {
  return schedule::chunk_rows(shape) * shape.num_proxy_heads * shape.top_k;
}

struct WorkspaceLayout {
  size_t chunk_counts = 0;  // int32 [b, hp, chunk, block]: selections per chunk, then their scan
  size_t list_offset = 0;   // int64 [b, hp, block]: first entry of the (b, p, block) list
  size_t list_count = 0;    // int32 [b, hp, block]: entries in the list
  size_t item_start = 0;    // int32 [b·hkv·block + 1]: first work item of each (b, g, block) unit
  size_t item_counter = 0;  // int32 [1]: the CTAs' shared work-item counter
  size_t entries = 0;       // int32 [b, hp, s, k] upper bound: token << 6 | slot, sorted by token
  size_t delta = 0;         // fp32 [b, h, s]: Δ = ⟨O, dO⟩
  size_t dq_scale = 0;      // fp32 [b, h, s]: the scaled fp16 dQ sums' row scales (config above)
  size_t kv_bound = 0;      // fp32 [2]: max_j ‖V_j‖₂ and max |K|, for dq_scale
  size_t dq_accum = 0;      // fp32 [b, s, h, d]; the scaled fp16 sums (dq_half): fp16 [b, s, h, d];
                            // deterministic: [b, hp, s, k, m, d] per slot
  size_t dq_proxy_accum = 0;  // fp32 [b, s, hp, di]; deterministic: [b, hp, s, k, di] per slot
  size_t dk_accum = 0;      // fp32 [b, s, hkv, d]
  size_t dv_accum = 0;      // fp32 [b, s, hkv, d]
  size_t tile_counters = 0;   // uint32 [chunks]: the proxy-gradient kernel's tiles dealt on demand
  size_t dk_proxy_accum = 0;  // fp32 [b, s, hp, di]: per proxy head, summed over R at the end
  size_t kl_partial = 0;    // fp32 [b, hp, s, k]: Σ_{j in block} t (log t - log π) per slot
  size_t kl_sums = 0;       // fp32 [kKlSumBlocks]
  size_t tile_bounds = 0;   // uint32 [segments, schedule::kMaxDealGrid + 1]: each CTA's first tile, per segment
                            // (the wgmma kernel's dealing)
  size_t dealt_tiles = 0;   // uint4 [schedule max_tiles]: the schedule's tiles in the order the
                            // wgmma kernel's CTAs walk them (only where that kernel runs)
  size_t proxy_grad = 0;    // 16-bit [proxy_grad_chunk_entries][128]: g = π − t rows of one query
                            // chunk (only where the wgmma kernel runs)
  size_t total = 0;
};

// dq_half: the wgmma kernel's scaled fp16 dQ sums (bf16 inputs, config above), whose accumulator
// takes half the bytes of the fp32 one.
inline WorkspaceLayout workspace_layout(const ProblemShape& shape, bool deterministic, bool dq_half) {
  const size_t batch = size_t(shape.batch);
  const size_t seqlen = size_t(shape.seqlen);
  const size_t blocks = size_t(shape.num_blocks());
  const size_t chunks = (seqlen + kRowsPerChunk - 1) / kRowsPerChunk;
  const size_t proxy_rows = batch * size_t(shape.num_proxy_heads) * seqlen;  // (b, p, i)
  const size_t slots = proxy_rows * size_t(shape.top_k);
  const size_t dim = size_t(shape.head_dim);
  const size_t proxy_dim = size_t(shape.proxy_head_dim);
  const size_t tokens = batch * seqlen;

  WorkspaceLayout layout;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t offset = at;
    at += (bytes + 255) / 256 * 256;
    return offset;
  };
  layout.chunk_counts = take(4 * batch * size_t(shape.num_proxy_heads) * chunks * blocks);
  layout.list_offset = take(8 * batch * size_t(shape.num_proxy_heads) * blocks);
  layout.list_count = take(4 * batch * size_t(shape.num_proxy_heads) * blocks);
  layout.item_start = take(4 * (batch * size_t(shape.num_kv_heads) * blocks + 1));
  layout.item_counter = take(4);
  layout.entries = take(4 * slots);
  layout.delta = take(4 * tokens * size_t(shape.num_heads));
  layout.dq_scale = take(4 * tokens * size_t(shape.num_heads));
  layout.kv_bound = take(4 * 2);
  if (deterministic) {
    layout.dq_accum = take(4 * slots * size_t(shape.heads_per_proxy()) * dim);
    layout.dq_proxy_accum = take(4 * slots * proxy_dim);
  } else {
    layout.dq_accum = take((dq_half ? 2 : 4) * tokens * size_t(shape.num_heads) * dim);
    layout.dq_proxy_accum = take(4 * tokens * size_t(shape.num_proxy_heads) * proxy_dim);
  }
  layout.dk_accum = take(4 * tokens * size_t(shape.num_kv_heads) * dim);
  layout.dv_accum = take(4 * tokens * size_t(shape.num_kv_heads) * dim);
  layout.tile_counters = take(4 * size_t(schedule::num_chunks(shape)));  // zeroed with dK, dV
  layout.dk_proxy_accum = take(4 * tokens * size_t(shape.num_proxy_heads) * proxy_dim);
  layout.kl_partial = take(4 * slots);
  layout.kl_sums = take(4 * kKlSumBlocks);
  if (pipelined_supported(shape.heads_per_proxy(), deterministic)) {
    const schedule::ScheduleLayout schedule_layout = schedule::make_schedule_layout(shape);
    const size_t segments = size_t(schedule_layout.num_keys / schedule::keys_per_segment(shape));
    layout.tile_bounds = take(4 * segments * size_t(schedule::kMaxDealGrid + 1));
    layout.dealt_tiles = take(16 * size_t(schedule_layout.max_tiles));
    layout.proxy_grad = take(2 * size_t(kKeys) * size_t(proxy_grad_chunk_entries(shape)));
  }
  layout.total = at;
  return layout;
}

}  // namespace flashmsa::kernels::backward
