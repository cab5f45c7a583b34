// The `flashmsa` torch library: op schemas (this file), CPU implementations on the reference
// (cpu_ops.cpp), CUDA implementations on the C++ API (cuda_ops.cpp), the autograd formula of
// forward (autograd.cpp). Fake (meta) implementations are registered from Python
// (python/flashmsa/_ops.py), once.
//
// This library links libtorch only, never the Python C API, so the same libflashmsa_torch.so loads
// into any Python with torch.ops.load_library and into C++ programs (include/flashmsa/torch.h,
// whose functions are defined here and call the ops through the dispatcher).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "flashmsa/torch.h"

TORCH_LIBRARY(flashmsa, m) {
  m.def("select(Tensor q_proxy, Tensor k_proxy, int top_k, float proxy_scale=0.) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor q_proxy, Tensor k_proxy, Tensor? block_idx, "
      "int top_k, str attention_mode=\"sparse\", float softmax_scale=0., float proxy_scale=0., "
      "bool deterministic=False, Tensor? kl_sink=None) "
      "-> (Tensor out, Tensor lse, Tensor proxy_lse, Tensor kl)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "backward(Tensor dout, Tensor? kl_grad, Tensor q, Tensor k, Tensor v, Tensor q_proxy, "
      "Tensor k_proxy, Tensor? block_idx, Tensor out, Tensor lse, Tensor proxy_lse, int top_k, "
      "str attention_mode=\"sparse\", float softmax_scale=0., float proxy_scale=0., "
      "bool deterministic=False) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dq_proxy, Tensor dk_proxy, Tensor kl_value)",
      {at::Tag::pt2_compliant_tag});
}

namespace flashmsa::torch_ops {

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

at::Tensor select(const at::Tensor& q_proxy, const at::Tensor& k_proxy, int64_t top_k,
                  double proxy_scale) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, double)>(
      "flashmsa::select");
  return op.call(q_proxy, k_proxy, top_k, proxy_scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_proxy,
    const at::Tensor& k_proxy, const std::optional<at::Tensor>& block_idx, int64_t top_k,
    const std::string& mode, double softmax_scale, double proxy_scale, bool deterministic,
    const std::optional<at::Tensor>& kl_sink) {
  static const auto op = find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const std::optional<at::Tensor>&, int64_t, c10::string_view, double, double, bool,
      const std::optional<at::Tensor>&)>("flashmsa::forward");
  return op.call(q, k, v, q_proxy, k_proxy, block_idx, top_k, mode, softmax_scale, proxy_scale,
                 deterministic, kl_sink);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout, const std::optional<at::Tensor>& kl_grad, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_proxy, const at::Tensor& k_proxy,
    const std::optional<at::Tensor>& block_idx, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& proxy_lse, int64_t top_k, const std::string& mode, double softmax_scale,
    double proxy_scale, bool deterministic) {
  static const auto op =
      find_op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
          const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
          const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
          const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, c10::string_view,
          double, double, bool)>("flashmsa::backward");
  return op.call(dout, kl_grad, q, k, v, q_proxy, k_proxy, block_idx, out, lse, proxy_lse, top_k,
                 mode, softmax_scale, proxy_scale, deterministic);
}

}  // namespace flashmsa::torch_ops
