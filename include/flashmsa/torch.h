// LibTorch entry points of flashmsa: the ops of the `flashmsa` torch library (namespace
// torch.ops.flashmsa in Python) as C++ functions on at::Tensor. Link libflashmsa_torch.so, which
// registers the ops; these functions call them through the dispatcher, so a CUDA tensor runs the
// kernels (via api.h, on the current CUDA stream, with no host synchronisation) and a CPU tensor
// runs the fp64 reference (slow; for debugging and tests).
//
// Layout: activations are [batch, seqlen, heads, dim] with any strides whose last dim is
// contiguous (a [B, H, S, D] tensor passed as .transpose(1, 2) is read without a copy). dtypes:
// bf16 or fp16 (the CPU also takes fp32 and fp64). `top_k` counts 128-token blocks (K of SPEC.md),
// not tokens. Scales of 0 select the defaults D^-1/2 and Di^-1/2. mode is "sparse" or "warmup"
// (the op schemas call it attention_mode).
//
// Errors: a violated rule throws c10::ValueError naming the argument; a valid input without a
// kernel in this build throws c10::NotImplementedError; device errors throw c10::Error.
//
// forward() is differentiable (bindings/torch/autograd.cpp): when an input requires a gradient,
// autograd records it, and its backward calls backward() below and hands the KL value to
// `kl_sink` as its gradient. select() and backward() are not differentiable; a program may also
// call backward() itself with the upstream gradients.
#pragma once

#include <ATen/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace flashmsa::torch_ops {

// SPEC.md §1. q_proxy [B, S, Hp, Di], k_proxy [B, S, Hpk, Di] -> block_idx [B, Hp, S, top_k] int32,
// per row descending block score, -1 in slots beyond the visible blocks.
at::Tensor select(const at::Tensor& q_proxy, const at::Tensor& k_proxy, int64_t top_k,
                  double proxy_scale = 0.0);

// SPEC.md §2, §5. Returns (out [B, S, H, D] contiguous, lse [B, H, S] fp32, proxy_lse [B, Hp, S]
// fp32, kl) where kl is a 0-valued fp32 scalar that carries the KL's gradient: the KL value is
// only known to the backward, which returns it. block_idx may be empty in warmup mode.
// `deterministic` and `kl_sink` are not used here; they are part of the signature for autograd:
// the backward's KL value becomes the gradient of `kl_sink`.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_proxy,
    const at::Tensor& k_proxy, const std::optional<at::Tensor>& block_idx, int64_t top_k,
    const std::string& mode = "sparse", double softmax_scale = 0.0, double proxy_scale = 0.0,
    bool deterministic = false, const std::optional<at::Tensor>& kl_sink = std::nullopt);

// SPEC.md §3-§4. dout [B, S, H, D] in any layout; kl_grad: fp32 scalar ḡ = ∂loss/∂kl (empty: 0);
// out, lse, proxy_lse as the forward returned them. Returns (dq, dk, dv, dq_proxy, dk_proxy,
// kl_value): the gradients, each with the size of its input, and L_KL of SPEC.md §3 as an fp32
// 0-d tensor on the device.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout, const std::optional<at::Tensor>& kl_grad, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_proxy, const at::Tensor& k_proxy,
    const std::optional<at::Tensor>& block_idx, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& proxy_lse, int64_t top_k, const std::string& mode = "sparse",
    double softmax_scale = 0.0, double proxy_scale = 0.0, bool deterministic = false);

}  // namespace flashmsa::torch_ops
