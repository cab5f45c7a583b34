// reference::recall: block and score recall of a selection against the dense teacher, checked
// against the definition written out here (teacher from reference::score, block masses, the
// teacher's top blocks by mass with ties to the smaller block).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "reference/reference.h"
#include "shapes.h"

namespace flashmsa::reference {
namespace {

// Block masses of the teacher (mean over p's heads of the causal softmax) for row (b, i).
std::vector<double> teacher_masses(const Inputs& in, int64_t b, int p, int64_t i) {
  const ProblemShape& s = in.shape;
  const int M = s.heads_per_proxy();
  std::vector<double> mass(i / kBlockSize + 1, 0.0);
  for (int h = p * M; h < (p + 1) * M; ++h) {
    std::vector<double> z(i + 1);
    double top = -INFINITY;
    for (int64_t j = 0; j <= i; ++j) top = std::max(top, z[j] = score(in, b, h, i, j, Precision::kFP64));
    double sum = 0.0;
    for (int64_t j = 0; j <= i; ++j) sum += std::exp(z[j] - top);
    for (int64_t j = 0; j <= i; ++j) mass[j / kBlockSize] += std::exp(z[j] - top) / sum / M;
  }
  return mass;
}

// The teacher's top min(K, visible) blocks: mass descending, ties to the smaller block.
std::vector<int64_t> teacher_top(const std::vector<double>& mass, int top_k) {
  std::vector<int64_t> order(mass.size());
  for (size_t c = 0; c < order.size(); ++c) order[c] = int64_t(c);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return mass[a] != mass[b] ? mass[a] > mass[b] : a < b;
  });
  order.resize(std::min<size_t>(order.size(), size_t(top_k)));
  return order;
}

Inputs make_inputs(int top_k, uint64_t seed) {
  // H = 4, Hkv = 2, Hp = 2, Hpk = 1: M = 2 heads per proxy head; 5 blocks, the last one partial.
  return random_inputs(testing::small_shape(2, 600, 4, 2, 2, 1, top_k, 16, 16), seed, DType::kBF16);
}

TEST(ReferenceRecall, MatchesTheDefinitionOnTheProxySelection) {
  const Inputs in = make_inputs(2, 11);
  const ProblemShape& s = in.shape;
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  double block = 0.0, kept = 0.0;
  int64_t count = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i = 0; i < s.seqlen; ++i) {
      for (int p = 0; p < s.num_proxy_heads; ++p) {
        const std::vector<double> mass = teacher_masses(in, b, p, i);
        const std::vector<int64_t> best = teacher_top(mass, s.top_k);
        const int32_t* slots = &block_idx[((b * s.num_proxy_heads + p) * s.seqlen + i) * s.top_k];
        int hits = 0;
        for (int k = 0; k < s.top_k; ++k) {
          if (slots[k] < 0) continue;
          kept += mass[slots[k]];
          hits += std::count(best.begin(), best.end(), int64_t(slots[k])) > 0 ? 1 : 0;
        }
        block += double(hits) / double(best.size());
        ++count;
      }
    }
  }
  const Recall recall = reference::recall(in, block_idx);
  EXPECT_NEAR(recall.block, block / count, 1e-12);
  EXPECT_NEAR(recall.score, kept / count, 1e-12);
  // Random proxies keeping 2 of up to 5 blocks: neither perfect nor empty.
  EXPECT_GT(recall.block, 0.0);
  EXPECT_LT(recall.block, 1.0);
  EXPECT_LT(recall.score, 1.0);
}

TEST(ReferenceRecall, TheTeachersOwnChoiceIsPerfectAndEverythingKeptIsFull) {
  const Inputs in = make_inputs(2, 12);
  const ProblemShape& s = in.shape;
  std::vector<int32_t> oracle(s.batch * s.num_proxy_heads * s.seqlen * s.top_k, -1);
  double best_mass = 0.0;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int p = 0; p < s.num_proxy_heads; ++p) {
      for (int64_t i = 0; i < s.seqlen; ++i) {
        const std::vector<double> mass = teacher_masses(in, b, p, i);
        const std::vector<int64_t> best = teacher_top(mass, s.top_k);
        for (size_t k = 0; k < best.size(); ++k) {
          oracle[((b * s.num_proxy_heads + p) * s.seqlen + i) * s.top_k + k] = int32_t(best[k]);
          best_mass += mass[best[k]];
        }
      }
    }
  }
  const Recall perfect = reference::recall(in, oracle);
  EXPECT_NEAR(perfect.block, 1.0, 1e-12);
  EXPECT_NEAR(perfect.score, best_mass / double(s.batch * s.num_proxy_heads * s.seqlen), 1e-12);
  // Any selection scores at most the oracle's mass.
  EXPECT_LE(reference::recall(in, select(in, Precision::kFP64)).score, perfect.score + 1e-12);

  const Inputs all = make_inputs(8, 12);  // K = 8 >= the 5 blocks: every visible block kept
  const Recall full = reference::recall(all, select(all, Precision::kFP64));
  EXPECT_NEAR(full.block, 1.0, 1e-12);
  EXPECT_NEAR(full.score, 1.0, 1e-12);
}

TEST(ReferenceRecall, RepeatedBlocksCountOnceAndRowSubsets) {
  const Inputs in = make_inputs(2, 13);
  const ProblemShape& s = in.shape;
  const std::vector<int32_t> own_only = [&] {
    std::vector<int32_t> block_idx(s.batch * s.num_proxy_heads * s.seqlen * s.top_k);
    for (size_t e = 0; e < block_idx.size(); ++e) {
      const int64_t i = int64_t(e / s.top_k) % s.seqlen;
      block_idx[e] = int32_t(i / kBlockSize);  // the own block in both slots
    }
    return block_idx;
  }();
  const QueryRows late = {{0, 599}, {1, 450}};
  const Recall recall = reference::recall(in, own_only, late);
  double kept = 0.0;
  for (const QueryRow& r : late) {
    for (int p = 0; p < s.num_proxy_heads; ++p) kept += teacher_masses(in, r.batch, p, r.row)[r.row / kBlockSize];
  }
  EXPECT_NEAR(recall.score, kept / double(late.size() * s.num_proxy_heads), 1e-12);
  EXPECT_LE(recall.block, 0.5);  // one distinct block of the two the teacher keeps

  EXPECT_THROW(reference::recall(in, std::vector<int32_t>(7, 0)), std::invalid_argument);
}

}  // namespace
}  // namespace flashmsa::reference
