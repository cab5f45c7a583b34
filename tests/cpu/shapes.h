// The ProblemShape of a small test problem, shared by the reference tests (tests/cpu). Head dims
// default to 16 so the fp64 reference stays fast; proxy_head_dim 0 means "same as head_dim".
#pragma once

#include <cstdint>

#include "flashmsa/params.h"

namespace flashmsa::testing {

inline ProblemShape small_shape(int64_t batch, int64_t seqlen, int heads, int kv_heads,
                                int proxy_heads, int proxy_kv_heads, int top_k, int head_dim = 16,
                                int proxy_head_dim = 0) {
  ProblemShape shape;
  shape.batch = batch;
  shape.seqlen = seqlen;
  shape.num_heads = heads;
  shape.num_kv_heads = kv_heads;
  shape.num_proxy_heads = proxy_heads;
  shape.num_proxy_kv_heads = proxy_kv_heads;
  shape.head_dim = head_dim;
  shape.proxy_head_dim = proxy_head_dim > 0 ? proxy_head_dim : head_dim;
  shape.top_k = top_k;
  return shape;
}

}  // namespace flashmsa::testing
