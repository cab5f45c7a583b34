// Benchmarks of whole training steps of the sparse path:
//   step     select + schedule + forward + backward (main and KL), selection from random Gaussian
//            proxies through the select kernel (the `random` pattern of SPEC.md);
//   fwd_bwd  schedule + forward + backward on a given selection, for each pattern (`random` is the
//            select kernel's output, `hot` and `tile_shared` come from tests/common/patterns.h).
// TFLOP/s counts the main branch only: 3.5 × the forward's 4·D·H·Σ|T| (forward + 2.5 × backward).
#include <cstdio>
#include <string>
#include <vector>

#include "bench.h"
#include "common/cases.h"
#include "common/patterns.h"
#include "flashmsa/api.h"
#include "inputs.cuh"

namespace flashmsa::bench {
namespace {

// Every buffer of one step of one shape, and the params of the four ops pointing into them.
struct StepBuffers {
  explicit StepBuffers(const ProblemShape& shape)
      : tokens(shape.batch * shape.seqlen),
        q(gaussian_tensor(tokens * shape.num_heads * shape.head_dim, 1, DType::kBF16)),
        k(gaussian_tensor(tokens * shape.num_kv_heads * shape.head_dim, 2, DType::kBF16)),
        v(gaussian_tensor(tokens * shape.num_kv_heads * shape.head_dim, 3, DType::kBF16)),
        q_proxy(gaussian_tensor(tokens * shape.num_proxy_heads * shape.proxy_head_dim, 4, DType::kBF16)),
        k_proxy(gaussian_tensor(tokens * shape.num_proxy_kv_heads * shape.proxy_head_dim, 5, DType::kBF16)),
        dout(gaussian_tensor(tokens * shape.num_heads * shape.head_dim, 6, DType::kBF16)),
        out(q.size()), dq(q.size()), dk(k.size()), dv(v.size()),
        dq_proxy(q_proxy.size()), dk_proxy(k_proxy.size()),
        block_idx(size_t(tokens * shape.num_proxy_heads * shape.top_k)),
        lse(size_t(tokens * shape.num_heads)), proxy_lse(size_t(tokens * shape.num_proxy_heads)),
        kl(1), kl_grad(constant_tensor(1, 1.f)),
        schedule_workspace(schedule_workspace_size(shape)),
        forward_workspace(forward_workspace_size(shape, Mode::kSparse)),
        backward_workspace(backward_workspace_size(shape, Mode::kSparse, false)) {
    auto view = [&](const testing::DeviceBuffer<uint16_t>& buffer, int heads, int dim) {
      return cases::bshd(buffer.get(), shape, heads, dim);
    };
    const int D = shape.head_dim;
    const int Di = shape.proxy_head_dim;
    select_params = {shape, DType::kBF16, 0.f, view(q_proxy, shape.num_proxy_heads, Di),
                     view(k_proxy, shape.num_proxy_kv_heads, Di), block_idx.get()};
    schedule_params = {shape, block_idx.get(), schedule_workspace.get()};
    ForwardParams& fwd = backward_params.fwd;
    fwd.shape = shape;
    fwd.dtype = DType::kBF16;
    fwd.q = view(q, shape.num_heads, D);
    fwd.k = view(k, shape.num_kv_heads, D);
    fwd.v = view(v, shape.num_kv_heads, D);
    fwd.q_proxy = select_params.q_proxy;
    fwd.k_proxy = select_params.k_proxy;
    fwd.block_idx = block_idx.get();
    fwd.schedule = schedule_workspace.get();
    fwd.out = view(out, shape.num_heads, D);
    fwd.lse = lse.get();
    fwd.proxy_lse = proxy_lse.get();
    fwd.kl = kl.get();
    fwd.workspace = forward_workspace.get();
    backward_params.dout = view(dout, shape.num_heads, D);
    backward_params.kl_grad = kl_grad.get();
    backward_params.dq = view(dq, shape.num_heads, D);
    backward_params.dk = view(dk, shape.num_kv_heads, D);
    backward_params.dv = view(dv, shape.num_kv_heads, D);
    backward_params.dq_proxy = view(dq_proxy, shape.num_proxy_heads, Di);
    backward_params.dk_proxy = view(dk_proxy, shape.num_proxy_kv_heads, Di);
    backward_params.workspace = backward_workspace.get();
  }

  // schedule + forward + backward; the first failing op's status.
  Status forward_backward(cudaStream_t stream) const {
    if (Status status = schedule(schedule_params, stream); !status.ok()) return status;
    if (Status status = forward(backward_params.fwd, stream); !status.ok()) return status;
    return backward(backward_params, stream);
  }

  Status step(cudaStream_t stream) const {
    if (Status status = select(select_params, stream); !status.ok()) return status;
    return forward_backward(stream);
  }

  int64_t tokens;
  testing::DeviceBuffer<uint16_t> q, k, v, q_proxy, k_proxy, dout;
  testing::DeviceBuffer<uint16_t> out, dq, dk, dv, dq_proxy, dk_proxy;
  testing::DeviceBuffer<int32_t> block_idx;
  testing::DeviceBuffer<float> lse, proxy_lse, kl, kl_grad;
  testing::DeviceBuffer<char> schedule_workspace, forward_workspace, backward_workspace;
  SelectParams select_params;
  ScheduleParams schedule_params;
  BackwardParams backward_params;
};

}  // namespace

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
        Row row;
        row.stage = stage;
        row.config = config_name;
        row.pattern = pattern;
        row.seqlen = seqlen;
        row.ms = ms;
        row.tflops = main_flops / (ms * 1e-3) / 1e12;
        row.peak_mem_gb = device_memory_used_gb();
        row.note = note;
        rows.push_back(row);
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
        patterns::Pattern pattern;
        if (!patterns::parse_pattern(pattern_name, &pattern)) continue;
        if (pattern == patterns::Pattern::kRandom) {
          FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(stream));
          (void)select(buffers.select_params, stream);  // the index branch's own selection
        } else {
          buffers.block_idx.upload(patterns::make_selection(shape, pattern, 42));
        }
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
