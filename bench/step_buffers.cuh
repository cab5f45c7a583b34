// The device buffers of one training step of one shape (N(0, 1) inputs, outputs, gradients,
// workspaces) and the params of select, schedule, forward and backward pointing into them, in
// sparse mode or (no selection, no schedule) warmup mode. Shared by the step, backward and warmup
// benchmarks (bench_step.cu, bench_backward.cu, bench_warmup.cu).
#pragma once

#include <cstdio>
#include <string>

#include "common/cases.h"
#include "common/patterns.h"
#include "flashmsa/api.h"
#include "inputs.cuh"

namespace flashmsa::bench {

// Every buffer of one step of one shape, and the params of the four ops pointing into them.
struct StepBuffers {
  explicit StepBuffers(const ProblemShape& shape, Mode mode = Mode::kSparse)
      : tokens(shape.batch * shape.seqlen),
        q(gaussian_tensor(tokens * shape.num_heads * shape.head_dim, 1, DType::kBF16)),
        k(gaussian_tensor(tokens * shape.num_kv_heads * shape.head_dim, 2, DType::kBF16)),
        v(gaussian_tensor(tokens * shape.num_kv_heads * shape.head_dim, 3, DType::kBF16)),
        q_proxy(gaussian_tensor(tokens * shape.num_proxy_heads * shape.proxy_head_dim, 4, DType::kBF16)),
        k_proxy(gaussian_tensor(tokens * shape.num_proxy_kv_heads * shape.proxy_head_dim, 5, DType::kBF16)),
        dout(gaussian_tensor(tokens * shape.num_heads * shape.head_dim, 6, DType::kBF16)),
        out(q.size()), dq(q.size()), dk(k.size()), dv(v.size()),
        dq_proxy(q_proxy.size()), dk_proxy(k_proxy.size()),
        block_idx(mode == Mode::kSparse ? size_t(tokens * shape.num_proxy_heads * shape.top_k) : 0),
        lse(size_t(tokens * shape.num_heads)), proxy_lse(size_t(tokens * shape.num_proxy_heads)),
        kl(1), kl_grad(constant_tensor(1, 1.f)),
        schedule_workspace(mode == Mode::kSparse ? schedule_workspace_size(shape) : 0),
        forward_workspace(forward_workspace_size(shape, mode)),
        backward_workspace(backward_workspace_size(shape, mode, false, DType::kBF16)) {
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
    fwd.mode = mode;
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

  // (sparse: schedule +) forward + backward; the first failing op's status.
  Status forward_backward(cudaStream_t stream) const {
    if (backward_params.fwd.mode == Mode::kSparse) {
      if (Status status = schedule(schedule_params, stream); !status.ok()) return status;
    }
    if (Status status = forward(backward_params.fwd, stream); !status.ok()) return status;
    return backward(backward_params, stream);
  }

  // block_idx for a selection pattern of SPEC.md by name: `random` is the select kernel's selection
  // on the Gaussian proxies, `hot` and `tile_shared` come from tests/common/patterns.h, and
  // `uniform` (only when named) is that file's uniform draw per query. False (with a message for a
  // failing select) when the name is unknown or the selection failed.
  bool select_pattern(const std::string& name, cudaStream_t stream) const {
    if (name == "random") {  // ordered after the queued work that may still read block_idx
      const Status status = select(select_params, stream);
      if (!status.ok()) std::fprintf(stderr, "select: %s\n", status.message.c_str());
      return status.ok();
    }
    patterns::Pattern pattern = patterns::Pattern::kRandom;  // tests/common/patterns.h's uniform draw
    if (name != "uniform" && !patterns::parse_pattern(name, &pattern)) return false;
    FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(stream));  // block_idx may still be read by queued work
    block_idx.upload(patterns::make_selection(select_params.shape, pattern, 42));
    return true;
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

}  // namespace flashmsa::bench
