// Host-side invariants of the kernels' shared-memory layouts (src/kernels/forward/config.h,
// src/kernels/backward/config.h), checked without a GPU: every supported head map fits the opt-in
// shared memory of one H100/H200 block, the wgmma operand tiles start on 1024-byte boundaries (the
// 128-byte swizzle's atom), and the pipelines keep at least two stages.
#include <gtest/gtest.h>

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
    EXPECT_LE(layout.total, kernels::forward::kMaxDynamicSharedBytes) << "M = " << m;
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
  const kernels::backward::PipelinedLayout layout = kernels::backward::make_pipelined_layout();
  EXPECT_LE(layout.total, kernels::forward::kMaxDynamicSharedBytes);
  for (uint32_t offset : {layout.k, layout.v, layout.kp, layout.q, layout.dout, layout.qp, layout.ds, layout.g,
                          layout.qp_flush}) {
    EXPECT_EQ(offset % 1024, 0u);
  }
  // Per-stage tiles are whole 1024-byte atoms, so every stage's tile is aligned too.
  EXPECT_EQ(kernels::backward::kStepRows * kernels::backward::kHeadDim * 2 % 1024, 0);
  EXPECT_EQ(kernels::backward::kProxyRowsPerStage * kernels::backward::kHeadDim * 2 % 1024, 0);
  EXPECT_EQ(layout.meta % 16, 0u);  // float2 loads of (LSE, Δ) pairs
  EXPECT_EQ(sizeof(kernels::backward::StepMeta) % 16, 0u);
  EXPECT_EQ(layout.barriers % 8, 0u);
}

TEST(PipelinedBackwardLayout, ServesPowerOfTwoHeadMapsInNonDeterministicMode) {
  for (int m = 1; m <= 16; ++m) {
    const bool power_of_two = m == 2 || m == 4 || m == 8 || m == 16;
    EXPECT_EQ(kernels::backward::pipelined_supported(m, false), power_of_two) << "M = " << m;
    EXPECT_FALSE(kernels::backward::pipelined_supported(m, true)) << "M = " << m;
    if (power_of_two) {
      // A step's tokens (4·⌊16/M⌋) fit the metadata and the staged proxy rows.
      EXPECT_LE(4 * (16 / m), kernels::backward::kMaxStepTokens) << "M = " << m;
      EXPECT_LE(4 * (16 / m), kernels::backward::kFlushTokens) << "M = " << m;
    }
  }
}

}  // namespace
}  // namespace flashmsa::testing
