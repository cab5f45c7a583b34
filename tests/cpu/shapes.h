// The ProblemShape of a small reference-test problem (tests/cpu): cases::problem_shape with head
// dims defaulting to 16, which keeps the fp64 reference fast.
#pragma once

#include <cstdint>

#include "common/cases.h"

namespace flashmsa::testing {

inline ProblemShape small_shape(int64_t batch, int64_t seqlen, int heads, int kv_heads,
                                int proxy_heads, int proxy_kv_heads, int top_k, int head_dim = 16,
                                int proxy_head_dim = 0) {
  return cases::problem_shape(batch, seqlen, heads, kv_heads, proxy_heads, proxy_kv_heads, top_k,
                              head_dim, proxy_head_dim);
}

}  // namespace flashmsa::testing
