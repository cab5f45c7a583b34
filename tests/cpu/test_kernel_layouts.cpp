// Host-side invariants of the kernels' shared-memory layouts (src/kernels/forward/config.h,
// src/kernels/backward/config.h), checked without a GPU: every supported head map fits the opt-in
// shared memory of one H100/H200 block, the wgmma operand tiles start on 1024-byte boundaries (the
// 128-byte swizzle's atom), and the pipelines keep at least two stages.
#include <gtest/gtest.h>
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "flashmsa/api.h"
#include "kernels/backward/config.h"
#include "kernels/forward/config.h"
#include "cpu/shapes.h"

namespace flashmsa::testing {
namespace {

using kernels::forward::make_pipelined_layout;
using kernels::forward::PipelinedLayout;

TEST(PipelinedForwardLayout, EveryHeadMapFitsWithAlignedTiles) {
  for (int m = 2; m <= kernels::forward::kTileRows; ++m) {
    const ProblemShape shape = small_shape(1, 4096, m, 1, 1, 1, 16, 128, 128);
    ASSERT_TRUE(kernels::forward::pipelined_supported(shape)) << "M = " << m;
    const PipelinedLayout layout = make_pipelined_layout(shape);
    EXPECT_LE(layout.total, kernels::kMaxBlockSharedBytes) << "M = " << m;
    EXPECT_GE(layout.stages, 2) << "M = " << m;
    EXPECT_LE(layout.stages, kernels::forward::kPipelinedMaxStages) << "M = " << m;
    for (uint32_t offset : {layout.q, layout.k, layout.v, layout.kp}) {
      EXPECT_EQ(offset % 1024, 0u) << "M = " << m;
    }
    EXPECT_EQ(layout.barriers % 8, 0u) << "M = " << m;
    EXPECT_EQ(layout.stats % 8, 0u) << "M = " << m;
    EXPECT_EQ(layout.meta % 8, 0u) << "M = " << m;
    // Every token of a tile has a metadata slot.
    EXPECT_LE(kernels::schedule::tokens_per_tile(shape), kernels::forward::kPipelinedMaxTokens) << "M = " << m;
    EXPECT_GE(layout.proxy_rows, kernels::schedule::tokens_per_tile(shape)) << "M = " << m;
    EXPECT_EQ(layout.proxy_rows % 16, 0) << "M = " << m;
  }
}

TEST(PipelinedForwardLayout, PaperAndSpecializedGetThreeStages) {
  // The measured configurations (docs/design.md "Forward") rely on the third stage.
  EXPECT_EQ(make_pipelined_layout(small_shape(1, 4096, 64, 4, 4, 1, 16, 128, 128)).stages, 3);
  EXPECT_EQ(make_pipelined_layout(small_shape(1, 4096, 64, 4, 16, 1, 16, 128, 128)).stages, 3);
}

TEST(PipelinedForwardLayout, OneHeadPerProxyUsesTheFirstKernel) {
  EXPECT_FALSE(kernels::forward::pipelined_supported(small_shape(1, 4096, 8, 8, 8, 1, 16, 128, 128)));
}

TEST(PipelinedBackwardLayout, FitsWithAlignedTiles) {
  namespace bw = kernels::backward;
  for (bool kl_only : {false, true}) {
    for (int m : {2, 4, 8, 16}) {
      const std::string where = "M = " + std::to_string(m) + (kl_only ? ", KL-only" : "");
      const bw::PipelinedLayout layout = bw::make_pipelined_layout(kl_only, m);
      EXPECT_LE(layout.total, kernels::kMaxBlockSharedBytes) << where;
      for (uint32_t offset : {layout.k, layout.v, layout.kp, layout.stage, layout.ds, layout.g, layout.qp_flush}) {
        EXPECT_EQ(offset % 1024, 0u) << where;
      }
      // A stage and its Q, dO, q_proxy tiles are whole 1024-byte atoms, so every tile is aligned too.
      const int proxy_rows = bw::proxy_columns(m, bw::step_rows(kl_only, m));
      EXPECT_EQ(layout.stage_bytes, uint32_t(2 * bw::kStepRows + proxy_rows) * bw::kHeadDim * 2) << where;
      EXPECT_EQ(layout.stage_bytes % 1024, 0u) << where;
      EXPECT_EQ(proxy_rows * bw::kHeadDim * 2 % 1024, 0) << where;
      EXPECT_EQ(layout.ds - layout.stage, uint32_t(layout.stages) * layout.stage_bytes) << where;
      // The sparse mode holds each stage a step longer where a third stage fits (M ≥ 4).
      EXPECT_EQ(layout.stages, !kl_only && m >= 4 ? 3 : 2) << where;
      EXPECT_EQ(layout.stages, bw::pipelined_stages(kl_only, m)) << where;
      // The dQ staging fits a stage; the staged proxy rows fill whole atoms of the flush tile, and
      // the g tile (64 token columns) holds every staged token.
      EXPECT_LE(bw::kDqStageBytes, layout.stage_bytes) << where;
      EXPECT_EQ(bw::flush_tokens(kl_only) % 16, 0) << where;
      EXPECT_LE(bw::flush_tokens(kl_only), 64) << where;
      EXPECT_EQ(layout.meta % 16, 0u) << where;  // float2 loads of (LSE, Δ) pairs
      EXPECT_EQ(layout.barriers % 8, 0u) << where;
    }
  }
  // Every token's run of M rows is a legal bulk reduce-add source (16-byte aligned, a multiple of
  // 16 bytes).
  EXPECT_EQ(bw::kDqStageRowBytes % 16, 0u);
  EXPECT_EQ(bw::kDqQuadPad % 16, 0u);
  EXPECT_EQ(sizeof(bw::StepMeta) % 16, 0u);
  EXPECT_EQ(sizeof(bw::StepMetaOf<bw::kKlOnlyStepRows>) % 16, 0u);
}

TEST(PipelinedBackwardLayout, DqStagingIsTokenMajorWithoutOverlapOrBankConflicts) {
  namespace bw = kernels::backward;
  for (int m : {2, 4, 8, 16}) {
    const int tokens = 4 * (16 / m);
    // Every step row lands at its token's run, in head order, inside the staging, and no two rows
    // overlap: fp32 rows and the scaled fp16 rows of bf16 inputs.
    for (const uint32_t row_bytes : {bw::kDqStageRowBytes, bw::kDqStageRowBytes16}) {
      EXPECT_EQ(row_bytes % 16, 0u);
      std::vector<std::pair<uint32_t, int>> starts;
      for (int n = 0; n < bw::kStepRows; ++n) {
        const int token = bw::step_row_token(n, m);
        const int head = bw::step_row_head(n, m);
        ASSERT_LT(token, tokens) << "M = " << m << ", row " << n;
        const uint32_t offset = bw::dq_stage_row_offset(n, m, row_bytes);
        EXPECT_EQ(offset, bw::dq_stage_token_offset(token, m, row_bytes) + uint32_t(head) * row_bytes);
        EXPECT_EQ(offset % 16, 0u) << "M = " << m << ", row " << n;
        EXPECT_LE(offset + row_bytes, bw::kDqStageBytes) << "M = " << m << ", row " << n;
        starts.emplace_back(offset, n);
      }
      std::sort(starts.begin(), starts.end());
      for (size_t i = 1; i < starts.size(); ++i) {
        EXPECT_GE(starts[i].first, starts[i - 1].first + row_bytes) << "M = " << m << ", row bytes " << row_bytes;
      }
    }
    // One accumulator store (fixed warp, h and column) touches rows warp·16 + 8h + r, r < 8, 32 bytes
    // each: at most two rows may share a 32-byte bank group, so the store takes two wavefronts.
    for (int first = 0; first < bw::kStepRows; first += 8) {
      int per_group[4] = {0, 0, 0, 0};
      for (int r = 0; r < 8; ++r) ++per_group[(bw::dq_stage_row_offset(first + r, m) % 128) / 32];
      for (int g = 0; g < 4; ++g) EXPECT_LE(per_group[g], 2) << "M = " << m << ", rows " << first;
    }
  }
}

// The KL-only dense schedule visits every (token, visible block) pair of every (b, p) exactly once,
// in list order, lists of one token chunk and one block.
TEST(DenseKlSchedule, CoversEveryVisiblePairOnce) {
  namespace bw = kernels::backward;
  for (int64_t seqlen : {1, 127, 128, 129, 1000, 1024, 1025, 1500, 2048, 5000}) {
    const int64_t blocks = (seqlen + 127) / 128;
    const int64_t per_bh = bw::dense_lists_per_bh(seqlen);
    const int64_t chunks = bw::dense_chunks(seqlen);
    constexpr int64_t kBh = 3;
    std::vector<int> seen(size_t(kBh * seqlen * blocks), 0);
    for (int64_t list = 0; list < kBh * per_bh; ++list) {
      const bw::DenseListPosition at = bw::dense_list_position(list, per_bh, chunks, seqlen);
      ASSERT_EQ(at.bh, list / per_bh) << "S = " << seqlen << ", list " << list;
      ASSERT_GT(at.count, 0) << "S = " << seqlen << ", list " << list;
      ASSERT_GE(at.first_token, at.block * 128) << "S = " << seqlen << ", list " << list;
      ASSERT_EQ(at.first_token / bw::kDenseChunkTokens, (at.first_token + at.count - 1) / bw::kDenseChunkTokens)
          << "a list stays inside one token chunk";
      for (int token = at.first_token; token < at.first_token + at.count; ++token) {
        ++seen[size_t((at.bh * seqlen + token) * blocks + at.block)];
      }
    }
    for (int64_t bh = 0; bh < kBh; ++bh) {
      for (int64_t token = 0; token < seqlen; ++token) {
        for (int64_t block = 0; block < blocks; ++block) {
          EXPECT_EQ(seen[size_t((bh * seqlen + token) * blocks + block)], block * 128 <= token ? 1 : 0)
              << "S = " << seqlen << ", token " << token << ", block " << block;
        }
      }
    }
  }
}

TEST(PipelinedBackwardLayout, ServesPowerOfTwoHeadMapsInNonDeterministicMode) {
  for (int m = 1; m <= 16; ++m) {
    const bool power_of_two = m == 2 || m == 4 || m == 8 || m == 16;
    EXPECT_EQ(kernels::backward::pipelined_supported(m, false), power_of_two) << "M = " << m;
    EXPECT_FALSE(kernels::backward::pipelined_supported(m, true)) << "M = " << m;
    if (power_of_two) {
      // A step's tokens (4·⌊16/M⌋, or 4·⌊32/M⌋ in the KL-only mode's 128-row steps) fit the
      // metadata and the staged proxy rows.
      for (bool kl_only : {false, true}) {
        const int tokens = kernels::backward::step_tokens(m, kernels::backward::step_rows(kl_only, m));
        EXPECT_LE(tokens, kernels::backward::kMaxStepTokens) << "M = " << m;
        if (kl_only) {
          EXPECT_LE(tokens, kernels::backward::flush_tokens(kl_only)) << "M = " << m;
        }
      }
    }
  }
}

// The permuted step rows of the wgmma backward (backward/config.h): the 64 rows (128 in the KL-only
// mode for M ≥ 4) are every (token, head) pair of the step's tokens exactly once, and the thread
// that holds a token's M main columns (lane % 4 = row_quad) also holds its proxy column, which is
// what puts the KL teacher and student of a (key, token) in one thread. The producer's gathers
// rely on row first_row + 8i being token (first_row / 2)·T + 2i / M, head first_row % 2 + 2i % M.
TEST(PipelinedBackwardLayout, StepRowsAreATokenMajorPermutation) {
  namespace bw = kernels::backward;
  for (int m : {2, 4, 8, 16}) {
    for (bool kl_only : {false, true}) {
      const int rows = bw::step_rows(kl_only, m);
      const std::string where = "M = " + std::to_string(m) + ", " + std::to_string(rows) + " rows";
      const int tokens = bw::step_tokens(m, rows);
      const int per_quad = bw::step_tokens_per_quad(m, rows);
      std::vector<int> seen(tokens * m, 0);
      for (int n = 0; n < rows; ++n) {
        const int token = bw::step_row_token(n, m, rows);
        const int head = bw::step_row_head(n, m);
        ASSERT_GE(token, 0);
        ASSERT_LT(token, tokens) << where << ", row " << n;
        ASSERT_LT(head, m);
        ++seen[token * m + head];
        EXPECT_EQ(bw::row_quad(n), bw::row_quad(bw::proxy_row_of_token(token, m, rows))) << where << ", row " << n;
        const int first_row = n % 8;
        const int i = n / 8;
        EXPECT_EQ(token, (first_row / 2) * per_quad + 2 * i / m) << where << ", row " << n;
        EXPECT_EQ(head, first_row % 2 + 2 * i % m) << where << ", row " << n;
      }
      for (int count : seen) EXPECT_EQ(count, 1) << where;
      int proxy_rows = 0;
      for (int n = 0; n < bw::kProxyRowsPerStage; ++n) {
        const int token = bw::proxy_row_token(n, m, rows);
        if (token < 0) continue;
        ++proxy_rows;
        EXPECT_LT(n, bw::proxy_columns(m, rows)) << where;
        EXPECT_EQ(bw::proxy_row_of_token(token, m, rows), n) << where;
      }
      EXPECT_EQ(proxy_rows, tokens) << where;
      EXPECT_LE(bw::proxy_columns(m, rows), bw::kProxyRowsPerStage) << where;
    }
  }
}

// The backward zeroes its accumulators as one range of the workspace (kernel.cuh run_backward),
// which needs them adjacent in this order.
TEST(BackwardWorkspaceLayout, AccumulatorsAreOneOrderedRange) {
  for (auto [deterministic, dq_half] : {std::pair{false, false}, std::pair{false, true}, std::pair{true, false}}) {
    const kernels::backward::WorkspaceLayout layout =
        kernels::backward::workspace_layout(small_shape(2, 1000, 16, 2, 4, 1, 8, 128, 128), deterministic, dq_half);
    EXPECT_LT(layout.kv_bound, layout.dq_accum);  // the fp16 sums' range starts at kv_bound
    EXPECT_LT(layout.dq_accum, layout.dq_proxy_accum);
    EXPECT_LT(layout.dq_proxy_accum, layout.dk_accum);
    EXPECT_LT(layout.dk_accum, layout.dv_accum);
    EXPECT_LT(layout.dv_accum, layout.dk_proxy_accum);
    EXPECT_LT(layout.dk_proxy_accum, layout.kl_partial);
    EXPECT_LT(layout.kl_partial, layout.kl_sums);
    EXPECT_LE(layout.kl_sums, layout.total);
  }
}

// A chunk's keys are whole segments, one per (b, g), so the backward's segments tile the key range.
TEST(ScheduleKeys, ChunksAreWholeSegments) {
  for (const ProblemShape& shape : {small_shape(2, 1000, 16, 2, 4, 1, 8, 128, 128),
                                    small_shape(1, 4096, 64, 4, 16, 4, 16, 128, 128)}) {
    EXPECT_EQ(kernels::schedule::keys_per_chunk(shape),
              int64_t(shape.batch) * shape.num_kv_heads * kernels::schedule::keys_per_segment(shape));
  }
}

// The wgmma kernel's copy of the schedule's tiles lies outside the zeroed range and holds all of
// them; the deterministic mode (general kernel) has none.
TEST(BackwardWorkspaceLayout, DealtTilesHoldEveryTile) {
  const ProblemShape shape = small_shape(2, 1000, 16, 2, 4, 1, 8, 128, 128);
  const size_t tile_bytes = 16 * size_t(kernels::schedule::make_schedule_layout(shape).max_tiles);
  for (bool dq_half : {false, true}) {
    const kernels::backward::WorkspaceLayout layout = kernels::backward::workspace_layout(shape, false, dq_half);
    EXPECT_GE(layout.dealt_tiles, layout.kl_sums + 4 * size_t(kernels::backward::kKlSumBlocks));
    EXPECT_GE(layout.total - layout.dealt_tiles, tile_bytes);
  }
  const kernels::backward::WorkspaceLayout det = kernels::backward::workspace_layout(shape, true, false);
  EXPECT_EQ(det.dealt_tiles, size_t{0});
}

// bf16 inputs on the wgmma kernel sum dQ in fp16: the accumulator holds exactly B·S·H·D halves (the
// finish reads them at element offsets, kernel.cuh), and the workspace shrinks by as much. Where
// the general kernel runs (deterministic mode, M outside {2, 4, 8, 16}) or the inputs are fp16, the
// sums stay fp32, and the dtype-free size is the larger one.
TEST(BackwardWorkspaceLayout, HalfSumsTakeHalfTheDqBytes) {
  auto rounded = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const ProblemShape pipelined = small_shape(2, 1000, 16, 2, 4, 1, 8, 128, 128);  // M = 4
  const size_t elements = size_t(pipelined.batch * pipelined.seqlen) * pipelined.num_heads * pipelined.head_dim;
  const kernels::backward::WorkspaceLayout half = kernels::backward::workspace_layout(pipelined, false, true);
  const kernels::backward::WorkspaceLayout full = kernels::backward::workspace_layout(pipelined, false, false);
  EXPECT_EQ(half.dq_proxy_accum - half.dq_accum, rounded(2 * elements));
  EXPECT_EQ(full.dq_proxy_accum - full.dq_accum, rounded(4 * elements));
  EXPECT_EQ(full.total - half.total, rounded(4 * elements) - rounded(2 * elements));
  EXPECT_EQ(backward_workspace_size(pipelined, Mode::kSparse, false, DType::kBF16), half.total);
  EXPECT_EQ(backward_workspace_size(pipelined, Mode::kSparse, false, DType::kFP16), full.total);
  EXPECT_EQ(backward_workspace_size(pipelined, Mode::kSparse, false), full.total);
  const ProblemShape general = small_shape(1, 700, 12, 2, 4, 2, 4, 128, 128);  // M = 3
  for (const auto& [shape, deterministic] : {std::pair{pipelined, true}, std::pair{general, false}}) {
    EXPECT_EQ(backward_workspace_size(shape, Mode::kSparse, deterministic, DType::kBF16),
              backward_workspace_size(shape, Mode::kSparse, deterministic, DType::kFP16));
  }
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    EXPECT_EQ(backward_workspace_size(pipelined, Mode::kWarmup, false, dtype),
              backward_workspace_size(pipelined, Mode::kWarmup, false));
  }
}

}  // namespace
}  // namespace flashmsa::testing
