// Small device helpers shared by the forward, backward and warmup kernels: 16-bit <-> fp32
// conversions, the reductions over the four threads of an MMA quad (which hold one accumulator
// row between them), and the constants and exponential of the log2-domain softmax.
//
// Layer 1 of the device utilities, next to ptx/ (kernels include both).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flashmsa::kernels {

constexpr float kLn2 = 0.69314718055994530942f;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }

// Max / sum over the 4 lanes of a quad (lanes 4k … 4k+3), returned to all four.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 2^x as one MUFU instruction (flushes denormal results to zero, which a probability of < 2^-126
// relative to the row maximum can afford); exp2f adds range handling around it.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) and 1/x as one MUFU instruction each (≈ 2^-22 relative error), for row statistics whose
// exact-library versions cost ≈ 30 and ≈ 8 instructions with a slow-path branch.
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One step of the online softmax for accumulator row `half` of m16n8 fragments (score[n][2·half +
// e], already in log2 units and masked; step_max their quad-reduced maximum): score becomes
// exp2(score − new max), row_max the new max, row_sum the rescaled running sum plus the step's.
// Returns the factor that rescales the row's output accumulators.
template <int kN>
__device__ __forceinline__ float online_softmax_step(float (&score)[kN][4], int half, float step_max,
                                                     float& row_max, float& row_sum) {
  const float new_max = fmaxf(row_max, step_max);
  const float base = new_max == kNegInf ? 0.f : new_max;
  const float correction = exp2f(row_max - base);
  row_max = new_max;
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float p = exp2f(score[n][half * 2 + e] - base);
      score[n][half * 2 + e] = p;
      sum += p;
    }
  }
  row_sum = row_sum * correction + sum;
  return correction;
}

}  // namespace flashmsa::kernels
