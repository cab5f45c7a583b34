// The dtype-free part of the warmup backward (backward_kernel.cuh declares it): the ordered KL sum.
// Comes after dq_kernel, which writes one KL term per group row (b, p, i).
#include "kernels/warmup/backward_kernel.cuh"

namespace flashmsa::kernels::warmup {

// ---------------------------------------------------------------------------------------------
// KL value: ordered two-pass sum of the per-row terms, / (B·Hp·S) → fwd.kl (written, not added).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = value;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kBackwardWarps; ++w) total += scratch[w];
  return total;
}

__global__ void __launch_bounds__(kBackwardThreads) reduce_kl_rows_kernel(const BackwardArgs args) {
  __shared__ float scratch[kBackwardWarps];
  const ProblemShape& shape = args.params.fwd.shape;
  const int64_t count = shape.batch * shape.num_proxy_heads * shape.seqlen;
  const int64_t per_block = (count + gridDim.x - 1) / gridDim.x;
  const int64_t first = blockIdx.x * per_block;
  const int64_t end = first + per_block < count ? first + per_block : count;
  float sum = 0.f;
  for (int64_t e = first + threadIdx.x; e < end; e += blockDim.x) sum += args.kl_rows[e];
  const float total = block_sum(sum, scratch);
  if (threadIdx.x == 0) args.kl_sums[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kBackwardThreads) reduce_kl_final_kernel(const BackwardArgs args) {
  __shared__ float scratch[kBackwardWarps];
  const ProblemShape& shape = args.params.fwd.shape;
  float sum = 0.f;
  for (int e = threadIdx.x; e < kKlSumBlocks; e += blockDim.x) sum += args.kl_sums[e];
  const float total = block_sum(sum, scratch);
  if (threadIdx.x == 0) {
    *args.params.fwd.kl = total / (float(shape.batch) * float(shape.num_proxy_heads) * float(shape.seqlen));
  }
}

Status reduce_kl(const BackwardArgs& args, cudaStream_t stream) {
  reduce_kl_rows_kernel<<<kKlSumBlocks, kBackwardThreads, 0, stream>>>(args);
  FLASHMSA_WARMUP_CHECK(cudaGetLastError(), "reduce_kl_rows_kernel");
  reduce_kl_final_kernel<<<1, kBackwardThreads, 0, stream>>>(args);
  FLASHMSA_WARMUP_CHECK(cudaGetLastError(), "reduce_kl_final_kernel");
  return Status::Ok();
}

}  // namespace flashmsa::kernels::warmup
