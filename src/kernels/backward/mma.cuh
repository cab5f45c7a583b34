// The device helpers the backward's kernel.cuh calls: the swizzled tile offset, the warp-level
// PTX wrappers of common/ptx/warp_mma.h (cp.async gathers, ldmatrix, m16n8k16 mma, 16-bit packing),
// the conversions of common/device_math.h and the fp32 reduce-add of dQ.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/device_math.h"
#include "kernels/common/ptx/warp_mma.h"

namespace flashmsa::kernels::backward {

// Element offset of (row, col) in a [rows][128] 16-bit tile whose 16-byte chunks are XOR-swizzled
// by row: the 8 row addresses of one ldmatrix then fall in 8 different bank groups.
__device__ __forceinline__ int swizzle(int row, int col) {
  return row * 128 + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// The warp-level wrappers shared with the forward (common/ptx/warp_mma.h).
using ptx::cp_async_16;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_16816;
using ptx::pack2;

__device__ __forceinline__ void cp_async_wait_all() {
  ptx::cp_async_commit();
  ptx::cp_async_wait<0>();
}

// fp32 reduce-add of a pair (red.global.add.v2.f32 on sm_90).
__device__ __forceinline__ void reduce_add2(float* address, float x, float y) {
  atomicAdd(reinterpret_cast<float2*>(address), make_float2(x, y));
}

}  // namespace flashmsa::kernels::backward
