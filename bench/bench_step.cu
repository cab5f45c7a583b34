// Benchmarks of whole training steps of the sparse path:
//   step     select + schedule + forward + backward (main and KL), selection from random Gaussian
//            proxies through the select kernel (the `random` pattern of SPEC.md);
//   fwd_bwd  schedule + forward + backward on a given selection, for each pattern
//            (StepBuffers::select_pattern: `random` is the select kernel's output).
// TFLOP/s counts the main branch only: 3.5 × the forward's 4·D·H·Σ|T| (forward + 2.5 × backward).
#include <cstdio>
#include <string>
#include <vector>

#include "bench.h"
#include "common/cases.h"
#include "flashmsa/api.h"
#include "step_buffers.cuh"

namespace flashmsa::bench {

FLASHMSA_BENCH(step, bench_step) {
  cudaStream_t stream;
  FLASHMSA_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const std::string& config_name : options.configs) {
    const cases::HeadConfig* config = cases::find_config(config_name);
    if (config == nullptr) continue;
    for (int64_t seqlen : options.seqlens) {
      const ProblemShape shape = cases::make_shape(*config, 1, seqlen);
      const StepBuffers buffers(shape);
      const double main_flops = 3.5 * main_forward_flops(shape);
      auto add_row = [&](const char* stage, const std::string& pattern, double ms, const char* note) {
        rows.push_back(timed_row(stage, config_name, pattern, seqlen, ms, main_flops, note));
      };

      if (Status status = buffers.step(stream); !status.ok()) {
        std::fprintf(stderr, "step %s S=%lld: %s\n", config_name.c_str(),
                     static_cast<long long>(seqlen), status.message.c_str());
        continue;
      }
      add_row("step", "random",
              time_median_ms([&](cudaStream_t s) { buffers.step(s); }, stream, options.warmup,
                             options.repeats),
              "select + schedule + forward + backward (main + KL); TFLOP/s on the main branch");

      for (const std::string& pattern_name : options.patterns) {
        if (!buffers.select_pattern(pattern_name, stream)) continue;
        add_row("fwd_bwd", pattern_name,
                time_median_ms([&](cudaStream_t s) { buffers.forward_backward(s); }, stream,
                               options.warmup, options.repeats),
                "schedule + forward + backward (main + KL) on the given selection");
      }
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace flashmsa::bench
