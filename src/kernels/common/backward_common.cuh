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

constexpr int kDeltaThreads = 256;  // 8 warps, one (b, i, h) row each

// Δ_hi = ⟨O_hi, dO_hi⟩ in fp32 into delta[b, h, s]: one warp per (b, i, h), 4 elements per lane.
template <typename T>
__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(const BackwardParams params, float* delta) {
  const ProblemShape& shape = params.fwd.shape;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * (kDeltaThreads / 32) + (threadIdx.x >> 5);  // (b, i, h)
  if (row >= shape.batch * shape.seqlen * shape.num_heads) return;
  const int head = int(row % shape.num_heads);
  const int64_t token = (row / shape.num_heads) % shape.seqlen;
  const int64_t b = row / (shape.num_heads * shape.seqlen);
  const T* out = strided<const T>(params.fwd.out).row(b, token, head) + lane * 4;
  const T* dout = strided<const T>(params.dout).row(b, token, head) + lane * 4;
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) sum = fmaf(to_float(out[e]), to_float(dout[e]), sum);
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta[(b * shape.num_heads + head) * shape.seqlen + token] = sum;
}

template <typename T>
cudaError_t launch_delta(const BackwardParams& params, float* delta, cudaStream_t stream) {
  const ProblemShape& shape = params.fwd.shape;
  const int64_t rows = shape.batch * shape.seqlen * shape.num_heads;
  const int64_t blocks = (rows + kDeltaThreads / 32 - 1) / (kDeltaThreads / 32);
  delta_kernel<T><<<unsigned(blocks), kDeltaThreads, 0, stream>>>(params, delta);
  return cudaGetLastError();
}

}  // namespace flashmsa::kernels
