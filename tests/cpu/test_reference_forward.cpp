// SPEC.md §2, §3 and §5 in the reference forward: the softmax over T, O against a direct
// evaluation, sparse == warmup when every block is kept, the KL's properties (zero when the proxy
// reproduces the teacher, non-negative, the mean of its rows), set semantics of block_idx, empty
// token sets, row subsets and argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "reference/reference.h"
#include "shapes.h"

namespace flashmsa::reference {
namespace {

// T_pi read directly off block_idx: j <= i whose block is listed.
std::vector<int64_t> tokens_from_block_idx(const ProblemShape& s,
                                           const std::vector<int32_t>& block_idx, int64_t b, int p,
                                           int64_t i) {
  const int32_t* slots = &block_idx[((b * s.num_proxy_heads + p) * s.seqlen + i) * s.top_k];
  std::vector<int64_t> tokens;
  for (int64_t j = 0; j <= i; ++j) {
    if (std::find(slots, slots + s.top_k, j / kBlockSize) != slots + s.top_k) tokens.push_back(j);
  }
  return tokens;
}

// z_hij straight from the inputs.
double direct_score(const Inputs& in, int64_t b, int h, int64_t i, int64_t j) {
  const ProblemShape& s = in.shape;
  const int g = h / (s.num_heads / s.num_kv_heads);
  double z = 0.0;
  for (int d = 0; d < s.head_dim; ++d) {
    z += in.q[((b * s.seqlen + i) * s.num_heads + h) * s.head_dim + d] *
         in.k[((b * s.seqlen + j) * s.num_kv_heads + g) * s.head_dim + d];
  }
  return z / std::sqrt(s.head_dim);
}

// For sampled rows: Σ_{j∈T} exp(z - LSE) = 1 and O = Σ_{j∈T} P v, evaluated from scratch.
class DirectEvaluation : public ::testing::TestWithParam<int> {};

TEST_P(DirectEvaluation, SoftmaxSumsToOneAndOutputIsTheWeightedSum) {
  const int head_dim = GetParam();
  const ProblemShape s = testing::small_shape(2, 333, 4, 2, 2, 1, 2, head_dim);
  const Inputs in = random_inputs(s, 31, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const ForwardOutputs f = forward(in, block_idx, Mode::kSparse, Precision::kFP64);
  const int M = s.num_heads / s.num_proxy_heads;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i : {0, 64, 127, 128, 255, 256, 300, 332}) {
      for (int h = 0; h < s.num_heads; ++h) {
        const std::vector<int64_t> tokens = tokens_from_block_idx(s, block_idx, b, h / M, i);
        const double lse = f.lse[(b * s.num_heads + h) * s.seqlen + i];
        const int g = h / (s.num_heads / s.num_kv_heads);
        double total = 0.0;
        std::vector<double> out(head_dim, 0.0);
        for (int64_t j : tokens) {
          const double P = std::exp(direct_score(in, b, h, i, j) - lse);
          total += P;
          for (int d = 0; d < head_dim; ++d) {
            out[d] += P * in.v[((b * s.seqlen + j) * s.num_kv_heads + g) * head_dim + d];
          }
        }
        EXPECT_NEAR(total, 1.0, 1e-12) << "b " << b << " h " << h << " i " << i;
        for (int d = 0; d < head_dim; ++d) {
          EXPECT_NEAR(f.out[((b * s.seqlen + i) * s.num_heads + h) * head_dim + d], out[d], 1e-12);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Reference, DirectEvaluation, ::testing::Values(16, 128),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "D" + std::to_string(info.param);
                         });

TEST(ReferenceForward, SparseWithEveryBlockEqualsWarmup) {
  const ProblemShape s = testing::small_shape(1, 500, 8, 2, 4, 1, 4);  // K = NB = 4
  const Inputs in = random_inputs(s, 32, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  for (Precision precision : {Precision::kFP64, Precision::kBF16}) {
    const ForwardOutputs sparse = forward(in, block_idx, Mode::kSparse, precision);
    const ForwardOutputs warmup = forward(in, {}, Mode::kWarmup, precision);
    EXPECT_EQ(sparse.out, warmup.out);
    EXPECT_EQ(sparse.lse, warmup.lse);
    EXPECT_EQ(sparse.proxy_lse, warmup.proxy_lse);
    EXPECT_EQ(sparse.kl_rows, warmup.kl_rows);
    EXPECT_EQ(sparse.kl, warmup.kl);
  }
}

TEST(ReferenceForward, WarmupIgnoresBlockIdx) {
  const ProblemShape s = testing::small_shape(1, 400, 4, 2, 2, 1, 2);
  const Inputs in = random_inputs(s, 33, DType::kBF16);
  const std::vector<int32_t> selected = select(in, Precision::kFP64);
  const std::vector<int32_t> only_block_zero(selected.size(), 0);
  const ForwardOutputs empty = forward(in, {}, Mode::kWarmup, Precision::kFP64);
  const ForwardOutputs with_selection = forward(in, selected, Mode::kWarmup, Precision::kFP64);
  const ForwardOutputs with_block_zero =
      forward(in, only_block_zero, Mode::kWarmup, Precision::kFP64);
  EXPECT_EQ(empty.out, with_selection.out);
  EXPECT_EQ(empty.out, with_block_zero.out);
  EXPECT_EQ(empty.kl_rows, with_block_zero.kl_rows);
  // The same block_idx does change the sparse result, so the comparison above is not vacuous.
  EXPECT_NE(forward(in, only_block_zero, Mode::kSparse, Precision::kFP64).out, empty.out);
}

// With M = 1, Hpk = Hkv (so p -> p/R is h -> h/G) and proxies that reproduce the main scores,
// π = P = t and the KL vanishes in both modes.
class KlOfAPerfectProxy : public ::testing::TestWithParam<Mode> {};

TEST_P(KlOfAPerfectProxy, IsZero) {
  const ProblemShape s = testing::small_shape(1, 400, 4, 2, 4, 2, 2);
  Inputs in = random_inputs(s, 34, DType::kBF16);
  in.proxy_scale = 2.0 / std::sqrt(s.head_dim);  // σp = 2σ, so q_proxy = q / 2 gives s = z
  for (size_t e = 0; e < in.q.size(); ++e) in.q_proxy[e] = in.q[e] / 2.0;
  in.k_proxy = in.k;
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const ForwardOutputs f = forward(in, block_idx, GetParam(), Precision::kFP64);
  EXPECT_LT(std::fabs(f.kl), 1e-12);
  for (double kl_row : f.kl_rows) ASSERT_LT(std::fabs(kl_row), 1e-12);
  for (size_t e = 0; e < f.lse.size(); ++e) ASSERT_NEAR(f.proxy_lse[e], f.lse[e], 1e-12);

  // Perturbing one proxy key breaks the match: the KL becomes positive.
  in.k_proxy[5] += 1.0;
  EXPECT_GT(forward(in, block_idx, GetParam(), Precision::kFP64).kl, 1e-8);
}

INSTANTIATE_TEST_SUITE_P(Reference, KlOfAPerfectProxy,
                         ::testing::Values(Mode::kSparse, Mode::kWarmup),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return info.param == Mode::kSparse ? "sparse" : "warmup";
                         });

TEST(ReferenceForward, KlIsNonNegativeAndTheMeanOfItsRows) {
  const ProblemShape s = testing::small_shape(2, 300, 8, 2, 2, 1, 2);  // M = 4
  const Inputs in = random_inputs(s, 35, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  for (Mode mode : {Mode::kSparse, Mode::kWarmup}) {
    const ForwardOutputs f = forward(in, block_idx, mode, Precision::kFP64);
    double sum = 0.0;
    for (double kl_row : f.kl_rows) {
      ASSERT_GE(kl_row, -1e-15);
      sum += kl_row;
    }
    EXPECT_GT(f.kl, 0.0);
    EXPECT_NEAR(f.kl, sum / (s.batch * s.num_proxy_heads * s.seqlen), 1e-14);
  }
}

// One KL row from the definition: t = mean of the group's P, π = softmax of the proxy scores.
TEST(ReferenceForward, KlRowMatchesTheDefinition) {
  const ProblemShape s = testing::small_shape(1, 300, 6, 2, 2, 1, 2);  // M = 3
  const Inputs in = random_inputs(s, 36, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const ForwardOutputs f = forward(in, block_idx, Mode::kSparse, Precision::kFP64);
  const int M = 3;
  const int di = s.proxy_head_dim;
  for (int p = 0; p < s.num_proxy_heads; ++p) {
    for (int64_t i : {3, 130, 299}) {
      const std::vector<int64_t> tokens = tokens_from_block_idx(s, block_idx, 0, p, i);
      std::vector<double> teacher(tokens.size(), 0.0);
      std::vector<double> proxy(tokens.size(), 0.0);
      for (size_t t = 0; t < tokens.size(); ++t) {
        for (int m = 0; m < M; ++m) {
          const int h = p * M + m;
          teacher[t] +=
              std::exp(direct_score(in, 0, h, i, tokens[t]) - f.lse[h * s.seqlen + i]) / M;
        }
        for (int d = 0; d < di; ++d) {
          proxy[t] += in.q_proxy[(i * s.num_proxy_heads + p) * di + d] *
                      in.k_proxy[tokens[t] * di + d] / std::sqrt(di);
        }
      }
      double normalizer = 0.0;
      for (double x : proxy) normalizer += std::exp(x);
      double kl = 0.0;
      for (size_t t = 0; t < tokens.size(); ++t) {
        kl += teacher[t] * (std::log(teacher[t]) - (proxy[t] - std::log(normalizer)));
      }
      EXPECT_NEAR(f.kl_rows[p * s.seqlen + i], kl, 1e-12) << "p " << p << " i " << i;
      EXPECT_NEAR(f.proxy_lse[p * s.seqlen + i], std::log(normalizer), 1e-12);
    }
  }
}

// Changing keys and values in a block that row i did not select leaves its outputs untouched.
TEST(ReferenceForward, SparseRowsIgnoreUnselectedBlocks) {
  const ProblemShape s = testing::small_shape(1, 640, 2, 1, 1, 1, 2);
  Inputs in = random_inputs(s, 37, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const int64_t row = s.seqlen - 1;
  const int32_t* slots = &block_idx[row * s.top_k];
  int64_t unselected = 0;
  while (std::find(slots, slots + s.top_k, unselected) != slots + s.top_k) ++unselected;
  const ForwardOutputs before = forward(in, block_idx, Mode::kSparse, Precision::kFP64);
  for (int64_t j = unselected * kBlockSize; j < (unselected + 1) * kBlockSize; ++j) {
    for (int d = 0; d < s.head_dim; ++d) {
      in.k[j * s.head_dim + d] += 1.0;
      in.v[j * s.head_dim + d] -= 2.0;
    }
  }
  const ForwardOutputs after = forward(in, block_idx, Mode::kSparse, Precision::kFP64);
  for (int h = 0; h < s.num_heads; ++h) {
    EXPECT_EQ(after.lse[h * s.seqlen + row], before.lse[h * s.seqlen + row]);
    for (int d = 0; d < s.head_dim; ++d) {
      const int64_t e = (row * s.num_heads + h) * s.head_dim + d;
      EXPECT_EQ(after.out[e], before.out[e]);
    }
  }
  EXPECT_EQ(after.kl_rows[row], before.kl_rows[row]);
  EXPECT_NE(after.out, before.out);  // rows that did select the block moved
}

// T is a set: a repeated block counts once, -1 slots add nothing, and blocks after c(i) add
// nothing.
TEST(ReferenceForward, BlockIdxHasSetSemantics) {
  const ProblemShape s = testing::small_shape(1, 300, 4, 2, 2, 1, 3);
  const Inputs in = random_inputs(s, 38, DType::kBF16);
  std::vector<int32_t> plain(s.num_proxy_heads * s.seqlen * s.top_k);
  std::vector<int32_t> noisy(plain.size());
  for (int p = 0; p < s.num_proxy_heads; ++p) {
    for (int64_t i = 0; i < s.seqlen; ++i) {
      int32_t* a = &plain[(p * s.seqlen + i) * s.top_k];
      int32_t* b = &noisy[(p * s.seqlen + i) * s.top_k];
      const int32_t local = static_cast<int32_t>(i / kBlockSize);
      a[0] = local, a[1] = 0, a[2] = -1;
      b[0] = 0, b[1] = local, b[2] = local < 2 ? 2 : 0;  // a future block or a repeat
    }
  }
  const ForwardOutputs a = forward(in, plain, Mode::kSparse, Precision::kFP64);
  const ForwardOutputs b = forward(in, noisy, Mode::kSparse, Precision::kFP64);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.kl_rows, b.kl_rows);
}

// A row that selected nothing attends to nothing: O = 0, LSE = -inf, no NaN anywhere.
TEST(ReferenceForward, EmptyTokenSetGivesZeroOutputWithoutNaN) {
  const ProblemShape s = testing::small_shape(1, 200, 2, 1, 1, 1, 1);
  const Inputs in = random_inputs(s, 39, DType::kBF16);
  std::vector<int32_t> block_idx(s.seqlen, -1);
  block_idx[150] = 1;  // one row keeps its local block
  for (Precision precision : {Precision::kFP64, Precision::kBF16}) {
    const ForwardOutputs f = forward(in, block_idx, Mode::kSparse, precision);
    for (int64_t i = 0; i < s.seqlen; ++i) {
      const bool attends = i == 150;
      for (int h = 0; h < s.num_heads; ++h) {
        const double lse = f.lse[h * s.seqlen + i];
        EXPECT_EQ(std::isfinite(lse), attends) << i;
        if (!attends) {
          EXPECT_EQ(lse, -std::numeric_limits<double>::infinity());
        }
        for (int d = 0; d < s.head_dim; ++d) {
          const double o = f.out[(i * s.num_heads + h) * s.head_dim + d];
          ASSERT_FALSE(std::isnan(o));
          if (!attends) {
            ASSERT_EQ(o, 0.0);
          }
        }
      }
      if (attends) {
        EXPECT_GT(f.kl_rows[i], 0.0);
      } else {
        EXPECT_EQ(f.kl_rows[i], 0.0);  // an empty sum
      }
    }
    EXPECT_FALSE(std::isnan(f.kl));
  }
}

// A row whose every selected score is -inf (a key of -inf against a positive query component)
// has no mass: O = 0 and LSE = -inf as for an empty set, never NaN (SPEC.md §6); rows that see
// finite scores are unchanged.
TEST(ReferenceForward, AllMinusInfinityScoresGiveZeroOutputWithoutNaN) {
  const ProblemShape s = testing::small_shape(1, 256, 2, 1, 1, 1, 1);
  Inputs in = random_inputs(s, 41, DType::kBF16);
  for (int64_t i = 0; i < s.seqlen; ++i) {
    for (int h = 0; h < s.num_heads; ++h) in.q[(i * s.num_heads + h) * s.head_dim] = 1.0;
  }
  const ForwardOutputs finite = forward(in, select(in, Precision::kFP64), Mode::kSparse,
                                        Precision::kFP64);
  for (int64_t j = kBlockSize; j < s.seqlen; ++j) {
    in.k[j * s.num_kv_heads * s.head_dim] = -std::numeric_limits<double>::infinity();
  }
  // K = 1: every row attends to its own block only, so the rows of block 1 see only -inf scores.
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  for (Precision precision : {Precision::kFP64, Precision::kBF16}) {
    const ForwardOutputs f = forward(in, block_idx, Mode::kSparse, precision);
    for (int64_t i = 0; i < s.seqlen; ++i) {
      const bool masked = i >= kBlockSize;
      for (int h = 0; h < s.num_heads; ++h) {
        const int64_t at = h * s.seqlen + i;
        if (masked) {
          EXPECT_EQ(f.lse[at], -std::numeric_limits<double>::infinity()) << i;
        } else if (precision == Precision::kFP64) {
          EXPECT_EQ(f.lse[at], finite.lse[at]) << i;
        }
        for (int d = 0; d < s.head_dim; ++d) {
          const double o = f.out[(i * s.num_heads + h) * s.head_dim + d];
          ASSERT_FALSE(std::isnan(o)) << "row " << i << ", head " << h;
          if (masked) ASSERT_EQ(o, 0.0) << "row " << i << ", head " << h;
        }
      }
      EXPECT_TRUE(std::isfinite(f.proxy_lse[i])) << i;
      EXPECT_FALSE(std::isnan(f.kl_rows[i])) << i;
    }
    EXPECT_FALSE(std::isnan(f.kl));
  }
}

TEST(ReferenceForward, RowSubsetMatchesFullRowsAndLeavesTheRestNaN) {
  const ProblemShape s = testing::small_shape(2, 300, 6, 2, 2, 2, 2);
  const Inputs in = random_inputs(s, 40, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const QueryRows rows = {{0, 0}, {1, 129}, {1, 299}, {0, 200}};
  for (Precision precision : {Precision::kFP64, Precision::kBF16}) {
    const ForwardOutputs full = forward(in, block_idx, Mode::kSparse, precision);
    const ForwardOutputs part = forward(in, block_idx, Mode::kSparse, precision, rows);
    EXPECT_TRUE(std::isnan(part.kl));
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t i = 0; i < s.seqlen; ++i) {
        const bool chosen = std::any_of(rows.begin(), rows.end(), [&](const QueryRow& r) {
          return r.batch == b && r.row == i;
        });
        auto check = [&](const std::vector<double>& sub, const std::vector<double>& all,
                         int64_t e) {
          if (chosen) {
            ASSERT_EQ(sub[e], all[e]);
          } else {
            ASSERT_TRUE(std::isnan(sub[e]));
          }
        };
        for (int h = 0; h < s.num_heads; ++h) {
          check(part.lse, full.lse, (b * s.num_heads + h) * s.seqlen + i);
          for (int d = 0; d < s.head_dim; ++d) {
            check(part.out, full.out, ((b * s.seqlen + i) * s.num_heads + h) * s.head_dim + d);
          }
        }
        for (int p = 0; p < s.num_proxy_heads; ++p) {
          check(part.proxy_lse, full.proxy_lse, (b * s.num_proxy_heads + p) * s.seqlen + i);
          check(part.kl_rows, full.kl_rows, (b * s.num_proxy_heads + p) * s.seqlen + i);
        }
      }
    }
  }
}

// A few rows of a long sequence cost O(rows · |T| · D): 64K tokens are no problem.
TEST(ReferenceForward, SampledRowsOfALongSequence) {
  const ProblemShape s = testing::small_shape(1, 65536 + 77, 2, 1, 1, 1, 4);
  const Inputs in = random_inputs(s, 41, DType::kBF16);
  const QueryRows rows = {{0, 1000}, {0, 40000}, {0, s.seqlen - 1}};
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64, rows);
  const ForwardOutputs f = forward(in, block_idx, Mode::kSparse, Precision::kFP64, rows);
  for (const QueryRow& r : rows) {
    const std::vector<int64_t> tokens = tokens_from_block_idx(s, block_idx, 0, 0, r.row);
    EXPECT_EQ(tokens.size(), 3u * kBlockSize + r.row % kBlockSize + 1);  // 3 full blocks + local
    for (int h = 0; h < s.num_heads; ++h) {
      double total = 0.0;
      for (int64_t j : tokens) {
        total += std::exp(direct_score(in, 0, h, r.row, j) - f.lse[h * s.seqlen + r.row]);
      }
      EXPECT_NEAR(total, 1.0, 1e-12);
    }
  }
}

TEST(ReferenceForward, RejectsBadArguments) {
  const ProblemShape s = testing::small_shape(1, 200, 4, 2, 2, 1, 2);
  const Inputs in = random_inputs(s, 42, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  EXPECT_THROW(forward(in, {}, Mode::kSparse, Precision::kFP64), std::invalid_argument);
  std::vector<int32_t> out_of_range = block_idx;
  out_of_range[7] = 2;  // NB = 2
  EXPECT_THROW(forward(in, out_of_range, Mode::kSparse, Precision::kFP64), std::invalid_argument);
  out_of_range[7] = -2;
  EXPECT_THROW(forward(in, out_of_range, Mode::kSparse, Precision::kFP64), std::invalid_argument);
  EXPECT_THROW(forward(in, block_idx, Mode::kSparse, Precision::kFP64, {{0, -1}}),
               std::invalid_argument);
  Inputs bad = in;
  bad.shape.num_kv_heads = 3;  // H % Hkv != 0
  EXPECT_THROW(forward(bad, block_idx, Mode::kWarmup, Precision::kFP64), std::invalid_argument);
  bad = in;
  bad.shape.num_proxy_heads = 1;  // Hp % Hkv != 0
  EXPECT_THROW(forward(bad, {}, Mode::kWarmup, Precision::kFP64), std::invalid_argument);
  bad = in;
  bad.softmax_scale = -1.0;
  EXPECT_THROW(forward(bad, {}, Mode::kWarmup, Precision::kFP64), std::invalid_argument);
  EXPECT_THROW(loss(in, block_idx, std::vector<double>(3), 0.0, Mode::kSparse),
               std::invalid_argument);
}

}  // namespace
}  // namespace flashmsa::reference
