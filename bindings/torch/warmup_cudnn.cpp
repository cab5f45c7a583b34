// Warmup mode's dense causal main branch on cuDNN's fused attention (ATen's cuDNN SDPA op), for the
// CUDA ops of cuda_ops.cpp. flashmsa then adds only what cuDNN cannot: the proxy LSE (the forward
// with ForwardParams::main_branch = false) and the KL value and proxy gradients (the KL-only
// backward, which reads cuDNN's LSE). docs/design.md "Warmup" has the costs.
//
// Used when warmup_main_on_cudnn() says so: non-deterministic mode (cuDNN's backward and the
// KL-only pass both sum in run-dependent order), H/Hp ∈ {2, 4, 8, 16} (the KL-only kernel) and
// FLASHMSA_WARMUP_MAIN unset or "cudnn"; FLASHMSA_WARMUP_MAIN=flashmsa keeps flashmsa's own dense
// kernels. cuDNN's LSE is the natural-log LSE of the scaled scores, flashmsa's convention, so the
// forward of one route and the backward of the other combine.
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

#include "warmup_cudnn.h"

namespace flashmsa::torch_binding {

bool warmup_main_on_cudnn(const ProblemShape& shape, bool deterministic) {
  const char* choice = std::getenv("FLASHMSA_WARMUP_MAIN");
  if (choice != nullptr && std::strcmp(choice, "flashmsa") == 0) return false;
  const int m = shape.heads_per_proxy();
  return !deterministic && shape.head_dim == 128 && shape.proxy_head_dim == 128 &&
         (m == 2 || m == 4 || m == 8 || m == 16);
}

namespace {

// [b, s, heads, d] -> the [b, heads, s, d] view cuDNN takes. K and V keep their Hkv heads: cuDNN's
// attention graphs take GQA natively (each group of H/Hkv query heads reads one K/V head, and the
// backward sums the group's dK, dV itself), so no H-head copy of K and V is written.
at::Tensor head_major(const at::Tensor& x) { return x.transpose(1, 2); }

// `value` in a tensor with the size and strides of `like` (empty_like), copied only when needed.
at::Tensor like_strides(const at::Tensor& value, const at::Tensor& like) {
  if (value.strides() == like.strides()) return value;
  at::Tensor result = at::empty_like(like);
  result.copy_(value);
  return result;
}

CudnnGradients dense_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& out, const at::Tensor& lse, const ProblemShape& shape,
                              double softmax_scale) {
  // cuDNN wants dO laid out as O; both [b, s, h, d] contiguous here.
  const at::Tensor dout_dense = dout.contiguous();
  const at::Tensor out_dense = out.contiguous();
  const at::Tensor lse4 = lse.reshape({shape.batch, shape.num_heads, shape.seqlen, 1});
  // Dropout is off: the random-state tensors are placeholders.
  const at::Tensor philox = at::empty({}, q.options().dtype(at::kLong));
  auto grads = at::_scaled_dot_product_cudnn_attention_backward(
      head_major(dout_dense), head_major(q), head_major(k), head_major(v), head_major(out_dense), lse4,
      philox, philox, at::Tensor(), at::Tensor(), at::Tensor(), shape.seqlen, shape.seqlen,
      /*dropout_p=*/0.0, /*is_causal=*/true, softmax_scale);
  CudnnGradients gradients;
  gradients.dq = like_strides(std::get<0>(grads).transpose(1, 2), q);
  gradients.dk = like_strides(std::get<1>(grads).transpose(1, 2), k);
  gradients.dv = like_strides(std::get<2>(grads).transpose(1, 2), v);
  return gradients;
}

}  // namespace

std::optional<CudnnForward> cudnn_dense_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const ProblemShape& shape, double softmax_scale) {
  try {
    auto result = at::_scaled_dot_product_cudnn_attention(
        head_major(q), head_major(k), head_major(v), std::nullopt, /*compute_log_sumexp=*/true,
        /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false, softmax_scale);
    CudnnForward forward;
    forward.out = std::get<0>(result).transpose(1, 2).contiguous();
    forward.lse = std::get<1>(result).reshape({shape.batch, shape.num_heads, shape.seqlen}).contiguous();
    return forward;
  } catch (const c10::Error& error) {
    TORCH_WARN_ONCE("flashmsa: warmup mode runs its own dense kernels; cuDNN attention refused: ", error.what_without_backtrace());
    return std::nullopt;
  }
}

std::optional<CudnnGradients> cudnn_dense_backward(const at::Tensor& dout, const at::Tensor& q,
                                                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                                   const at::Tensor& lse, const ProblemShape& shape,
                                                   double softmax_scale) {
  try {
    return dense_backward(dout, q, k, v, out, lse, shape, softmax_scale);
  } catch (const c10::Error& error) {
    TORCH_WARN_ONCE("flashmsa: warmup mode runs its own dense backward; cuDNN attention refused: ",
                    error.what_without_backtrace());
    return std::nullopt;
  }
}

}  // namespace flashmsa::torch_binding
