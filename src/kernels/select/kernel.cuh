// Select kernel (SPEC.md §1): block scores of q_proxy·k_proxyᵀ, forced local block, top-K.
//
// Straightforward version: one CTA per (batch, proxy head, query block), one thread per query row.
// The CTA streams the visible key blocks c < c(i) through shared memory; each thread reduces the
// block maximum of its row and keeps its K-1 best (score, block) in shared memory, ordered by
// descending score with ties to the smaller block (blocks arrive in ascending order, so an equal
// score never displaces an earlier block). The local block c(i) is written first (score +inf).
// config.h holds the constants; launch.cu dispatches to the instantiations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "flashmsa/api.h"
#include "kernels/select/config.h"

namespace flashmsa::kernels::select {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__global__ void __launch_bounds__(kThreads) select_kernel(SelectParams params, float scale) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* key_tile = reinterpret_cast<T*>(smem);                                      // [128, Di]
  float* list_score = reinterpret_cast<float*>(smem + kKeyTileBytes);           // [keep, 128]
  int* list_block = reinterpret_cast<int*>(smem + kKeyTileBytes + kListBytes / 2);  // [keep, 128]

  const ProblemShape& shape = params.shape;
  const int query_block = blockIdx.x;
  const int proxy_head = blockIdx.y;
  const int64_t batch = blockIdx.z;
  const int key_head = proxy_head / (shape.num_proxy_heads / shape.num_proxy_kv_heads);
  const int64_t row = int64_t(query_block) * kBlockSize + threadIdx.x;
  const bool row_valid = row < shape.seqlen;
  const int keep = shape.top_k - 1;

  const T* q = static_cast<const T*>(params.q_proxy.ptr) + batch * params.q_proxy.batch_stride +
               proxy_head * params.q_proxy.head_stride;
  const T* k = static_cast<const T*>(params.k_proxy.ptr) + batch * params.k_proxy.batch_stride +
               key_head * params.k_proxy.head_stride;

  float query[kHeadDim];
  for (int d = 0; d < kHeadDim; ++d) {
    query[d] = row_valid ? to_float(q[row * params.q_proxy.seq_stride + d]) : 0.f;
  }

  int count = 0;
  float threshold = -INFINITY;
  for (int block = 0; block < query_block; ++block) {
    __syncthreads();
    for (int e = threadIdx.x; e < kBlockSize * kHeadDim; e += kThreads) {
      const int key = e / kHeadDim;
      const int d = e % kHeadDim;
      key_tile[e] = k[(int64_t(block) * kBlockSize + key) * params.k_proxy.seq_stride + d];
    }
    __syncthreads();
    float best = -INFINITY;
    for (int key = 0; key < kBlockSize; ++key) {
      float dot = 0.f;
      for (int d = 0; d < kHeadDim; ++d) dot = fmaf(query[d], to_float(key_tile[key * kHeadDim + d]), dot);
      best = fmaxf(best, dot * scale);
    }
    if (keep > 0 && (count < keep || best > threshold)) {
      int pos = count < keep ? count : keep - 1;
      while (pos > 0 && list_score[(pos - 1) * kThreads + threadIdx.x] < best) {
        list_score[pos * kThreads + threadIdx.x] = list_score[(pos - 1) * kThreads + threadIdx.x];
        list_block[pos * kThreads + threadIdx.x] = list_block[(pos - 1) * kThreads + threadIdx.x];
        --pos;
      }
      list_score[pos * kThreads + threadIdx.x] = best;
      list_block[pos * kThreads + threadIdx.x] = block;
      if (count < keep) ++count;
      if (count == keep) threshold = list_score[(keep - 1) * kThreads + threadIdx.x];
    }
  }

  if (!row_valid) return;
  int32_t* out = params.block_idx + ((batch * shape.num_proxy_heads + proxy_head) * shape.seqlen + row) *
                                        shape.top_k;
  out[0] = query_block;
  for (int slot = 1; slot < shape.top_k; ++slot) {
    out[slot] = slot - 1 < count ? list_block[(slot - 1) * kThreads + threadIdx.x] : -1;
  }
}

// Launcher: grid (query blocks, proxy heads, batch).
template <typename T>
Status run_select(const SelectParams& params, cudaStream_t stream) {
  const float scale = params.proxy_scale != 0.f ? params.proxy_scale
                                                : 1.f / std::sqrt(float(params.shape.proxy_head_dim));
  cudaError_t error = cudaFuncSetAttribute(select_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kSmemBytes);
  if (error != cudaSuccess) return {StatusCode::kCudaError, cudaGetErrorString(error)};
  const dim3 grid(unsigned(params.shape.num_blocks()), unsigned(params.shape.num_proxy_heads),
                  unsigned(params.shape.batch));
  select_kernel<T><<<grid, kThreads, kSmemBytes, stream>>>(params, scale);
  error = cudaGetLastError();
  if (error != cudaSuccess) return {StatusCode::kCudaError, cudaGetErrorString(error)};
  return Status::Ok();
}

}  // namespace flashmsa::kernels::select
