// Benchmark of the sparse backward (SPEC.md §3-§4, main gradients + KL gradient + KL value) on the
// selection patterns of SPEC.md (StepBuffers::select_pattern; `uniform`, only when named, is the
// stand-in that results before `5d07523` called `random`). Counted FLOPs: 2.5 × 4·D·Σ_{h,i}
// |T_hi| (the forward's 4·D per selected (head, query, key), times the usual 2.5 for the backward).
//
// Inputs are device-generated N(0, 1) values (bench/step_buffers.cuh); the saved tensors come from
// one forward on them before the timed backward runs.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

#include "bench.h"
#include "common/cases.h"
#include "flashmsa/api.h"
#include "step_buffers.cuh"

namespace flashmsa::bench {

FLASHMSA_BENCH(backward, bench_backward) {
  cudaStream_t stream;
  FLASHMSA_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const std::string& config_name : options.configs) {
    const cases::HeadConfig* config = cases::find_config(config_name);
    if (config == nullptr) continue;
    for (int64_t seqlen : options.seqlens) {
      const ProblemShape shape = cases::make_shape(*config, 1, seqlen);
      const StepBuffers buffers(shape);

      for (const std::string& pattern_name : options.patterns) {
        if (!buffers.select_pattern(pattern_name, stream)) continue;
        const BackwardParams& params = buffers.backward_params;
        // The saved tensors (out, lse, proxy_lse) come from a real forward on the same inputs.
        if (Status status = buffers.forward_backward(stream); !status.ok()) {
          std::fprintf(stderr, "backward %s S=%lld %s: %s\n", config_name.c_str(),
                       static_cast<long long>(seqlen), pattern_name.c_str(),
                       status.message.c_str());
          continue;
        }
        const double ms = time_median_ms([&](cudaStream_t s) { backward(params, s); }, stream,
                                         options.warmup, options.repeats);
        rows.push_back(timed_row("backward", config_name, pattern_name, seqlen, ms, 2.5 * main_forward_flops(shape),
                                 "main + KL gradient + KL value"));
      }
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace flashmsa::bench
