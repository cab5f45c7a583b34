// Benchmark of the sparse backward (SPEC.md §3-§4, main gradients + KL gradient + KL value) on the
// selection patterns of tests/common/patterns.h. Counted FLOPs: 2.5 × 4·D·Σ_{h,i} |T_hi| (the
// forward's 4·D per selected (head, query, key), times the usual 2.5 for the backward).
//
// Inputs are device-generated N(0, 1) values (bench/inputs.cuh); the saved LSEs are set to 8 (the
// order of log Σ_{j∈T} e^z for |T| ≈ 2000 and z ~ N(0, 1)). The backward's time does not depend on
// the values, only on the selection.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

#include "bench.h"
#include "common/cases.h"
#include "common/patterns.h"
#include "flashmsa/api.h"
#include "inputs.cuh"

namespace flashmsa::bench {

FLASHMSA_BENCH(backward, bench_backward) {
  cudaStream_t stream;
  FLASHMSA_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const std::string& config_name : options.configs) {
    const cases::HeadConfig* config = cases::find_config(config_name);
    if (config == nullptr) continue;
    for (int64_t seqlen : options.seqlens) {
      const ProblemShape shape = cases::make_shape(*config, 1, seqlen);
      const int64_t tokens = shape.batch * shape.seqlen;
      const int D = shape.head_dim;
      auto q = gaussian_tensor(tokens * shape.num_heads * D, 1, DType::kBF16);
      auto k = gaussian_tensor(tokens * shape.num_kv_heads * D, 2, DType::kBF16);
      auto v = gaussian_tensor(tokens * shape.num_kv_heads * D, 3, DType::kBF16);
      auto q_proxy = gaussian_tensor(tokens * shape.num_proxy_heads * D, 4, DType::kBF16);
      auto k_proxy = gaussian_tensor(tokens * shape.num_proxy_kv_heads * D, 5, DType::kBF16);
      auto out = gaussian_tensor(tokens * shape.num_heads * D, 6, DType::kBF16);
      auto dout = gaussian_tensor(tokens * shape.num_heads * D, 7, DType::kBF16);
      auto lse = constant_tensor(tokens * shape.num_heads, 8.f);
      auto proxy_lse = constant_tensor(tokens * shape.num_proxy_heads, 8.f);
      auto kl_grad = constant_tensor(1, 1.f);
      testing::DeviceBuffer<float> kl(1);
      testing::DeviceBuffer<uint16_t> dq(size_t(tokens * shape.num_heads * D));
      testing::DeviceBuffer<uint16_t> dk(size_t(tokens * shape.num_kv_heads * D));
      testing::DeviceBuffer<uint16_t> dv(size_t(tokens * shape.num_kv_heads * D));
      testing::DeviceBuffer<uint16_t> dq_proxy(size_t(tokens * shape.num_proxy_heads * D));
      testing::DeviceBuffer<uint16_t> dk_proxy(size_t(tokens * shape.num_proxy_kv_heads * D));
      testing::DeviceBuffer<char> schedule(std::max<size_t>(256, schedule_workspace_size(shape)));
      testing::DeviceBuffer<char> workspace(std::max<size_t>(256, backward_workspace_size(shape, Mode::kSparse, false)));
      testing::DeviceBuffer<int32_t> block_idx(size_t(tokens * shape.num_proxy_heads * shape.top_k));

      for (const std::string& pattern_name : options.patterns) {
        patterns::Pattern pattern;
        if (!patterns::parse_pattern(pattern_name, &pattern)) continue;
        const std::vector<int32_t> selection = patterns::make_selection(shape, pattern, 42);
        block_idx.upload(selection);

        BackwardParams params;
        params.fwd.shape = shape;
        params.fwd.dtype = DType::kBF16;
        params.fwd.q = cases::bshd(q.get(), shape, shape.num_heads, D);
        params.fwd.k = cases::bshd(k.get(), shape, shape.num_kv_heads, D);
        params.fwd.v = cases::bshd(v.get(), shape, shape.num_kv_heads, D);
        params.fwd.q_proxy = cases::bshd(q_proxy.get(), shape, shape.num_proxy_heads, D);
        params.fwd.k_proxy = cases::bshd(k_proxy.get(), shape, shape.num_proxy_kv_heads, D);
        params.fwd.block_idx = block_idx.get();
        params.fwd.schedule = schedule.get();
        params.fwd.out = cases::bshd(out.get(), shape, shape.num_heads, D);
        params.fwd.lse = lse.get();
        params.fwd.proxy_lse = proxy_lse.get();
        params.fwd.kl = kl.get();
        params.dout = cases::bshd(dout.get(), shape, shape.num_heads, D);
        params.kl_grad = kl_grad.get();
        params.dq = cases::bshd(dq.get(), shape, shape.num_heads, D);
        params.dk = cases::bshd(dk.get(), shape, shape.num_kv_heads, D);
        params.dv = cases::bshd(dv.get(), shape, shape.num_kv_heads, D);
        params.dq_proxy = cases::bshd(dq_proxy.get(), shape, shape.num_proxy_heads, D);
        params.dk_proxy = cases::bshd(dk_proxy.get(), shape, shape.num_proxy_kv_heads, D);
        params.workspace = workspace.get();

        const Status status = backward(params, stream);
        if (!status.ok()) {
          std::fprintf(stderr, "backward %s S=%lld %s: %s\n", config_name.c_str(), (long long)seqlen,
                       pattern_name.c_str(), status.message.c_str());
          continue;
        }
        const double ms = time_median_ms([&](cudaStream_t s) { backward(params, s); }, stream,
                                         options.warmup, options.repeats);
        const double flops = 2.5 * main_forward_flops(shape);
        Row row;
        row.stage = "backward";
        row.config = config_name;
        row.pattern = pattern_name;
        row.seqlen = seqlen;
        row.ms = ms;
        row.tflops = flops / (ms * 1e-3) / 1e12;
        row.peak_mem_gb = device_memory_used_gb();
        row.note = "main + KL gradient + KL value; saved tensors synthetic";
        rows.push_back(row);
      }
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace flashmsa::bench
