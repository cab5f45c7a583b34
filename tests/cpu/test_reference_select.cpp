// SPEC.md §1 in the reference: the local block first, descending block scores with ties to the
// smaller index, -1 in the slots beyond the visible blocks, agreement with a brute-force top-K,
// the proxy-head → proxy-key-head map and the row subsets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "reference/reference.h"
#include "shapes.h"

namespace flashmsa::reference {
namespace {

// Selection needs only the proxy heads; the main branch gets H = Hp, Hkv = 1.
ProblemShape make_shape(int64_t batch, int64_t seqlen, int proxy_heads, int proxy_kv_heads,
                        int top_k, int proxy_head_dim = 16) {
  return testing::small_shape(batch, seqlen, proxy_heads, 1, proxy_heads, proxy_kv_heads, top_k, 16,
                              proxy_head_dim);
}

const int32_t* slots_of(const std::vector<int32_t>& block_idx, const ProblemShape& s, int64_t b,
                        int p, int64_t i) {
  return &block_idx[((b * s.num_proxy_heads + p) * s.seqlen + i) * s.top_k];
}

// m_ic straight from the definition: max over j in block c, j <= i, of σp⟨q_proxy_pi, k_proxy_j⟩.
std::vector<double> brute_force_block_scores(const Inputs& in, int64_t b, int p, int64_t i) {
  const ProblemShape& s = in.shape;
  const int di = s.proxy_head_dim;
  const int pk = p / s.proxy_ratio();
  std::vector<double> m(i / kBlockSize + 1, -std::numeric_limits<double>::infinity());
  for (int64_t j = 0; j <= i; ++j) {
    double score = 0.0;
    for (int d = 0; d < di; ++d) {
      score += in.q_proxy[((b * s.seqlen + i) * s.num_proxy_heads + p) * di + d] *
               in.k_proxy[((b * s.seqlen + j) * s.num_proxy_kv_heads + pk) * di + d];
    }
    m[j / kBlockSize] = std::max(m[j / kBlockSize], score / std::sqrt(di));
  }
  m.back() = std::numeric_limits<double>::infinity();
  return m;
}

TEST(ReferenceSelect, LocalBlockComesFirst) {
  const ProblemShape s = make_shape(2, 500, 2, 1, 3);
  const std::vector<int32_t> block_idx =
      select(random_inputs(s, 1, DType::kBF16), Precision::kFP64);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int p = 0; p < s.num_proxy_heads; ++p) {
      for (int64_t i = 0; i < s.seqlen; ++i) {
        ASSERT_EQ(slots_of(block_idx, s, b, p, i)[0], i / kBlockSize) << "row " << i;
      }
    }
  }
}

TEST(ReferenceSelect, DescendingScoresTiesToSmallerIndexAndEmptySlots) {
  const ProblemShape s = make_shape(1, 700, 2, 1, 4);
  const Inputs in = random_inputs(s, 2, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  int rows_with_empty_slots = 0;
  for (int p = 0; p < s.num_proxy_heads; ++p) {
    for (int64_t i = 0; i < s.seqlen; ++i) {
      const std::vector<double> m = block_scores(in, 0, p, i, Precision::kFP64);
      const int32_t* slots = slots_of(block_idx, s, 0, p, i);
      const int visible = static_cast<int>(i / kBlockSize) + 1;
      for (int k = 0; k < s.top_k; ++k) {
        if (k >= visible) {
          ASSERT_EQ(slots[k], -1) << "row " << i << " slot " << k;
          continue;
        }
        ASSERT_GE(slots[k], 0);
        ASSERT_LT(slots[k], visible);
        if (k > 0) {
          const double prev = m[slots[k - 1]];
          const double cur = m[slots[k]];
          ASSERT_TRUE(prev > cur || (prev == cur && slots[k - 1] < slots[k]))
              << "row " << i << " slot " << k;
        }
      }
      rows_with_empty_slots += visible < s.top_k;
    }
  }
  EXPECT_EQ(rows_with_empty_slots, 2 * 3 * kBlockSize);  // rows of blocks 0-2, both proxy heads
}

TEST(ReferenceSelect, BlockScoresMatchTheDefinition) {
  const ProblemShape s = make_shape(2, 300, 2, 2, 2, 24);
  const Inputs in = random_inputs(s, 3, DType::kBF16);
  for (int64_t i : {0, 5, 127, 128, 200, 255, 256, 299}) {
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int p = 0; p < s.num_proxy_heads; ++p) {
        const std::vector<double> expected = brute_force_block_scores(in, b, p, i);
        const std::vector<double> m = block_scores(in, b, p, i, Precision::kFP64);
        ASSERT_EQ(m.size(), expected.size()) << "row " << i;
        for (size_t c = 0; c < m.size(); ++c) {
          if (std::isinf(expected[c])) {
            EXPECT_EQ(m[c], expected[c]);
          } else {
            EXPECT_NEAR(m[c], expected[c], 1e-12 * (1.0 + std::fabs(expected[c])));
          }
        }
        // The emulated precisions accumulate in fp32 on the same (bf16) inputs.
        const std::vector<double> m_bf16 = block_scores(in, b, p, i, Precision::kBF16);
        for (size_t c = 0; c + 1 < m.size(); ++c) {
          EXPECT_NEAR(m_bf16[c], m[c], 1e-5 * (1.0 + std::fabs(m[c])));
        }
      }
    }
  }
}

TEST(ReferenceSelect, MatchesBruteForceTopK) {
  const ProblemShape s = make_shape(1, 1000, 4, 2, 3);
  const Inputs in = random_inputs(s, 4, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  for (int p = 0; p < s.num_proxy_heads; ++p) {
    for (int64_t i = 0; i < s.seqlen; i += 7) {
      std::vector<double> m = brute_force_block_scores(in, 0, p, i);
      // Repeatedly take the largest remaining score; the first one found wins ties.
      for (int k = 0; k < s.top_k; ++k) {
        int best = -1;
        for (int c = 0; c < static_cast<int>(m.size()); ++c) {
          if (!std::isnan(m[c]) && (best < 0 || m[c] > m[best])) best = c;
        }
        ASSERT_EQ(slots_of(block_idx, s, 0, p, i)[k], best) << "row " << i << " slot " << k;
        if (best >= 0) m[best] = NAN;
      }
    }
  }
}

// Identical k_proxy blocks give exactly equal block scores in every precision.
TEST(ReferenceSelect, ExactTiesGoToTheSmallerBlock) {
  const ProblemShape s = make_shape(1, 640, 1, 1, 3);
  Inputs in = random_inputs(s, 5, DType::kBF16);
  const int64_t block_elems = kBlockSize * s.proxy_head_dim;
  for (int c = 1; c < 4; ++c) {
    std::copy_n(in.k_proxy.begin(), block_elems, in.k_proxy.begin() + c * block_elems);
  }
  for (Precision precision : {Precision::kFP64, Precision::kFP32, Precision::kBF16}) {
    const std::vector<int32_t> block_idx = select(in, precision);
    for (int64_t i = 3 * kBlockSize; i < s.seqlen; ++i) {
      const int32_t* slots = slots_of(block_idx, s, 0, 0, i);
      // Rows of block 3 see blocks 0-2 tie, rows of block 4 see blocks 0-3 tie.
      ASSERT_EQ(slots[0], i / kBlockSize);
      EXPECT_EQ(slots[1], 0) << "row " << i;
      EXPECT_EQ(slots[2], 1) << "row " << i;
    }
  }
}

// Two identical blocks that beat every other block: the earlier one is listed first.
TEST(ReferenceSelect, TiedLeadersAreOrderedByIndex) {
  const ProblemShape s = make_shape(1, 640, 1, 1, 3);
  Inputs in = random_inputs(s, 6, DType::kBF16);
  const int64_t block_elems = kBlockSize * s.proxy_head_dim;
  std::fill(in.q_proxy.begin(), in.q_proxy.end(), 1.0);
  for (int64_t e = 0; e < block_elems; ++e) {
    in.k_proxy[1 * block_elems + e] += 3.0;
    in.k_proxy[3 * block_elems + e] = in.k_proxy[1 * block_elems + e];
  }
  const int64_t row = 4 * kBlockSize + 17;
  const std::vector<double> m = block_scores(in, 0, 0, row, Precision::kFP64);
  ASSERT_EQ(m[1], m[3]);
  ASSERT_GT(m[1], std::max(m[0], m[2]));
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const int32_t* slots = slots_of(block_idx, s, 0, 0, row);
  EXPECT_EQ(slots[0], 4);
  EXPECT_EQ(slots[1], 1);
  EXPECT_EQ(slots[2], 3);
}

TEST(ReferenceSelect, PartialLastBlockAndLargeK) {
  const ProblemShape s = make_shape(1, 300, 1, 1, kMaxTopK);
  const Inputs in = random_inputs(s, 7, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  EXPECT_EQ(block_scores(in, 0, 0, 299, Precision::kFP64).size(), 3u);
  for (int64_t i = 0; i < s.seqlen; ++i) {
    const int32_t* slots = slots_of(block_idx, s, 0, 0, i);
    const int visible = static_cast<int>(i / kBlockSize) + 1;
    std::vector<int32_t> chosen(slots, slots + visible);
    std::sort(chosen.begin(), chosen.end());
    for (int c = 0; c < visible; ++c) ASSERT_EQ(chosen[c], c) << "every visible block is kept";
    for (int k = visible; k < s.top_k; ++k) ASSERT_EQ(slots[k], -1);
  }
}

// Proxy head p reads proxy key head p / R: changing key head 1 moves only heads 2 and 3.
TEST(ReferenceSelect, ProxyHeadsReadTheirProxyKeyHead) {
  const ProblemShape s = make_shape(1, 600, 4, 2, 2);
  Inputs in = random_inputs(s, 8, DType::kBF16);
  const std::vector<int32_t> before = select(in, Precision::kFP64);
  const int di = s.proxy_head_dim;
  for (int64_t j = 0; j < s.seqlen; ++j) {
    for (int d = 0; d < di; ++d) in.k_proxy[(j * 2 + 1) * di + d] *= (j % 3 == 0 ? -2.0 : 0.5);
  }
  const std::vector<int32_t> after = select(in, Precision::kFP64);
  int changed_rows = 0;
  for (int p = 0; p < s.num_proxy_heads; ++p) {
    for (int64_t i = 0; i < s.seqlen; ++i) {
      const bool same = std::equal(slots_of(before, s, 0, p, i), slots_of(before, s, 0, p, i) + 2,
                                   slots_of(after, s, 0, p, i));
      if (p < 2) {
        ASSERT_TRUE(same) << "proxy head " << p << " row " << i;
      } else {
        changed_rows += !same;
      }
    }
  }
  EXPECT_GT(changed_rows, 0);
}

TEST(ReferenceSelect, RowSubsetMatchesFullSelection) {
  const ProblemShape s = make_shape(2, 400, 2, 1, 2);
  const Inputs in = random_inputs(s, 9, DType::kBF16);
  const std::vector<int32_t> full = select(in, Precision::kFP64);
  const QueryRows rows = {{0, 0}, {0, 257}, {1, 399}, {1, 128}};
  const std::vector<int32_t> subset = select(in, Precision::kFP64, rows);
  ASSERT_EQ(subset.size(), full.size());
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int p = 0; p < s.num_proxy_heads; ++p) {
      for (int64_t i = 0; i < s.seqlen; ++i) {
        const bool chosen = std::any_of(rows.begin(), rows.end(), [&](const QueryRow& r) {
          return r.batch == b && r.row == i;
        });
        for (int k = 0; k < s.top_k; ++k) {
          const int32_t expected =
              chosen ? slots_of(full, s, b, p, i)[k] : std::numeric_limits<int32_t>::min();
          ASSERT_EQ(slots_of(subset, s, b, p, i)[k], expected) << b << " " << p << " " << i;
        }
      }
    }
  }
}

TEST(ReferenceSelect, RejectsBadArguments) {
  ProblemShape s = make_shape(1, 200, 2, 1, 0);
  const Inputs in = random_inputs(s, 10, DType::kBF16);
  EXPECT_THROW(select(in, Precision::kFP64), std::invalid_argument);  // K = 0
  Inputs too_many = in;
  too_many.shape.top_k = kMaxTopK + 1;
  EXPECT_THROW(select(too_many, Precision::kFP64), std::invalid_argument);
  Inputs ok = in;
  ok.shape.top_k = 2;
  EXPECT_NO_THROW(select(ok, Precision::kFP64));
  EXPECT_THROW(select(ok, Precision::kFP64, {{0, 200}}), std::invalid_argument);  // row >= S
  EXPECT_THROW(select(ok, Precision::kFP64, {{1, 0}}), std::invalid_argument);    // batch >= B
  Inputs short_proxy = ok;
  short_proxy.k_proxy.pop_back();
  EXPECT_THROW(select(short_proxy, Precision::kFP64), std::invalid_argument);
  Inputs bad_heads = ok;
  bad_heads.shape.num_proxy_kv_heads = 3;  // Hp % Hpk != 0
  EXPECT_THROW(select(bad_heads, Precision::kFP64), std::invalid_argument);
}

}  // namespace
}  // namespace flashmsa::reference
