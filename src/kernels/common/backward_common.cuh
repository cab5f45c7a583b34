// Pieces shared by the sparse backward (backward/) and the warmup backward (warmup/): the Δ
// pre-pass and the factor that turns π − t into the proxy-logit gradient (SPEC.md §3-§4).
//
// Layer 2 of the device utilities: kernels and helpers over the API's BackwardParams.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flashmsa/params.h"
#include "kernels/common/device_math.h"
#include "kernels/common/strided.h"

namespace flashmsa::kernels {

// ḡ σp / (B·Hp·S): the factor between π − t and the proxy-logit gradient, 0 without kl_grad.
__device__ __forceinline__ float kl_gradient_factor(const BackwardParams& params, float proxy_scale) {
  if (params.kl_grad == nullptr) return 0.f;
  const ProblemShape& shape = params.fwd.shape;
  const float rows = float(shape.batch) * float(shape.num_proxy_heads) * float(shape.seqlen);
  return *params.kl_grad * proxy_scale / rows;
}

// The (b, i, head) of linear row r of a [B, S, heads] tensor, stepped on without divisions.
struct TokenHeadCursor {
  int64_t b, token;
  int head;
  __device__ __forceinline__ TokenHeadCursor(int64_t row, int heads, int seqlen) {
    const int64_t token_row = row / heads;  // b · S + i
    head = int(row - token_row * heads);
    b = token_row / seqlen;
    token = token_row - b * seqlen;
  }
  // `step` rows on.
  __device__ __forceinline__ void advance(int step, int heads, int seqlen) {
    head += step;
    while (head >= heads) {
      head -= heads;
      if (++token == seqlen) {
        token = 0;
        ++b;
      }
    }
  }
};

constexpr int kDeltaThreads = 256;   // 8 warps
constexpr int kDeltaRowsPerWarp = 8;  // 4 passes of 2 rows: a half-warp per row, 16 bytes per lane

// Δ_hi = ⟨O_hi, dO_hi⟩ in fp32 into delta[b, h, s]. A warp takes 8 consecutive (b, i, h) rows and
// issues all their 16-byte loads before the first sum.
template <typename T>
__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(const BackwardParams params, float* delta) {
  const ProblemShape& shape = params.fwd.shape;
  const int lane = threadIdx.x & 31;
  constexpr int kPasses = kDeltaRowsPerWarp / 2;
  const int64_t rows = int64_t(shape.batch) * shape.seqlen * shape.num_heads;
  const int64_t first = (int64_t(blockIdx.x) * (kDeltaThreads / 32) + (threadIdx.x >> 5)) * kDeltaRowsPerWarp + lane / 16;
  const int dim = (lane % 16) * 8;
  const Strided<const T> out = strided<const T>(params.fwd.out);
  const Strided<const T> dout = strided<const T>(params.dout);
  TokenHeadCursor at(first, shape.num_heads, shape.seqlen);
  uint4 o[kPasses], d[kPasses];
  int64_t target[kPasses];  // index into delta, −1 past the last row
#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    const bool valid = first + 2 * u < rows;
    target[u] = valid ? (at.b * shape.num_heads + at.head) * shape.seqlen + at.token : -1;
    const T* o_row = valid ? out.row(at.b, at.token, at.head) + dim : out.ptr + dim;
    const T* d_row = valid ? dout.row(at.b, at.token, at.head) + dim : dout.ptr + dim;
    o[u] = *reinterpret_cast<const uint4*>(o_row);
    d[u] = *reinterpret_cast<const uint4*>(d_row);
    at.advance(2, shape.num_heads, shape.seqlen);
  }
#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    const T* o_elements = reinterpret_cast<const T*>(&o[u]);
    const T* d_elements = reinterpret_cast<const T*>(&d[u]);
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) sum = fmaf(to_float(o_elements[e]), to_float(d_elements[e]), sum);
    for (int offset = 8; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane % 16 == 0 && target[u] >= 0) delta[target[u]] = sum;
  }
}

template <typename T>
cudaError_t launch_delta(const BackwardParams& params, float* delta, cudaStream_t stream) {
  const ProblemShape& shape = params.fwd.shape;
  const int64_t rows = shape.batch * shape.seqlen * shape.num_heads;
  const int64_t rows_per_block = (kDeltaThreads / 32) * kDeltaRowsPerWarp;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  delta_kernel<T><<<unsigned(blocks), kDeltaThreads, 0, stream>>>(params, delta);
  return cudaGetLastError();
}

}  // namespace flashmsa::kernels
