// Benchmark of warmup mode (SPEC.md §5): the dense causal forward (O, LSE, proxy LSE) and forward +
// backward (main gradients, KL gradient and KL value). Opt-in stage: `flashmsa_bench --stages warmup`.
//
// Counted FLOPs are the main branch's only, as for the dense anchors: forward 4·D·H·B·S(S+1)/2,
// forward + backward 3.5 times that (the proxy LSE, the KL and the backward's recomputation of P
// are not counted). Inputs are device-generated N(0, 1) values (bench/inputs.cuh).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <tuple>
#include <vector>

#include "bench.h"
#include "common/cases.h"
#include "flashmsa/api.h"
#include "inputs.cuh"

namespace flashmsa::bench {

namespace {

// Every buffer of one warmup forward + backward, and the params pointing into them.
struct WarmupBuffers {
  explicit WarmupBuffers(const ProblemShape& shape)
      : tokens(shape.batch * shape.seqlen),
        q(gaussian_tensor(tokens * shape.num_heads * shape.head_dim, 1, DType::kBF16)),
        k(gaussian_tensor(tokens * shape.num_kv_heads * shape.head_dim, 2, DType::kBF16)),
        v(gaussian_tensor(tokens * shape.num_kv_heads * shape.head_dim, 3, DType::kBF16)),
        q_proxy(gaussian_tensor(tokens * shape.num_proxy_heads * shape.proxy_head_dim, 4, DType::kBF16)),
        k_proxy(gaussian_tensor(tokens * shape.num_proxy_kv_heads * shape.proxy_head_dim, 5, DType::kBF16)),
        dout(gaussian_tensor(tokens * shape.num_heads * shape.head_dim, 6, DType::kBF16)),
        out(q.size()), dq(q.size()), dk(k.size()), dv(v.size()), dq_proxy(q_proxy.size()),
        dk_proxy(k_proxy.size()), lse(size_t(tokens * shape.num_heads)),
        proxy_lse(size_t(tokens * shape.num_proxy_heads)), kl(1), kl_grad(constant_tensor(1, 1.f)),
        forward_workspace(forward_workspace_size(shape, Mode::kWarmup)),
        backward_workspace(backward_workspace_size(shape, Mode::kWarmup, false)) {
    auto view = [&](const testing::DeviceBuffer<uint16_t>& buffer, int heads, int dim) {
      return cases::bshd(buffer.get(), shape, heads, dim);
    };
    const int D = shape.head_dim;
    const int Di = shape.proxy_head_dim;
    ForwardParams& fwd = params.fwd;
    fwd.shape = shape;
    fwd.dtype = DType::kBF16;
    fwd.mode = Mode::kWarmup;
    fwd.q = view(q, shape.num_heads, D);
    fwd.k = view(k, shape.num_kv_heads, D);
    fwd.v = view(v, shape.num_kv_heads, D);
    fwd.q_proxy = view(q_proxy, shape.num_proxy_heads, Di);
    fwd.k_proxy = view(k_proxy, shape.num_proxy_kv_heads, Di);
    fwd.out = view(out, shape.num_heads, D);
    fwd.lse = lse.get();
    fwd.proxy_lse = proxy_lse.get();
    fwd.kl = kl.get();
    fwd.workspace = forward_workspace.get();
    params.dout = view(dout, shape.num_heads, D);
    params.kl_grad = kl_grad.get();
    params.dq = view(dq, shape.num_heads, D);
    params.dk = view(dk, shape.num_kv_heads, D);
    params.dv = view(dv, shape.num_kv_heads, D);
    params.dq_proxy = view(dq_proxy, shape.num_proxy_heads, Di);
    params.dk_proxy = view(dk_proxy, shape.num_proxy_kv_heads, Di);
    params.workspace = backward_workspace.get();
  }

  Status forward_backward(cudaStream_t stream) const {
    if (Status status = forward(params.fwd, stream); !status.ok()) return status;
    return backward(params, stream);
  }

  int64_t tokens;
  testing::DeviceBuffer<uint16_t> q, k, v, q_proxy, k_proxy, dout;
  testing::DeviceBuffer<uint16_t> out, dq, dk, dv, dq_proxy, dk_proxy;
  testing::DeviceBuffer<float> lse, proxy_lse, kl, kl_grad;
  testing::DeviceBuffer<char> forward_workspace, backward_workspace;
  BackwardParams params;
};

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
      const WarmupBuffers buffers(shape);
      if (Status status = buffers.forward_backward(stream); !status.ok()) {
        std::fprintf(stderr, "warmup %s S=%lld: %s\n", config_name.c_str(), static_cast<long long>(seqlen),
                     status.message.c_str());
        continue;
      }
      FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(stream));
      const double forward_ms = time_median_ms([&](cudaStream_t s) { forward(buffers.params.fwd, s); }, stream,
                                               options.warmup, options.repeats);
      const double step_ms = time_median_ms([&](cudaStream_t s) { buffers.forward_backward(s); }, stream,
                                            options.warmup, options.repeats);
      const double flops = dense_forward_flops(shape);
      for (const auto& [stage, ms, factor] :
           {std::tuple<const char*, double, double>{"warmup_fwd", forward_ms, 1.0},
            std::tuple<const char*, double, double>{"warmup_fwd_bwd", step_ms, 3.5}}) {
        Row row;
        row.stage = stage;
        row.config = config_name;
        row.pattern = "dense";
        row.seqlen = seqlen;
        row.ms = ms;
        row.tflops = factor * flops / (ms * 1e-3) / 1e12;
        row.peak_mem_gb = device_memory_used_gb();
        row.note = factor == 1.0 ? "dense causal O, LSE, proxy LSE" : "+ main gradients, KL gradient and value";
        rows.push_back(row);
      }
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace flashmsa::bench
