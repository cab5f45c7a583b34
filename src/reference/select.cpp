// SPEC.md §1, the index branch: block scores from the proxy heads and the top-K block selection.
//
// Comes after inputs.cpp (proxy_score); its block_idx feeds attention.cpp (§2-§4).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "reference/reference.h"

namespace flashmsa::reference {

std::vector<double> block_scores(const Inputs& in, int64_t batch, int proxy_head, int64_t row,
                                 Precision precision) {
  const int64_t local_block = row / kBlockSize;  // c(i)
  std::vector<double> m(local_block + 1, -std::numeric_limits<double>::infinity());
  // m_ic = max over the tokens j <= i of block c; only blocks before the local one need scores.
  for (int64_t j = 0; j < local_block * kBlockSize; ++j) {
    const double s = proxy_score(in, batch, proxy_head, row, j, precision);
    double& best = m[j / kBlockSize];
    if (s > best) best = s;
  }
  m[local_block] = std::numeric_limits<double>::infinity();  // the local block is always kept
  return m;
}

std::vector<int32_t> select(const Inputs& in, Precision precision, const QueryRows& rows) {
  validate(in);
  const ProblemShape& s = in.shape;
  const int top_k = s.top_k;
  if (top_k < 1 || top_k > kMaxTopK) {
    throw std::invalid_argument("flashmsa::reference::select: top_k = " + std::to_string(top_k) +
                                " must lie in [1, " + std::to_string(kMaxTopK) + "]");
  }

  std::vector<int32_t> block_idx(s.batch * s.num_proxy_heads * s.seqlen * top_k,
                                 std::numeric_limits<int32_t>::min());
  for (const QueryRow& r : resolve_rows(s, rows)) {
    for (int p = 0; p < s.num_proxy_heads; ++p) {
      std::vector<double> m = block_scores(in, r.batch, p, r.row, precision);
      // NOTES: a NaN block score ranks below every number, so NaN input never displaces a block
      // with a real score (and the ordering stays a strict weak order).
      for (double& score : m) {
        if (std::isnan(score)) score = -std::numeric_limits<double>::infinity();
      }
      std::vector<int32_t> order(m.size());
      std::iota(order.begin(), order.end(), 0);
      const size_t kept = std::min<size_t>(top_k, order.size());
      // Descending score, ties to the smaller block index.
      std::partial_sort(order.begin(), order.begin() + kept, order.end(),
                        [&](int32_t a, int32_t b) { return m[a] != m[b] ? m[a] > m[b] : a < b; });

      int32_t* out = &block_idx[((r.batch * s.num_proxy_heads + p) * s.seqlen + r.row) * top_k];
      for (int slot = 0; slot < top_k; ++slot) {
        out[slot] = slot < static_cast<int>(kept) ? order[slot] : -1;
      }
    }
  }
  return block_idx;
}

}  // namespace flashmsa::reference
