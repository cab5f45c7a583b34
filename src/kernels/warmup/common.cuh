// Device helpers shared by the warmup kernels (forward_kernel.cuh, backward_kernel.cuh): typed
// strided views, the swizzled tile offset, 16-bit conversions and the host-side error check. The
// tensor-core wrappers themselves are common/ptx/warp_mma.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "flashmsa/api.h"
#include "kernels/common/device_cache.h"
#include "kernels/common/device_math.h"
#include "kernels/common/strided.h"
#include "kernels/common/ptx/warp_mma.h"
#include "kernels/warmup/config.h"

namespace flashmsa::kernels::warmup {

// Element offset of (row, col) in a [rows][kCols] 16-bit tile (col a multiple of 8 for 16-byte
// accesses): the 16-byte chunk index is XOR-ed with row % 8, so the 8 row addresses of one
// ldmatrix fall in 8 different bank groups.
template <int kCols>
__device__ __forceinline__ int swizzle(int row, int col) {
  return row * kCols + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}


// Issues the cp.async copies of `rows` rows of a [b, s, heads, 128] tensor, tokens first_token …,
// into a swizzled [rows][128] tile; tokens ≥ seqlen become zeros (0 · garbage never makes NaN).
template <typename T>
__device__ __forceinline__ void load_token_rows(uint16_t* tile, const Strided<const T>& source, int64_t b,
                                                int64_t first_token, int head, int64_t seqlen, int rows,
                                                int threads) {
  for (int index = threadIdx.x; index < rows * 16; index += threads) {
    const int row = index >> 4;
    const int col = (index & 15) * 8;
    const int64_t token = first_token + row;
    const bool valid = token < seqlen;
    const T* src = valid ? source.row(b, token, head) + col : source.ptr;
    ptx::cp_async_16(tile + swizzle<kHeadDim>(row, col), src, valid);
  }
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::Ok();
  return {StatusCode::kCudaError, std::string("warmup: ") + what + ": " + cudaGetErrorString(error)};
}

#define FLASHMSA_WARMUP_CHECK(expr, what)                                                    \
  do {                                                                                       \
    if (::flashmsa::Status status_ = ::flashmsa::kernels::warmup::cuda_status((expr), (what)); \
        !status_.ok())                                                                       \
      return status_;                                                                        \
  } while (0)

}  // namespace flashmsa::kernels::warmup
