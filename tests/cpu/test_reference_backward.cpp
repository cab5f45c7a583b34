// SPEC.md §3-§4 in the reference backward, beyond the finite differences: sparse == warmup when
// every block is kept, the KL gradient reaches only the proxies and is linear in ḡ, identities
// that follow from Σ_j P = 1 and Σ_j (π - t) = 0, warmup ignoring block_idx, empty token sets and
// row / key-block subsets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "reference/reference.h"
#include "shapes.h"

namespace flashmsa::reference {
namespace {

// The five gradients, for loops over all of them.
constexpr std::vector<double> Gradients::*kAllGradients[] = {
    &Gradients::dq, &Gradients::dk, &Gradients::dv, &Gradients::dq_proxy, &Gradients::dk_proxy};

double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (double e : x) m = std::max(m, std::fabs(e));
  return m;
}

TEST(ReferenceBackward, SparseWithEveryBlockEqualsWarmup) {
  const ProblemShape s = testing::small_shape(1, 400, 8, 2, 4, 2, 5);  // K = 5 > NB = 4
  const Inputs in = random_inputs(s, 51, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const std::vector<double> dout = random_inputs(s, 52, DType::kBF16).q;
  for (Precision precision : {Precision::kFP64, Precision::kFP16}) {
    const Gradients sparse = backward(in, block_idx, dout, 0.5, Mode::kSparse, precision);
    const Gradients warmup = backward(in, {}, dout, 0.5, Mode::kWarmup, precision);
    for (auto grad : kAllGradients) EXPECT_EQ(sparse.*grad, warmup.*grad);
  }
}

TEST(ReferenceBackward, WarmupIgnoresBlockIdx) {
  const ProblemShape s = testing::small_shape(1, 300, 4, 2, 2, 1, 1);
  const Inputs in = random_inputs(s, 53, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const std::vector<double> dout = random_inputs(s, 54, DType::kBF16).q;
  const Gradients with = backward(in, block_idx, dout, 1.0, Mode::kWarmup, Precision::kFP64);
  const Gradients without = backward(in, {}, dout, 1.0, Mode::kWarmup, Precision::kFP64);
  const Gradients sparse = backward(in, block_idx, dout, 1.0, Mode::kSparse, Precision::kFP64);
  for (auto grad : kAllGradients) {
    EXPECT_EQ(with.*grad, without.*grad);
    EXPECT_NE(sparse.*grad, without.*grad);  // K = 1 < NB: the selection matters in sparse mode
  }
}

// The teacher is detached: ḡ moves only dq_proxy and dk_proxy, linearly, and dout does not.
TEST(ReferenceBackward, KlGradientReachesOnlyTheProxies) {
  const ProblemShape s = testing::small_shape(1, 300, 8, 2, 2, 1, 2);
  const Inputs in = random_inputs(s, 55, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const std::vector<double> dout = random_inputs(s, 56, DType::kBF16).q;
  const std::vector<double> no_dout(dout.size(), 0.0);
  const Gradients none = backward(in, block_idx, dout, 0.0, Mode::kSparse, Precision::kFP64);
  const Gradients one = backward(in, block_idx, dout, 1.0, Mode::kSparse, Precision::kFP64);
  const Gradients two = backward(in, block_idx, dout, 2.0, Mode::kSparse, Precision::kFP64);
  const Gradients kl_only = backward(in, block_idx, no_dout, 1.0, Mode::kSparse, Precision::kFP64);

  EXPECT_EQ(none.dq, two.dq);
  EXPECT_EQ(none.dk, two.dk);
  EXPECT_EQ(none.dv, two.dv);
  EXPECT_EQ(max_abs(none.dq_proxy), 0.0);
  EXPECT_EQ(max_abs(none.dk_proxy), 0.0);
  EXPECT_EQ(max_abs(kl_only.dq), 0.0);
  EXPECT_EQ(max_abs(kl_only.dv), 0.0);
  EXPECT_EQ(kl_only.dq_proxy, one.dq_proxy);
  EXPECT_EQ(kl_only.dk_proxy, one.dk_proxy);
  ASSERT_GT(max_abs(one.dq_proxy), 0.0);
  for (size_t e = 0; e < one.dq_proxy.size(); ++e)
    ASSERT_EQ(two.dq_proxy[e], 2.0 * one.dq_proxy[e]);
  for (size_t e = 0; e < one.dk_proxy.size(); ++e)
    ASSERT_EQ(two.dk_proxy[e], 2.0 * one.dk_proxy[e]);
}

// Σ_j dS_hij = 0 (because Δ = Σ_j P dP) and Σ_j (π - t) = 0 make the key gradients sum to zero
// over the keys; Σ_j P = 1 makes Σ_j dv_gj = Σ_{h∈g, i} dO_hi.
class GradientIdentities : public ::testing::TestWithParam<Mode> {};

TEST_P(GradientIdentities, KeySumsFollowFromTheSoftmax) {
  const ProblemShape s = testing::small_shape(2, 270, 6, 2, 2, 1, 2);
  const Inputs in = random_inputs(s, 57, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const std::vector<double> dout = random_inputs(s, 58, DType::kBF16).q;
  const Gradients g = backward(in, block_idx, dout, 3.0, GetParam(), Precision::kFP64);
  const int D = s.head_dim;
  const int G = s.num_heads / s.num_kv_heads;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int d = 0; d < D; ++d) {
      for (int kv = 0; kv < s.num_kv_heads; ++kv) {
        double dk_sum = 0.0;
        double dv_sum = 0.0;
        double dout_sum = 0.0;
        for (int64_t j = 0; j < s.seqlen; ++j) {
          dk_sum += g.dk[((b * s.seqlen + j) * s.num_kv_heads + kv) * D + d];
          dv_sum += g.dv[((b * s.seqlen + j) * s.num_kv_heads + kv) * D + d];
          for (int h = kv * G; h < (kv + 1) * G; ++h) {
            dout_sum += dout[((b * s.seqlen + j) * s.num_heads + h) * D + d];
          }
        }
        EXPECT_NEAR(dk_sum, 0.0, 1e-12 * max_abs(g.dk) * s.seqlen);
        EXPECT_NEAR(dv_sum, dout_sum, 1e-12 * s.seqlen * G);
      }
      double dk_proxy_sum = 0.0;
      for (int64_t j = 0; j < s.seqlen; ++j) dk_proxy_sum += g.dk_proxy[(b * s.seqlen + j) * D + d];
      EXPECT_NEAR(dk_proxy_sum, 0.0, 1e-12 * max_abs(g.dk_proxy) * s.seqlen);
    }
  }
  EXPECT_GT(max_abs(g.dk), 0.0);
  EXPECT_GT(max_abs(g.dk_proxy), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Reference, GradientIdentities,
                         ::testing::Values(Mode::kSparse, Mode::kWarmup),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return info.param == Mode::kSparse ? "sparse" : "warmup";
                         });

// Rows that attend to nothing contribute nothing, without NaN.
TEST(ReferenceBackward, EmptyTokenSetsGiveZeroGradients) {
  const ProblemShape s = testing::small_shape(1, 200, 2, 1, 1, 1, 1);
  const Inputs in = random_inputs(s, 59, DType::kBF16);
  const std::vector<int32_t> block_idx(s.seqlen, -1);
  const std::vector<double> dout = random_inputs(s, 60, DType::kBF16).q;
  const Gradients g = backward(in, block_idx, dout, 1.0, Mode::kSparse, Precision::kFP64);
  for (auto grad : kAllGradients) {
    for (double x : g.*grad) ASSERT_EQ(x, 0.0);
  }
}

// Row and key-block subsets give the full results on their entries (bit for bit: the same
// arithmetic) and NaN elsewhere.
class GradientSubsets : public ::testing::TestWithParam<std::tuple<Mode, Precision>> {};

TEST_P(GradientSubsets, MatchFullGradients) {
  const Mode mode = std::get<0>(GetParam());
  const Precision precision = std::get<1>(GetParam());
  const ProblemShape s = testing::small_shape(2, 300, 8, 2, 4, 2, 2);
  const Inputs in = random_inputs(s, 61, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const std::vector<double> dout = random_inputs(s, 62, DType::kBF16).q;
  const QueryRows rows = {{0, 5}, {1, 128}, {0, 299}, {1, 200}};
  const KeyBlocks blocks = {{1, 0}, {0, 2}};
  const Gradients full = backward(in, block_idx, dout, 0.8, mode, precision);
  const Gradients part = backward(in, block_idx, dout, 0.8, mode, precision, rows, blocks);

  auto in_rows = [&](int64_t b, int64_t i) {
    return std::any_of(rows.begin(), rows.end(),
                       [&](const QueryRow& r) { return r.batch == b && r.row == i; });
  };
  auto in_blocks = [&](int64_t b, int64_t j) {
    return std::any_of(blocks.begin(), blocks.end(), [&](const KeyBlock& kb) {
      return kb.batch == b && kb.block == j / kBlockSize;
    });
  };
  // Walks a [b, s, heads, dim] gradient, comparing the chosen (b, s) and checking NaN elsewhere.
  auto check = [&](const std::vector<double> Gradients::*grad, int heads, int dim, auto chosen) {
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t i = 0; i < s.seqlen; ++i) {
        for (int64_t e = (b * s.seqlen + i) * heads * dim; e < (b * s.seqlen + i + 1) * heads * dim;
             ++e) {
          if (chosen(b, i)) {
            ASSERT_EQ((part.*grad)[e], (full.*grad)[e]) << "b " << b << " s " << i;
          } else {
            ASSERT_TRUE(std::isnan((part.*grad)[e])) << "b " << b << " s " << i;
          }
        }
      }
    }
  };
  check(&Gradients::dq, s.num_heads, s.head_dim, in_rows);
  check(&Gradients::dq_proxy, s.num_proxy_heads, s.proxy_head_dim, in_rows);
  check(&Gradients::dk, s.num_kv_heads, s.head_dim, in_blocks);
  check(&Gradients::dv, s.num_kv_heads, s.head_dim, in_blocks);
  check(&Gradients::dk_proxy, s.num_proxy_kv_heads, s.proxy_head_dim, in_blocks);

  // Key blocks alone (no rows given means all rows) and rows alone agree too.
  const Gradients blocks_only = backward(in, block_idx, dout, 0.8, mode, precision, {}, blocks);
  EXPECT_EQ(blocks_only.dq, full.dq);
  const Gradients rows_only = backward(in, block_idx, dout, 0.8, mode, precision, rows);
  EXPECT_EQ(rows_only.dk_proxy, full.dk_proxy);
}

INSTANTIATE_TEST_SUITE_P(Reference, GradientSubsets,
                         ::testing::Combine(::testing::Values(Mode::kSparse, Mode::kWarmup),
                                            ::testing::Values(Precision::kFP64, Precision::kBF16)),
                         [](const ::testing::TestParamInfo<std::tuple<Mode, Precision>>& info) {
                           return std::string(std::get<0>(info.param) == Mode::kSparse ? "sparse"
                                                                                       : "warmup") +
                                  (std::get<1>(info.param) == Precision::kFP64 ? "_fp64" : "_bf16");
                         });

// A key block needs the selection of every row after it: a block_idx that select() filled for a
// few rows is rejected for key blocks instead of silently dropping the other rows.
TEST(ReferenceBackward, KeyBlocksRejectAPartialSelection) {
  const ProblemShape s = testing::small_shape(1, 2000, 2, 1, 1, 1, 3);
  const Inputs in = random_inputs(s, 63, DType::kBF16);
  const QueryRows rows = {{0, 1999}, {0, 700}};
  const std::vector<int32_t> partial = select(in, Precision::kFP64, rows);
  const std::vector<double> dout = random_inputs(s, 64, DType::kBF16).q;
  EXPECT_THROW(backward(in, partial, dout, 1.0, Mode::kSparse, Precision::kFP64, rows, {{0, 15}}),
               std::invalid_argument);
  const std::vector<int32_t> full = select(in, Precision::kFP64);
  const Gradients g =
      backward(in, full, dout, 1.0, Mode::kSparse, Precision::kFP64, rows, {{0, 15}});
  EXPECT_FALSE(std::isnan(g.dk[15 * kBlockSize * s.head_dim]));
}

TEST(ReferenceBackward, RejectsBadArguments) {
  const ProblemShape s = testing::small_shape(1, 200, 4, 2, 2, 1, 2);
  const Inputs in = random_inputs(s, 65, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const std::vector<double> dout = random_inputs(s, 66, DType::kBF16).q;
  EXPECT_THROW(
      backward(in, block_idx, std::vector<double>(5), 1.0, Mode::kSparse, Precision::kFP64),
      std::invalid_argument);
  EXPECT_THROW(
      backward(in, block_idx, dout, 1.0, Mode::kSparse, Precision::kFP64, {}, {{0, 2}}),  // NB = 2
      std::invalid_argument);
  EXPECT_THROW(backward(in, {}, dout, 1.0, Mode::kSparse, Precision::kFP64), std::invalid_argument);
  EXPECT_NO_THROW(backward(in, {}, dout, 1.0, Mode::kWarmup, Precision::kFP64));
}

}  // namespace
}  // namespace flashmsa::reference
