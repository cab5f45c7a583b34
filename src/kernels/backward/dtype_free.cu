// The dtype-free kernels of the backward (declared in schedule.cuh): the reverse index and the
// ordered KL sum. Compiled once; the dtype instantiations of kernel.cuh call them.
#include "kernels/backward/schedule.cuh"
#include "kernels/common/device_cache.h"

namespace flashmsa::kernels::backward {

// Exclusive scan of one int per thread over a CTA of 1024 threads; *total gets the sum.
__device__ __forceinline__ int block_exclusive_scan(int value, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int sum = warp_sums[lane];
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, sum, offset);
      if (lane >= offset) sum += other;
    }
    warp_sums[lane] = sum;  // inclusive over warps
  }
  __syncthreads();
  const int result = inclusive - value + (warp > 0 ? warp_sums[warp - 1] : 0);
  *total = warp_sums[31];
  __syncthreads();  // warp_sums may be reused right after
  return result;
}

// Grid (chunks, Hp, B), kThreads threads, dynamic smem (last block + 1) ints.
__global__ void __launch_bounds__(kThreads) count_selections_kernel(const Problem pb) {
  extern __shared__ int histogram[];
  const ProblemShape& shape = pb.params.fwd.shape;
  const int64_t chunk = blockIdx.x;
  const int proxy_head = blockIdx.y;
  const int64_t batch = blockIdx.z;
  const int64_t last_block = chunk_last_block(pb, chunk);
  for (int64_t c = threadIdx.x; c <= last_block; c += blockDim.x) histogram[c] = 0;
  __syncthreads();
  for (int r = threadIdx.x; r < kRowsPerChunk; r += blockDim.x) {
    const int64_t token = chunk * kRowsPerChunk + r;
    if (token >= shape.seqlen) break;
    const int32_t* slots = block_idx_row(pb, batch, proxy_head, token);
    for (int slot = 0; slot < shape.top_k; ++slot) {
      if (slot_valid(slots, slot, token, pb.num_blocks)) atomicAdd(&histogram[slots[slot]], 1);
    }
  }
  __syncthreads();
  int32_t* counts = pb.ws.chunk_counts +
                    ((batch * shape.num_proxy_heads + proxy_head) * pb.num_chunks + chunk) * pb.num_blocks;
  for (int64_t c = threadIdx.x; c <= last_block; c += blockDim.x) counts[c] = histogram[c];
}

// Grid (B·Hp), 1024 threads, dynamic smem NB ints.
__global__ void __launch_bounds__(1024) scan_lists_kernel(const Problem pb) {
  extern __shared__ int totals[];
  __shared__ int warp_sums[32];
  const ProblemShape& shape = pb.params.fwd.shape;
  const int64_t list_row = blockIdx.x;  // b·Hp + p
  int32_t* counts = pb.ws.chunk_counts + list_row * pb.num_chunks * pb.num_blocks;
  for (int64_t c = threadIdx.x; c < pb.num_blocks; c += blockDim.x) {
    int running = 0;
    for (int64_t chunk = c * kBlockSize / kRowsPerChunk; chunk < pb.num_chunks; ++chunk) {
      const int count = counts[chunk * pb.num_blocks + c];
      counts[chunk * pb.num_blocks + c] = running;
      running += count;
    }
    totals[c] = running;
    pb.ws.list_count[list_row * pb.num_blocks + c] = running;
  }
  __syncthreads();
  // Lists of one (b, p) follow each other inside its region of S·K entries.
  const int64_t region = list_row * shape.seqlen * shape.top_k;
  const int64_t per_thread = (pb.num_blocks + blockDim.x - 1) / blockDim.x;
  const int64_t first = threadIdx.x * per_thread;
  int local = 0;
  for (int64_t c = first; c < first + per_thread && c < pb.num_blocks; ++c) local += totals[c];
  int total = 0;
  int prefix = block_exclusive_scan(local, warp_sums, &total);
  for (int64_t c = first; c < first + per_thread && c < pb.num_blocks; ++c) {
    pb.ws.list_offset[list_row * pb.num_blocks + c] = region + prefix;
    prefix += totals[c];
  }
}

// One CTA of 1024 threads: item_start[u] for every unit u = (b·Hkv + g)·NB + c, and the total.
__global__ void __launch_bounds__(1024) plan_items_kernel(const Problem pb) {
  __shared__ int warp_sums[32];
  const ProblemShape& shape = pb.params.fwd.shape;
  const int64_t units = shape.batch * shape.num_kv_heads * pb.num_blocks;
  int carry = 0;
  for (int64_t base = 0; base < units; base += blockDim.x) {
    const int64_t unit = base + threadIdx.x;
    int items = 0;
    if (unit < units) {
      const int64_t block = unit % pb.num_blocks;
      const int kv_head = int((unit / pb.num_blocks) % shape.num_kv_heads);
      const int64_t batch = unit / (pb.num_blocks * shape.num_kv_heads);
      const int tiles = unit_tiles(pb, batch, kv_head, block);
      items = (tiles + pb.tiles_per_item - 1) / pb.tiles_per_item;
    }
    int total = 0;
    const int prefix = block_exclusive_scan(items, warp_sums, &total);
    if (unit < units) pb.ws.item_start[unit] = carry + prefix;
    carry += total;
  }
  if (threadIdx.x == 0) pb.ws.item_start[units] = carry;
}

// Grid (chunks, Hp, B), kThreads threads, dynamic smem: cursors (last block + 1 ints), then the
// chunk's block_idx rows (kRowsPerChunk · K ints).
__global__ void __launch_bounds__(kThreads) fill_lists_kernel(const Problem pb) {
  extern __shared__ int fill_smem[];
  const ProblemShape& shape = pb.params.fwd.shape;
  const int64_t chunk = blockIdx.x;
  const int proxy_head = blockIdx.y;
  const int64_t batch = blockIdx.z;
  const int64_t list_row = batch * shape.num_proxy_heads + proxy_head;
  const int64_t last_block = chunk_last_block(pb, chunk);
  int* cursor = fill_smem;
  int* slots = fill_smem + ((last_block + 1 + 3) & ~int64_t(3));
  const int32_t* counts = pb.ws.chunk_counts + (list_row * pb.num_chunks + chunk) * pb.num_blocks;
  for (int64_t c = threadIdx.x; c <= last_block; c += blockDim.x) cursor[c] = counts[c];
  const int64_t first_token = chunk * kRowsPerChunk;
  const int64_t rows = shape.seqlen - first_token < kRowsPerChunk ? shape.seqlen - first_token
                                                                  : kRowsPerChunk;
  const int32_t* source = block_idx_row(pb, batch, proxy_head, first_token);
  for (int64_t e = threadIdx.x; e < rows * shape.top_k; e += blockDim.x) slots[e] = source[e];
  __syncthreads();
  if (threadIdx.x >= 32) return;
  // One warp walks the rows in order, a lane per slot: a row's valid slots name distinct blocks.
  const int lane = threadIdx.x;
  const int64_t* list_offset = pb.ws.list_offset + list_row * pb.num_blocks;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = first_token + r;
    const int32_t* row_slots = slots + r * shape.top_k;
    for (int slot = lane; slot < shape.top_k; slot += 32) {
      if (!slot_valid(row_slots, slot, token, pb.num_blocks)) continue;
      const int block = row_slots[slot];
      const int position = cursor[block]++;
      pb.ws.entries[list_offset[block] + position] = int32_t(token << kSlotBits) | slot;
    }
    __syncwarp();
  }
}


Status build_schedule(const Problem& pb, cudaStream_t stream) {
  const ProblemShape& shape = pb.params.fwd.shape;
  const dim3 chunk_grid(unsigned(pb.num_chunks), unsigned(shape.num_proxy_heads), unsigned(shape.batch));
  const size_t count_smem = size_t(pb.num_blocks) * 4;
  // Each limit is raised only when this shape needs more than any earlier call (device_cache.h).
  int device = 0;
  FLASHMSA_BACKWARD_CHECK(cudaGetDevice(&device), "cudaGetDevice");
  FLASHMSA_BACKWARD_CHECK(set_max_dynamic_smem(reinterpret_cast<const void*>(count_selections_kernel), device,
                                               int(count_smem)),
                          "count_selections smem");
  count_selections_kernel<<<chunk_grid, kThreads, count_smem, stream>>>(pb);
  FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "count_selections");

  FLASHMSA_BACKWARD_CHECK(set_max_dynamic_smem(reinterpret_cast<const void*>(scan_lists_kernel), device,
                                               int(count_smem)),
                          "scan_lists smem");
  scan_lists_kernel<<<unsigned(shape.batch * shape.num_proxy_heads), 1024, count_smem, stream>>>(pb);
  FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "scan_lists");

  plan_items_kernel<<<1, 1024, 0, stream>>>(pb);
  FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "plan_items");

  const size_t fill_smem = (size_t(pb.num_blocks) + 4) * 4 + size_t(kRowsPerChunk) * shape.top_k * 4;
  FLASHMSA_BACKWARD_CHECK(set_max_dynamic_smem(reinterpret_cast<const void*>(fill_lists_kernel), device,
                                               int(fill_smem)),
                          "fill_lists smem");
  fill_lists_kernel<<<chunk_grid, kThreads, fill_smem, stream>>>(pb);
  FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "fill_lists");
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// KL value: ordered two-pass sum of the per-slot terms, / (B·Hp·S) -> fwd.kl.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = value;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

__global__ void __launch_bounds__(kThreads) reduce_kl_partial_kernel(const Problem pb) {
  __shared__ float scratch[kWarps];
  const ProblemShape& shape = pb.params.fwd.shape;
  const int64_t count = shape.batch * shape.num_proxy_heads * shape.seqlen * shape.top_k;
  const int64_t per_block = (count + gridDim.x - 1) / gridDim.x;
  const int64_t first = blockIdx.x * per_block;
  const int64_t end = first + per_block < count ? first + per_block : count;
  float sum = 0.f;
  for (int64_t e = first + threadIdx.x; e < end; e += blockDim.x) sum += pb.ws.kl_partial[e];
  const float total = block_sum(sum, scratch);
  if (threadIdx.x == 0) pb.ws.kl_sums[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kThreads) reduce_kl_final_kernel(const Problem pb) {
  __shared__ float scratch[kWarps];
  const ProblemShape& shape = pb.params.fwd.shape;
  float sum = 0.f;
  for (int e = threadIdx.x; e < kKlSumBlocks; e += blockDim.x) sum += pb.ws.kl_sums[e];
  const float total = block_sum(sum, scratch);
  if (threadIdx.x == 0) {
    *pb.params.fwd.kl = total / (float(shape.batch) * float(shape.num_proxy_heads) * float(shape.seqlen));
  }
}


Status reduce_kl(const Problem& pb, cudaStream_t stream) {
  reduce_kl_partial_kernel<<<kKlSumBlocks, kThreads, 0, stream>>>(pb);
  FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "reduce_kl_partial");
  reduce_kl_final_kernel<<<1, kThreads, 0, stream>>>(pb);
  FLASHMSA_BACKWARD_CHECK(cudaGetLastError(), "reduce_kl_final");
  return Status::Ok();
}

}  // namespace flashmsa::kernels::backward
