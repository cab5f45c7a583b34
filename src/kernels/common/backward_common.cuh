// Pieces shared by the sparse backward (backward/) and the warmup backward (warmup/): the Δ
// pre-pass (with the sparse backward's scaled fp16 dQ row scales and the K, V bound pass they
// need) and the factor that turns π − t into the proxy-logit gradient (SPEC.md §3-§4).
//
// Layer 2 of the device utilities: kernels and helpers over the API's BackwardParams.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
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

// The row scales of the sparse backward's scaled fp16 dQ sums (backward/config.h, kDqScaleTarget):
// where `scale` is non-null, the Δ kernel also writes scale[b, h, i] = 2^(target − ⌈log2 B⌉) with
// B = factor·‖dO_i‖₂·kv_bound[0]·kv_bound[1] (1 where B is 0 or not finite).
struct DqScaleArgs {
  float* scale = nullptr;
  float* kv_bound = nullptr;        // max_j ‖V_j‖₂, max |K| (kv_bound_kernel)
  float factor = 0.f;               // 2σ
  int target = 0;
  int exponent_limit = 0;
};

__device__ __forceinline__ float dq_row_scale(const DqScaleArgs& args, float dout_norm) {
  const float bound = args.factor * dout_norm * args.kv_bound[0] * args.kv_bound[1];
  if (!(bound > 0.f) || !isfinite(bound)) return 1.f;
  const float exponent = fminf(fmaxf(ceilf(log2f(bound)), -float(args.exponent_limit)), float(args.exponent_limit));
  return exp2f(float(args.target) - exponent);
}

// Δ_hi = ⟨O_hi, dO_hi⟩ in fp32 into delta[b, h, s]. A warp takes 8 consecutive (b, i, h) rows and
// issues all their 16-byte loads before the first sum; with scale_args.scale, also the row scales.
template <typename T>
__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(const BackwardParams params, float* delta,
                                                              const DqScaleArgs scale_args) {
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
    if (scale_args.scale != nullptr) {
      float squares = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) squares = fmaf(to_float(d_elements[e]), to_float(d_elements[e]), squares);
      for (int offset = 8; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
      if (lane % 16 == 0 && target[u] >= 0) scale_args.scale[target[u]] = dq_row_scale(scale_args, sqrtf(squares));
    }
  }
}

// bound[0] = max ‖V_j‖₂ and bound[1] = max |K| over all (b, j, KV head), as the bit patterns of
// non-negative floats (atomicMax on int orders them as floats); bound must be zeroed first. A
// half-warp per row, 16 bytes per lane, a grid-stride loop.
template <typename T>
__global__ void __launch_bounds__(kDeltaThreads) kv_bound_kernel(const BackwardParams params, float* bound) {
  const ProblemShape& shape = params.fwd.shape;
  const int lane = threadIdx.x & 31;
  const int64_t rows = int64_t(shape.batch) * shape.seqlen * shape.num_kv_heads;
  const Strided<const T> k = strided<const T>(params.fwd.k);
  const Strided<const T> v = strided<const T>(params.fwd.v);
  const int dim = (lane % 16) * 8;
  float v_squares_max = 0.f;
  float k_abs_max = 0.f;
  const int64_t warps = int64_t(gridDim.x) * (kDeltaThreads / 32);
  // The loop runs per warp (two rows a pass), so the shuffles see all 32 lanes.
  for (int64_t pair = (int64_t(blockIdx.x) * kDeltaThreads + threadIdx.x) / 32; 2 * pair < rows; pair += warps) {
    const int64_t row = 2 * pair + lane / 16;
    uint4 k_bits = make_uint4(0u, 0u, 0u, 0u);
    uint4 v_bits = make_uint4(0u, 0u, 0u, 0u);
    if (row < rows) {
      const int64_t token_row = row / shape.num_kv_heads;
      const int head = int(row - token_row * shape.num_kv_heads);
      const int64_t b = token_row / shape.seqlen;
      const int64_t token = token_row - b * shape.seqlen;
      k_bits = *reinterpret_cast<const uint4*>(k.row(b, token, head) + dim);
      v_bits = *reinterpret_cast<const uint4*>(v.row(b, token, head) + dim);
    }
    const T* k_elements = reinterpret_cast<const T*>(&k_bits);
    const T* v_elements = reinterpret_cast<const T*>(&v_bits);
    float squares = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      squares = fmaf(to_float(v_elements[e]), to_float(v_elements[e]), squares);
      k_abs_max = fmaxf(k_abs_max, fabsf(to_float(k_elements[e])));
    }
    for (int offset = 8; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    v_squares_max = fmaxf(v_squares_max, squares);
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    v_squares_max = fmaxf(v_squares_max, __shfl_xor_sync(0xffffffffu, v_squares_max, offset));
    k_abs_max = fmaxf(k_abs_max, __shfl_xor_sync(0xffffffffu, k_abs_max, offset));
  }
  if (lane == 0) {
    atomicMax(reinterpret_cast<int*>(bound), __float_as_int(sqrtf(v_squares_max)));
    atomicMax(reinterpret_cast<int*>(bound + 1), __float_as_int(k_abs_max));
  }
}

// With scale_args.scale, kv_bound_kernel runs first (scale_args.kv_bound zeroed by the caller).
template <typename T>
cudaError_t launch_delta(const BackwardParams& params, float* delta, cudaStream_t stream,
                         const DqScaleArgs& scale_args = DqScaleArgs{}) {
  const ProblemShape& shape = params.fwd.shape;
  if (scale_args.scale != nullptr) {
    const int64_t kv_rows = shape.batch * shape.seqlen * shape.num_kv_heads;
    const int64_t kv_blocks = std::min<int64_t>((kv_rows * 16 + kDeltaThreads - 1) / kDeltaThreads, 1024);
    kv_bound_kernel<T><<<unsigned(kv_blocks), kDeltaThreads, 0, stream>>>(params, scale_args.kv_bound);
  }
  const int64_t rows = shape.batch * shape.seqlen * shape.num_heads;
  const int64_t rows_per_block = (kDeltaThreads / 32) * kDeltaRowsPerWarp;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  delta_kernel<T><<<unsigned(blocks), kDeltaThreads, 0, stream>>>(params, delta, scale_args);
  return cudaGetLastError();
}

}  // namespace flashmsa::kernels
