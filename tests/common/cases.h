// The named head configurations of SPEC.md, shared by the GPU tests, the benchmarks and the CLI so
// that what is timed is exactly what is tested.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashmsa/params.h"

namespace flashmsa::cases {

struct HeadConfig {
  const char* name;
  int num_heads;           // H
  int num_kv_heads;        // Hkv
  int num_proxy_heads;     // Hp
  int num_proxy_kv_heads;  // Hpk
  int head_dim;            // D (= Di)
  int top_k;               // K, blocks
};

// SPEC.md "Benchmark configurations".
inline const std::vector<HeadConfig>& named_configs() {
  static const std::vector<HeadConfig> configs = {
      {"paper", 64, 4, 4, 1, 128, 16},
      {"specialized", 64, 4, 16, 1, 128, 16},
      {"seed", 16, 2, 4, 1, 128, 16},
  };
  return configs;
}

// Returns nullptr for an unknown name.
inline const HeadConfig* find_config(const std::string& name) {
  for (const HeadConfig& config : named_configs()) {
    if (name == config.name) return &config;
  }
  return nullptr;
}

// A ProblemShape from its sizes; proxy_head_dim 0 means "same as head_dim". Every test, benchmark
// and the CLI build shapes through this one function.
inline ProblemShape problem_shape(int64_t batch, int64_t seqlen, int heads, int kv_heads,
                                  int proxy_heads, int proxy_kv_heads, int top_k,
                                  int head_dim = 128, int proxy_head_dim = 0) {
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

inline ProblemShape make_shape(const HeadConfig& config, int64_t batch, int64_t seqlen) {
  return problem_shape(batch, seqlen, config.num_heads, config.num_kv_heads,
                       config.num_proxy_heads, config.num_proxy_kv_heads, config.top_k,
                       config.head_dim);
}

// Contiguous [b, s, heads, dim] strides (the FlashAttention layout).
inline TensorRef bshd(void* ptr, const ProblemShape& shape, int heads, int dim) {
  TensorRef ref;
  ref.ptr = ptr;
  ref.head_stride = dim;
  ref.seq_stride = int64_t(heads) * dim;
  ref.batch_stride = shape.seqlen * ref.seq_stride;
  return ref;
}

// Contiguous [b, heads, s, dim] storage viewed as [b, s, heads, dim] (the seed layout).
inline TensorRef bhsd(void* ptr, const ProblemShape& shape, int heads, int dim) {
  TensorRef ref;
  ref.ptr = ptr;
  ref.seq_stride = dim;
  ref.head_stride = shape.seqlen * dim;
  ref.batch_stride = int64_t(heads) * ref.head_stride;
  return ref;
}

}  // namespace flashmsa::cases
