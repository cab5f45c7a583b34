// The autograd formula of flashmsa::forward, registered in C++ at the Autograd dispatch key.
//
// Comes after library.cpp (schemas); the CPU and CUDA kernels below autograd are cpu_ops.cpp and
// cuda_ops.cpp, the fake implementations python/flashmsa/_ops.py. The backward calls the
// flashmsa::backward op through the dispatcher, so it runs the kernels on CUDA tensors, the
// reference on CPU tensors, and is traced like any op by torch.compile (AOTAutograd) and captured by
// CUDA graphs. The KL value that the backward returns becomes the gradient of the optional
// `kl_sink` input, so it reaches the caller through autograd with no host synchronisation.
//
// NOTES: the formula lives in C++ rather than in torch.library.register_autograd (Python) because a
// Python autograd kernel costs every call of the op, with or without gradients, two crossings
// between the dispatcher and Python and a dataclass per call (≈ 5 µs of host time per call,
// measured with meta tensors on a 2-core CI machine); this kernel costs well under 1 µs when no
// input requires a gradient. LibTorch programs (include/flashmsa/torch.h) get the same autograd.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace flashmsa::torch_binding {

namespace {

using ForwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using ForwardSignature = ForwardOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, int64_t, c10::string_view,
                                        double, double, bool, const std::optional<at::Tensor>&);
using BackwardOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using BackwardSignature = BackwardOutputs(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, c10::string_view, double,
    double, bool);

// The forward op below the autograd key: the CPU, CUDA or fake implementation.
ForwardOutputs forward_below_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& q_proxy, const at::Tensor& k_proxy,
                                      const std::optional<at::Tensor>& block_idx, int64_t top_k,
                                      c10::string_view mode, double softmax_scale,
                                      double proxy_scale, bool deterministic,
                                      const std::optional<at::Tensor>& kl_sink) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashmsa::forward", "")
                             .typed<ForwardSignature>();
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, q_proxy, k_proxy, block_idx, top_k, mode, softmax_scale, proxy_scale,
                 deterministic, kl_sink);
}

// Indices into the saved tensors of MSAForward.
enum Saved { kQ, kK, kV, kQProxy, kKProxy, kBlockIdx, kOut, kLse, kProxyLse };

class MSAForward : public torch::autograd::Function<MSAForward> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
      const at::Tensor& v, const at::Tensor& q_proxy, const at::Tensor& k_proxy,
      const std::optional<at::Tensor>& block_idx, int64_t top_k, c10::string_view mode,
      double softmax_scale, double proxy_scale, bool deterministic,
      const std::optional<at::Tensor>& kl_sink) {
    auto [out, lse, proxy_lse, kl] =
        forward_below_autograd(q, k, v, q_proxy, k_proxy, block_idx, top_k, mode, softmax_scale,
                               proxy_scale, deterministic, kl_sink);
    ctx->mark_non_differentiable({lse, proxy_lse});
    // Undefined output gradients stay undefined: dout and dkl are handled below, and the
    // gradients of lse and proxy_lse (non-differentiable) would only cost two zero fills.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, q_proxy, k_proxy, block_idx.value_or(at::Tensor()), out, lse,
                            proxy_lse});
    ctx->saved_data["top_k"] = top_k;
    ctx->saved_data["mode"] = std::string(mode);
    ctx->saved_data["softmax_scale"] = softmax_scale;
    ctx->saved_data["proxy_scale"] = proxy_scale;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["has_kl_sink"] = kl_sink.has_value() && kl_sink->defined();
    if (kl_sink.has_value() && kl_sink->defined()) {
      ctx->saved_data["kl_sink_sizes"] = kl_sink->sizes().vec();
    }
    return {out, lse, proxy_lse, kl};
  }

  // grads: (dout, dlse, dproxy_lse, dkl). Returns one entry per forward argument.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flashmsa::backward", "")
                               .typed<BackwardSignature>();
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& out = saved[kOut];
    const at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const std::optional<at::Tensor> kl_grad =
        grads[3].defined() ? std::optional<at::Tensor>(grads[3]) : std::nullopt;
    const std::optional<at::Tensor> block_idx =
        saved[kBlockIdx].defined() ? std::optional<at::Tensor>(saved[kBlockIdx]) : std::nullopt;
    const std::string mode = ctx->saved_data["mode"].toStringRef();
    auto [dq, dk, dv, dq_proxy, dk_proxy, kl_value] =
        op.call(dout, kl_grad, saved[kQ], saved[kK], saved[kV], saved[kQProxy], saved[kKProxy],
                block_idx, out, saved[kLse], saved[kProxyLse], ctx->saved_data["top_k"].toInt(),
                mode, ctx->saved_data["softmax_scale"].toDouble(),
                ctx->saved_data["proxy_scale"].toDouble(),
                ctx->saved_data["deterministic"].toBool());
    at::Tensor kl_sink_grad;
    if (ctx->saved_data["has_kl_sink"].toBool()) {
      kl_sink_grad = kl_value.reshape(ctx->saved_data["kl_sink_sizes"].toIntVector());
    }
    return {dq,           dk,           dv,           dq_proxy,     dk_proxy,     at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), kl_sink_grad};
  }
};

bool any_requires_grad(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* tensor : tensors) {
    if (tensor->defined() && tensor->requires_grad()) return true;
  }
  return false;
}

// The Autograd kernel: record MSAForward only when a gradient can flow.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_proxy,
    const at::Tensor& k_proxy, const std::optional<at::Tensor>& block_idx, int64_t top_k,
    c10::string_view mode, double softmax_scale, double proxy_scale, bool deterministic,
    const std::optional<at::Tensor>& kl_sink) {
  const at::Tensor no_tensor;
  const at::Tensor& sink = kl_sink.has_value() ? *kl_sink : no_tensor;
  if (!at::GradMode::is_enabled() || !any_requires_grad({&q, &k, &v, &q_proxy, &k_proxy, &sink})) {
    return forward_below_autograd(q, k, v, q_proxy, k_proxy, block_idx, top_k, mode, softmax_scale,
                                  proxy_scale, deterministic, kl_sink);
  }
  const torch::autograd::variable_list outputs =
      MSAForward::apply(q, k, v, q_proxy, k_proxy, block_idx, top_k, mode, softmax_scale,
                        proxy_scale, deterministic, kl_sink);
  return {outputs[0], outputs[1], outputs[2], outputs[3]};
}

}  // namespace

// The backward op has no derivative of its own: a gradient of a gradient (create_graph=True, then
// backward again) raises "derivative for flashmsa::backward is not implemented" instead of
// silently returning zeros.
TORCH_LIBRARY_IMPL(flashmsa, Autograd, m) {
  m.impl("forward", &forward_autograd);
  m.impl("backward", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace flashmsa::torch_binding
