// Host-side invariants of the kernels' shared-memory layouts (src/kernels/forward/config.h), checked
// without a GPU: every supported head map fits the opt-in shared memory of one H100/H200 block, the
// wgmma operand tiles start on 1024-byte boundaries (the 128-byte swizzle's atom), and the pipeline
// keeps at least two stages.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace flashmsa::testing
