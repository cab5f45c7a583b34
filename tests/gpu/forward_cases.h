// Helpers shared by the schedule and forward GPU tests: host-made selections, layout-aware uploads
// and the per-case device buffers of the sparse forward.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "gpu/gpu_test.h"

namespace flashmsa::forward_testing {

// A per-query selection like select's output: slot 0 is the local block, then K−1 distinct random
// earlier blocks (all of them when fewer are visible), −1 in the trailing empty slots. With
// `dense`, every visible block is kept (the caller makes K ≥ NB).
inline std::vector<int32_t> random_selection(const ProblemShape& shape, uint64_t seed) {
  const int K = shape.top_k;
  std::vector<int32_t> block_idx(shape.batch * shape.num_proxy_heads * shape.seqlen * K, -1);
  std::mt19937_64 rng(seed);
  std::vector<int32_t> pool;
  for (int64_t row = 0; row < shape.batch * shape.num_proxy_heads * shape.seqlen; ++row) {
    const int64_t i = row % shape.seqlen;
    const int32_t local = int32_t(i / kBlockSize);
    int32_t* slots = block_idx.data() + row * K;
    slots[0] = local;
    pool.clear();
    for (int32_t c = 0; c < local; ++c) pool.push_back(c);
    const int picks = std::min<int>(K - 1, local);
    for (int s = 0; s < picks; ++s) {
      const size_t pick = s + rng() % (pool.size() - s);
      std::swap(pool[s], pool[pick]);
      slots[1 + s] = pool[s];
    }
  }
  return block_idx;
}

// Uploads a contiguous [b, s, heads, dim] host tensor in the kernel dtype, stored [b, s, h, d]
// (bshd) or [b, h, s, d] (bhsd), and returns the buffer with its TensorRef.
struct DeviceTensor {
  testing::DeviceBuffer<uint16_t> buffer;
  TensorRef ref;
};

inline DeviceTensor upload_tensor(const std::vector<double>& host, const ProblemShape& shape, int heads,
                                  int dim, DType dtype, bool bhsd) {
  std::vector<uint16_t> bits(host.size());
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < shape.seqlen; ++s) {
      for (int h = 0; h < heads; ++h) {
        const int64_t src = ((b * shape.seqlen + s) * heads + h) * dim;
        const int64_t dst = bhsd ? ((b * heads + h) * shape.seqlen + s) * dim : src;
        for (int d = 0; d < dim; ++d) bits[dst + d] = testing::to_half_bits(host[src + d], dtype);
      }
    }
  }
  DeviceTensor tensor{testing::DeviceBuffer<uint16_t>(bits.size()), {}};
  tensor.buffer.upload(bits);
  tensor.ref = bhsd ? cases::bhsd(tensor.buffer.get(), shape, heads, dim)
                    : cases::bshd(tensor.buffer.get(), shape, heads, dim);
  return tensor;
}

// Downloads a tensor written through `tensor.ref` back to contiguous [b, s, heads, dim] doubles.
inline std::vector<double> download_tensor(const DeviceTensor& tensor, const ProblemShape& shape, int heads,
                                           int dim, DType dtype, bool bhsd) {
  const std::vector<uint16_t> bits = tensor.buffer.download();
  std::vector<double> host(bits.size());
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < shape.seqlen; ++s) {
      for (int h = 0; h < heads; ++h) {
        const int64_t dst = ((b * shape.seqlen + s) * heads + h) * dim;
        const int64_t src = bhsd ? ((b * heads + h) * shape.seqlen + s) * dim : dst;
        for (int d = 0; d < dim; ++d) host[dst + d] = testing::from_half_bits(bits[src + d], dtype);
      }
    }
  }
  return host;
}

}  // namespace flashmsa::forward_testing
