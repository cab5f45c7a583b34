// Device-made benchmark inputs shared by the stage benchmarks: N(0, 1) tensors in the kernel dtype
// (never zeros: they would hide work and time differently), constant fp32 tensors, and the counted
// FLOPs of the main branch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "common/device_buffers.h"
#include "flashmsa/params.h"

namespace flashmsa::bench {
namespace {  // kernels have internal linkage: each benchmark file gets its own copy

__device__ __forceinline__ uint64_t mix_bits(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// Box-Muller on a counter-based hash: element n depends on (seed, n) only.
__global__ void fill_gaussian_kernel(uint16_t* data, int64_t count, uint64_t seed, bool bf16) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < count;
       n += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t bits = mix_bits(seed * 0x9e3779b97f4a7c15ull + n);
    const float u1 = (float((bits >> 40) & 0xffffff) + 0.5f) / 16777216.f;
    const float u2 = float(bits & 0xffffff) / 16777216.f;
    const float value = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    data[n] = bf16 ? __nv_bfloat16_raw(__float2bfloat16_rn(value)).x
                   : __half_raw(__float2half_rn(value)).x;
  }
}

__global__ void fill_constant_kernel(float* data, int64_t count, float value) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < count;
       n += int64_t(gridDim.x) * blockDim.x) {
    data[n] = value;
  }
}

}  // namespace

inline testing::DeviceBuffer<uint16_t> gaussian_tensor(int64_t count, uint64_t seed, DType dtype) {
  testing::DeviceBuffer<uint16_t> buffer{size_t(count)};
  fill_gaussian_kernel<<<1024, 256>>>(buffer.get(), count, seed, dtype == DType::kBF16);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
  return buffer;
}

inline testing::DeviceBuffer<float> constant_tensor(int64_t count, float value) {
  testing::DeviceBuffer<float> buffer{size_t(count)};
  fill_constant_kernel<<<1024, 256>>>(buffer.get(), count, value);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
  return buffer;
}

// Forward FLOPs of the main branch, 4·D·H·Σ_i |T_i| with |T_i| = (min(K, c(i)+1) − 1)·128 +
// (i mod 128) + 1: exact for every selection that keeps min(K, c(i)+1) distinct visible blocks
// (select's output and all three benchmark patterns). The backward counts 2.5 times this.
inline double main_forward_flops(const ProblemShape& shape) {
  double tokens = 0;
  for (int64_t i = 0; i < shape.seqlen; ++i) {
    const int64_t visible = std::min<int64_t>(shape.top_k, i / kBlockSize + 1);
    tokens += double((visible - 1) * kBlockSize + i % kBlockSize + 1);
  }
  return 4.0 * shape.head_dim * shape.num_heads * shape.batch * tokens;
}

}  // namespace flashmsa::bench
