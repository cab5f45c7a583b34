// One MSA training step through the flashmsa ops from C++: select -> forward -> backward.
// Runs the kernels on an H100/H200 (bf16, head dim 128), else the CPU reference (head dim 16,
// a shorter sequence: the reference is slow).
#include <torch/torch.h>

#include <iostream>

#include "flashmsa/torch.h"

int main() {
  const bool gpu = torch::cuda::is_available();
  const torch::Device device = gpu ? torch::kCUDA : torch::kCPU;
  const int64_t batch = 1, seqlen = gpu ? 4096 : 512, heads = 16, kv_heads = 2, proxy_heads = 4;
  const int64_t proxy_kv_heads = 1, head_dim = gpu ? 128 : 16;
  const int64_t top_k_blocks = 4;  // 512 tokens
  const auto options = torch::TensorOptions().dtype(torch::kBFloat16).device(device);

  const torch::Tensor q = torch::randn({batch, seqlen, heads, head_dim}, options);
  const torch::Tensor k = torch::randn({batch, seqlen, kv_heads, head_dim}, options);
  const torch::Tensor v = torch::randn({batch, seqlen, kv_heads, head_dim}, options);
  const torch::Tensor q_proxy = torch::randn({batch, seqlen, proxy_heads, head_dim}, options);
  const torch::Tensor k_proxy = torch::randn({batch, seqlen, proxy_kv_heads, head_dim}, options);

  const torch::Tensor block_idx = flashmsa::torch_ops::select(q_proxy, k_proxy, top_k_blocks);
  const auto [out, lse, proxy_lse, kl] =
      flashmsa::torch_ops::forward(q, k, v, q_proxy, k_proxy, block_idx, top_k_blocks);
  const torch::Tensor dout = torch::randn_like(out);
  const torch::Tensor kl_grad = torch::ones({}, options.dtype(torch::kFloat));
  const auto [dq, dk, dv, dq_proxy, dk_proxy, kl_value] = flashmsa::torch_ops::backward(
      dout, kl_grad, q, k, v, q_proxy, k_proxy, block_idx, out, lse, proxy_lse, top_k_blocks);

  std::cout << "device " << device << ": out " << out.sizes() << ", KL " << kl_value.item<float>()
            << ", |dq_proxy| " << dq_proxy.to(torch::kFloat).norm().item<float>() << "\n";
  return 0;
}
