// Host side of the sparse forward: per query chunk, the tile kernel (persistent grid over the
// chunk's tiles, whose count only the device knows) and then the combine. Instantiated once per
// dtype in instantiations/*.cu; the runtime -> template dispatch is forward/launch.cu.
#pragma once

#include <string>

#include "kernels/common/device_cache.h"
#include "kernels/forward/combine.cuh"
#include "kernels/forward/kernel.cuh"
#include "kernels/forward/pipelined_kernel.cuh"
#include "kernels/launch.h"

namespace flashmsa::kernels::forward {

inline Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::Ok();
  return {StatusCode::kCudaError, std::string("forward: ") + what + ": " + cudaGetErrorString(error)};
}

// The pipelined tile kernel for M = H/Hp: compiled for M = 2, 4, 8 and 16, else M read at run time.
template <typename Element>
using PipelinedKernel = void (*)(TileArgs<Element>, PipelinedLayout);

template <typename Element>
PipelinedKernel<Element> pipelined_kernel_for(int heads_per_proxy) {
  switch (heads_per_proxy) {
    case 2:
      return sparse_forward_pipelined<Element, 2>;
    case 4:
      return sparse_forward_pipelined<Element, 4>;
    case 8:
      return sparse_forward_pipelined<Element, 8>;
    case 16:
      return sparse_forward_pipelined<Element, 16>;
    default:
      return sparse_forward_pipelined<Element, 0>;
  }
}

template <typename Element>
Status run_forward(const ForwardParams& params, cudaStream_t stream) {
  const ProblemShape& shape = params.shape;
  if (shape.head_dim != kHeadDim || shape.proxy_head_dim != kHeadDim) {
    return {StatusCode::kUnsupported, "shape.head_dim: the sparse forward is built for D = Di = 128"};
  }
  if (const Limit limit = schedule::schedule_limit(shape)) return unsupported(limit);
  const schedule::ScheduleLayout schedule_layout = schedule::make_schedule_layout(shape);
  const ForwardLayout layout = make_forward_layout(shape);
  const char* schedule_base = static_cast<const char*>(params.schedule);
  char* workspace = static_cast<char*>(params.workspace);

  TileArgs<Element> tile_args;
  tile_args.q = strided<const Element>(params.q);
  tile_args.k = strided<const Element>(params.k);
  tile_args.v = strided<const Element>(params.v);
  tile_args.q_proxy = strided<const Element>(params.q_proxy);
  tile_args.k_proxy = strided<const Element>(params.k_proxy);
  tile_args.tiles = reinterpret_cast<const uint4*>(schedule_base + schedule_layout.tiles);
  tile_args.tile_offsets = reinterpret_cast<const uint32_t*>(schedule_base + schedule_layout.tile_offsets);
  for (int i = 0; i < 2; ++i) {
    tile_args.entries[i] = reinterpret_cast<const uint32_t*>(schedule_base + schedule_layout.values[i]);
  }
  tile_args.header = reinterpret_cast<const int32_t*>(schedule_base + schedule_layout.header);
  tile_args.keys_per_chunk = schedule::keys_per_chunk(shape);
  tile_args.segment_keys = schedule::keys_per_segment(shape);
  tile_args.partial_out = reinterpret_cast<Element*>(workspace + layout.partial_out);
  tile_args.partial_lse = reinterpret_cast<float*>(workspace + layout.partial_lse);
  tile_args.partial_proxy_lse = reinterpret_cast<float*>(workspace + layout.partial_proxy_lse);
  set_shape_fields(tile_args, shape);
  tile_args.heads_per_proxy = shape.heads_per_proxy();
  tile_args.top_k = shape.top_k;
  tile_args.tokens_per_tile = schedule::tokens_per_tile(shape);
  tile_args.proxy_rows = proxy_rows(shape);
  constexpr double kLog2e = 1.4426950408889634;
  const double scale = effective_scale(params.softmax_scale, shape.head_dim);
  const double proxy_scale = effective_scale(params.proxy_scale, shape.proxy_head_dim);
  tile_args.scale_log2 = float(scale * kLog2e);
  tile_args.proxy_scale_log2 = float(proxy_scale * kLog2e);

  CombineArgs<Element> combine_args;
  combine_args.partial_out = tile_args.partial_out;
  combine_args.partial_lse = tile_args.partial_lse;
  combine_args.partial_proxy_lse = tile_args.partial_proxy_lse;
  combine_args.block_idx = params.block_idx;
  combine_args.out = strided<Element>(params.out);
  combine_args.lse = params.lse;
  combine_args.proxy_lse = params.proxy_lse;
  combine_args.seqlen = shape.seqlen;
  combine_args.num_heads = shape.num_heads;
  combine_args.num_proxy_heads = shape.num_proxy_heads;
  combine_args.heads_per_proxy = shape.heads_per_proxy();
  combine_args.top_k = shape.top_k;

  int device = 0;
  int num_sms = 0;
  if (Status s = cuda_status(current_device_sms(&device, &num_sms), "device"); !s.ok()) return s;
  // A chunk has at most ⌈rows / tokens⌉ · Hp · K tiles plus one partial tile per list; the grid
  // never needs more CTAs than that.
  const int64_t chunk_tile_bound = (layout.chunk_rows * shape.num_proxy_heads * shape.top_k) /
                                       tile_args.tokens_per_tile + tile_args.keys_per_chunk;
  const bool pipelined = pipelined_supported(shape);
  const PipelinedLayout pipelined_layout = make_pipelined_layout(shape);
  const PipelinedKernel<Element> pipelined_kernel = pipelined_kernel_for<Element>(shape.heads_per_proxy());
  const size_t smem = pipelined ? pipelined_layout.total : tile_smem_bytes(shape);
  int blocks_per_sm = 1;
  if (pipelined) {
    if (Status s = cuda_status(set_max_dynamic_smem(reinterpret_cast<const void*>(pipelined_kernel),
                                                    device, int(smem)),
                               "shared memory");
        !s.ok()) {
      return s;
    }
  } else {
    if (Status s = cuda_status(set_max_dynamic_smem(reinterpret_cast<const void*>(sparse_forward_tiles<Element>),
                                                    device, int(smem)),
                               "shared memory");
        !s.ok()) {
      return s;
    }
    if (Status s = cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                   &blocks_per_sm, sparse_forward_tiles<Element>, kThreads, smem),
                               "occupancy");
        !s.ok()) {
      return s;
    }
  }
  const int64_t grid = std::min<int64_t>(int64_t(num_sms) * std::max(blocks_per_sm, 1), chunk_tile_bound);
  const int64_t total_rows = shape.batch * shape.seqlen;
  uint32_t* tile_counters = reinterpret_cast<uint32_t*>(workspace + layout.tile_counters);
  const int64_t segments = segments_per_chunk(shape);
  if (Status s = cuda_status(cudaMemsetAsync(tile_counters, 0, size_t(layout.num_tile_counters) * 4, stream),
                             "tile counters");
      !s.ok()) {
    return s;
  }

  for (int64_t chunk = 0; chunk < schedule::num_chunks(shape); ++chunk) {
    const int64_t first_row = chunk * layout.chunk_rows;
    tile_args.first_key = chunk * tile_args.keys_per_chunk;
    tile_args.chunk_first_row = first_row;
    tile_args.tile_counters = tile_counters + chunk * segments;
    if (pipelined) {
      pipelined_kernel<<<unsigned(grid), kPipelinedThreads, smem, stream>>>(tile_args, pipelined_layout);
    } else {
      sparse_forward_tiles<Element><<<unsigned(grid), kThreads, smem, stream>>>(tile_args);
    }
    if (Status s = cuda_status(cudaGetLastError(), "tile kernel"); !s.ok()) return s;

    combine_args.chunk_first_row = first_row;
    combine_args.chunk_rows = std::min<int64_t>(layout.chunk_rows, total_rows - first_row);
    const int64_t warps = combine_args.chunk_rows * shape.num_proxy_heads;  // one per (row, proxy head)
    sparse_forward_combine<Element><<<unsigned((warps * 32 + 255) / 256), 256, 0, stream>>>(combine_args);
    if (Status s = cuda_status(cudaGetLastError(), "combine"); !s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace flashmsa::kernels::forward
