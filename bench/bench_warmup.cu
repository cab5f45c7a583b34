// Benchmark of warmup mode (SPEC.md §5): the dense causal forward (O, LSE, proxy LSE) and forward +
// backward (main gradients, KL gradient and KL value). Opt-in stage: `flashmsa_bench --stages warmup`.
//
// Counted FLOPs are the main branch's only, as for the dense anchors: forward 4·D·H·B·S(S+1)/2,
// forward + backward 3.5 times that (the proxy LSE, the KL and the backward's recomputation of P
// are not counted). Inputs are device-generated N(0, 1) values (bench/inputs.cuh).
//
// `warmup_kl` times what flashmsa adds when the dense main branch runs elsewhere (cuDNN through the
// PyTorch op; fwd.main_branch = false): the proxy LSE forward and the KL-only backward, which reads
// the LSE of the main forward. Counted: the backward's recomputation of S = QKᵀ, 2·D·H·B·S(S+1)/2.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <tuple>
#include <vector>

#include "bench.h"
#include "common/cases.h"
#include "flashmsa/api.h"
#include "step_buffers.cuh"

namespace flashmsa::bench {

namespace {

double dense_forward_flops(const ProblemShape& shape) {
  const double s = double(shape.seqlen);
  return 4.0 * shape.head_dim * shape.num_heads * shape.batch * s * (s + 1.0) / 2.0;
}

}  // namespace

FLASHMSA_BENCH_OPT_IN(warmup, bench_warmup) {
  cudaStream_t stream;
  FLASHMSA_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const std::string& config_name : options.configs) {
    const cases::HeadConfig* config = cases::find_config(config_name);
    if (config == nullptr) continue;
    for (int64_t seqlen : options.seqlens) {
      const ProblemShape shape = cases::make_shape(*config, 1, seqlen);
      const StepBuffers buffers(shape, Mode::kWarmup);
      if (Status status = buffers.forward_backward(stream); !status.ok()) {
        std::fprintf(stderr, "warmup %s S=%lld: %s\n", config_name.c_str(), static_cast<long long>(seqlen),
                     status.message.c_str());
        continue;
      }
      FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(stream));
      const double forward_ms = time_median_ms([&](cudaStream_t s) { forward(buffers.backward_params.fwd, s); }, stream,
                                               options.warmup, options.repeats);
      const double step_ms = time_median_ms([&](cudaStream_t s) { buffers.forward_backward(s); }, stream,
                                            options.warmup, options.repeats);
      const double flops = dense_forward_flops(shape);
      BackwardParams kl_only = buffers.backward_params;
      kl_only.fwd.main_branch = false;
      if (Status status = backward(kl_only, stream); !status.ok()) {
        std::fprintf(stderr, "warmup_kl %s S=%lld: %s\n", config_name.c_str(), static_cast<long long>(seqlen),
                     status.message.c_str());
      } else {
        const double kl_ms = time_median_ms(
            [&](cudaStream_t s) {
              forward(kl_only.fwd, s);
              backward(kl_only, s);
            },
            stream, options.warmup, options.repeats);
        rows.push_back(timed_row("warmup_kl", config_name, "dense", seqlen, kl_ms, 0.5 * flops,
                                 "proxy LSE + KL-only backward (main branch elsewhere)"));
      }
      for (const auto& [stage, ms, factor] :
           {std::tuple<const char*, double, double>{"warmup_fwd", forward_ms, 1.0},
            std::tuple<const char*, double, double>{"warmup_fwd_bwd", step_ms, 3.5}}) {
        rows.push_back(timed_row(stage, config_name, "dense", seqlen, ms, factor * flops,
                                 factor == 1.0 ? "dense causal O, LSE, proxy LSE"
                                               : "+ main gradients, KL gradient and value"));
      }
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace flashmsa::bench
