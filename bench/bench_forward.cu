// Benchmarks of the schedule and the sparse forward (stages "schedule" and "forward") on the named
// configurations and the selection patterns of SPEC.md, with block_idx made on the device:
//   random       the index branch's selection (flashmsa::select) on the Gaussian proxies.
//   hot          the local block, block 0 and the K−2 most recent blocks: maximal fan-in.
//   tile_shared  the uniform draw keyed by (b, p, query block): all 128 queries of a block share it.
//   uniform      (only when named) the local block, then K−1 distinct earlier blocks drawn per query
//                (a hash of (b, p, i)); the `random` of results before the select kernel made it.
// TFLOP/s counts 4·D·|T|·H per query, |T| = (min(K, c(i)+1) − 1)·128 + (i mod 128) + 1.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "bench.h"
#include "common/cases.h"
#include "flashmsa/api.h"
#include "inputs.cuh"

namespace flashmsa::bench {
namespace {

enum Pattern { kUniformPattern = 0, kHotPattern = 1, kTileSharedPattern = 2, kSelectPattern = 3 };

__global__ void make_selection(int32_t* block_idx, int64_t rows, int64_t seqlen, int top_k, int pattern) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // (b · Hp + p) · S + i
  if (row >= rows) return;
  const int64_t i = row % seqlen;
  const int local = int(i / 128);
  int32_t* slots = block_idx + row * top_k;
  const int visible = min(top_k, local + 1);
  slots[0] = local;
  if (pattern == kHotPattern) {
    int filled = 1;
    if (local > 0 && filled < visible) slots[filled++] = 0;
    for (int c = local - 1; filled < visible; --c) slots[filled++] = c;
  } else {
    const uint64_t key = pattern == kTileSharedPattern ? uint64_t(row - i + local) : uint64_t(row);
    uint64_t state = mix_bits(key + 12345);
    for (int filled = 1; filled < visible;) {
      int c;
      if (local + 1 <= top_k) {
        c = filled - 1;  // every earlier block is kept
      } else {
        state = mix_bits(state + 1);
        c = int(state % uint64_t(local));
      }
      bool seen = false;
      for (int s = 1; s < filled; ++s) seen = seen || slots[s] == c;
      if (!seen) slots[filled++] = c;
    }
  }
  for (int s = visible; s < top_k; ++s) slots[s] = -1;
}

}  // namespace

FLASHMSA_BENCH(forward, bench_forward) {
  cudaStream_t stream;
  FLASHMSA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const std::string& config_name : options.configs) {
    const cases::HeadConfig* config = cases::find_config(config_name);
    if (config == nullptr) continue;
    for (int64_t seqlen : options.seqlens) {
      const ProblemShape shape = cases::make_shape(*config, 1, seqlen);
      auto q = gaussian_tensor(seqlen * shape.num_heads * shape.head_dim, 1, DType::kBF16);
      auto k = gaussian_tensor(seqlen * shape.num_kv_heads * shape.head_dim, 2, DType::kBF16);
      auto v = gaussian_tensor(seqlen * shape.num_kv_heads * shape.head_dim, 3, DType::kBF16);
      auto q_proxy = gaussian_tensor(seqlen * shape.num_proxy_heads * shape.proxy_head_dim, 4, DType::kBF16);
      auto k_proxy = gaussian_tensor(seqlen * shape.num_proxy_kv_heads * shape.proxy_head_dim, 5, DType::kBF16);
      testing::DeviceBuffer<uint16_t> out(seqlen * shape.num_heads * shape.head_dim);
      testing::DeviceBuffer<float> lse(seqlen * shape.num_heads);
      testing::DeviceBuffer<float> proxy_lse(seqlen * shape.num_proxy_heads);
      const int64_t selection_rows = shape.num_proxy_heads * seqlen;
      testing::DeviceBuffer<int32_t> block_idx(selection_rows * shape.top_k);
      testing::DeviceBuffer<char> schedule_workspace(schedule_workspace_size(shape));
      testing::DeviceBuffer<char> forward_workspace(forward_workspace_size(shape, Mode::kSparse));
      const double flops = main_forward_flops(shape);

      for (const std::string& pattern : options.patterns) {
        const int pattern_id = pattern == "random"        ? kSelectPattern
                               : pattern == "hot"         ? kHotPattern
                               : pattern == "tile_shared" ? kTileSharedPattern
                               : pattern == "uniform"     ? kUniformPattern
                                                          : -1;
        if (pattern_id < 0) continue;
        ScheduleParams schedule_params;
        schedule_params.shape = shape;
        schedule_params.block_idx = block_idx.get();
        schedule_params.workspace = schedule_workspace.get();
        ForwardParams params;
        params.shape = shape;
        params.dtype = DType::kBF16;
        params.q = cases::bshd(q.get(), shape, shape.num_heads, shape.head_dim);
        params.k = cases::bshd(k.get(), shape, shape.num_kv_heads, shape.head_dim);
        params.v = cases::bshd(v.get(), shape, shape.num_kv_heads, shape.head_dim);
        params.q_proxy = cases::bshd(q_proxy.get(), shape, shape.num_proxy_heads, shape.proxy_head_dim);
        params.k_proxy = cases::bshd(k_proxy.get(), shape, shape.num_proxy_kv_heads, shape.proxy_head_dim);
        params.block_idx = block_idx.get();
        params.schedule = schedule_workspace.get();
        params.out = cases::bshd(out.get(), shape, shape.num_heads, shape.head_dim);
        params.lse = lse.get();
        params.proxy_lse = proxy_lse.get();
        params.workspace = forward_workspace.get();
        if (pattern_id == kSelectPattern) {
          const SelectParams select_params{shape, DType::kBF16, 0.f, params.q_proxy, params.k_proxy,
                                           block_idx.get()};
          if (const Status status = flashmsa::select(select_params, stream); !status.ok()) {
            std::fprintf(stderr, "select failed: %s\n", status.message.c_str());
            continue;
          }
        } else {
          make_selection<<<unsigned((selection_rows + 255) / 256), 256, 0, stream>>>(
              block_idx.get(), selection_rows, seqlen, shape.top_k, pattern_id);
          FLASHMSA_CUDA_CHECK(cudaGetLastError());
        }

        bool failed = false;
        auto run_schedule = [&](cudaStream_t s) {
          const Status status = flashmsa::schedule(schedule_params, s);
          if (!status.ok()) {
            std::fprintf(stderr, "schedule failed: %s\n", status.message.c_str());
            failed = true;
          }
        };
        auto run_forward = [&](cudaStream_t s) {
          const Status status = flashmsa::forward(params, s);
          if (!status.ok()) {
            std::fprintf(stderr, "forward failed: %s\n", status.message.c_str());
            failed = true;
          }
        };
        const double schedule_ms = time_median_ms(run_schedule, stream, options.warmup, options.repeats);
        const double forward_ms = time_median_ms(run_forward, stream, options.warmup, options.repeats);
        if (failed) continue;
        rows.push_back(timed_row("schedule", config_name, pattern, seqlen, schedule_ms, 0.0,
                                 "block_idx made on the device (bench_forward.cu patterns)"));
        rows.push_back(timed_row("forward", config_name, pattern, seqlen, forward_ms, flops,
                                 "sparse main branch + proxy_lse, schedule excluded"));
      }
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace flashmsa::bench
