// The backward's reverse index: for each (b, proxy head p, KV block c), the sorted list of the
// (query token, slot) pairs that selected c, and the work items of the KV-outer tile kernel.
//
// Comes after select (block_idx) and before kernel.cuh's tile kernel, which reads the lists.
// Four small kernels (defined in dtype_free.cu), all on the stream, no host read-back (sizes are
// shape bounds):
//   count_selections  per (b, p, chunk of 512 rows): how many rows of the chunk chose each block
//   scan_lists        per (b, p): scan of those counts over the chunks (each chunk's first
//                     position inside a list) and over the blocks (each list's start and length)
//   plan_items        one CTA: tiles and work items per (b, KV head g, block c), and their scan
//   fill_lists        per (b, p, chunk): writes the entries, rows in ascending order
// Every list is sorted by token, so the result (and everything summed in list order) is
// deterministic.
//
// NOTES: the shared schedule stage (src/kernels/schedule) builds a similar reverse index for the
// forward; once its format is settled the backward can read it instead and drop these kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "flashmsa/api.h"
#include "kernels/backward/config.h"

namespace flashmsa::kernels::backward {

// Device pointers into the backward workspace (config.h WorkspaceLayout).
struct Workspace {
  int32_t* chunk_counts;
  int64_t* list_offset;
  int32_t* list_count;
  int32_t* item_start;
  int32_t* item_counter;
  int32_t* entries;
  float* delta;
  float* dq_scale;
  float* kv_bound;
  float* dq_accum;
  float* dq_proxy_accum;
  float* dk_accum;
  float* dv_accum;
  uint32_t* tile_counters;  // [chunks]: the proxy-gradient kernel's items dealt on demand
  float* dk_proxy_accum;
  float* kl_partial;
  float* kl_sums;
  uint32_t* tile_bounds;
  uint4* dealt_tiles;
  void* proxy_grad;  // 16-bit g = π − t rows of one pass of query chunks
};

// Everything the backward kernels read besides the tensors: params, derived sizes, workspace.
struct Problem {
  BackwardParams params;
  Workspace ws;
  int64_t num_blocks;       // NB
  int64_t num_chunks;       // ⌈S / kRowsPerChunk⌉
  float softmax_scale;      // σ
  float scale_log2;         // σ · log2(e)
  float proxy_scale;        // σp
  int heads_per_proxy;      // M
  int group_rows_per_slab;  // ⌊16/M⌋ capped at 8
  int group_rows_per_tile;  // 4 · group_rows_per_slab
  int proxy_per_kv_head;    // Hp / Hkv
  int tiles_per_item;       // kTilesPerItem, or "unbounded" in deterministic mode
  bool with_kl;             // KL gradient or value requested
  bool dq_half;             // dq_accum holds scaled fp16 sums (bf16 inputs on the wgmma kernel)
};

// Slot `slot` of a block_idx row counts when it names a visible block not named by an earlier
// slot (SPEC.md §2: T is a set; -1 and future blocks contribute nothing).
__device__ __forceinline__ bool slot_valid(const int32_t* row_slots, int slot, int64_t token,
                                           int64_t num_blocks) {
  const int32_t block = row_slots[slot];
  if (block < 0 || block >= num_blocks || int64_t(block) * kBlockSize > token) return false;
  for (int earlier = 0; earlier < slot; ++earlier) {
    if (row_slots[earlier] == block) return false;
  }
  return true;
}

__device__ __forceinline__ const int32_t* block_idx_row(const Problem& pb, int64_t batch,
                                                        int proxy_head, int64_t token) {
  const ProblemShape& shape = pb.params.fwd.shape;
  return pb.params.fwd.block_idx +
         ((batch * shape.num_proxy_heads + proxy_head) * shape.seqlen + token) * shape.top_k;
}

// Last block a row of chunk `chunk` can select.
__device__ __forceinline__ int64_t chunk_last_block(const Problem& pb, int64_t chunk) {
  const int64_t last_row = (chunk + 1) * kRowsPerChunk - 1;
  const int64_t block = last_row / kBlockSize;
  return block < pb.num_blocks - 1 ? block : pb.num_blocks - 1;
}

// Launches the four kernels above on `stream`.
Status build_schedule(const Problem& pb, cudaStream_t stream);

// The KL value: ordered two-pass sum of pb.ws.kl_partial, / (B·Hp·S), written to fwd.kl.
Status reduce_kl(const Problem& pb, cudaStream_t stream);

inline Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::Ok();
  return {StatusCode::kCudaError, std::string("backward: ") + what + ": " + cudaGetErrorString(error)};
}

#define FLASHMSA_BACKWARD_CHECK(expr, what)                                   \
  do {                                                                        \
    if (Status status_ = cuda_status((expr), (what)); !status_.ok()) return status_; \
  } while (0)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Tiles of the unit (b, g, c): its proxy heads' lists are cut into tiles separately.
__device__ __forceinline__ int unit_tiles(const Problem& pb, int64_t batch, int kv_head, int64_t block) {
  const ProblemShape& shape = pb.params.fwd.shape;
  int tiles = 0;
  for (int q = 0; q < pb.proxy_per_kv_head; ++q) {
    const int proxy_head = kv_head * pb.proxy_per_kv_head + q;
    const int count = pb.ws.list_count[(batch * shape.num_proxy_heads + proxy_head) * pb.num_blocks + block];
    tiles += (count + pb.group_rows_per_tile - 1) / pb.group_rows_per_tile;
  }
  return tiles;
}

}  // namespace flashmsa::kernels::backward
