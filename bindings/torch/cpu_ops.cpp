// CPU implementations of the flashmsa ops: the fp64 reference of src/reference (SPEC.md §1-§5),
// whatever the input dtype. Slow and exact; for debugging and for the tests that need no GPU.
//
// Comes after library.cpp (schemas) and tensor_args.cpp (checks); cuda_ops.cpp is its CUDA twin.
// Inputs are copied into contiguous fp64 vectors, outputs are rounded once to their dtype.
#include <torch/library.h>

#include <cstring>
#include <stdexcept>

#include "reference/reference.h"
#include "tensor_args.h"

namespace flashmsa::torch_binding {

namespace {

constexpr reference::Precision kPrecision = reference::Precision::kFP64;

std::vector<double> to_doubles(const at::Tensor& tensor) {
  const at::Tensor wide = tensor.to(at::kDouble).contiguous();
  const double* data = wide.data_ptr<double>();
  return std::vector<double>(data, data + wide.numel());
}

at::Tensor from_doubles(const std::vector<double>& values, at::IntArrayRef sizes,
                        at::ScalarType dtype) {
  at::Tensor wide = at::empty(sizes, at::kDouble);
  std::memcpy(wide.data_ptr<double>(), values.data(), values.size() * sizeof(double));
  return wide.to(dtype);
}

void copy_doubles(const std::vector<double>& values, at::Tensor& destination) {
  destination.copy_(from_doubles(values, destination.sizes(), destination.scalar_type()));
}

std::vector<int32_t> block_idx_values(const ForwardParams& params) {
  if (params.mode != Mode::kSparse) return {};
  const int64_t count =
      params.shape.batch * params.shape.num_proxy_heads * params.shape.seqlen * params.shape.top_k;
  return std::vector<int32_t>(params.block_idx, params.block_idx + count);
}

reference::Inputs reference_inputs(const ForwardParams& params, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& q_proxy, const at::Tensor& k_proxy) {
  reference::Inputs in;
  in.shape = params.shape;
  in.softmax_scale = params.softmax_scale;
  in.proxy_scale = params.proxy_scale;
  in.q = to_doubles(q);
  in.k = to_doubles(k);
  in.v = to_doubles(v);
  in.q_proxy = to_doubles(q_proxy);
  in.k_proxy = to_doubles(k_proxy);
  return in;
}

// The reference re-checks what it reads (e.g. block_idx entries in [-1, NB)); its complaints are
// about the caller's values, hence ValueError.
template <typename Body>
auto run_reference(Op op, Body body) {
  try {
    return body();
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, op_name(op), ": ", error.what());
  }
}

at::Tensor select_cpu(const at::Tensor& q_proxy, const at::Tensor& k_proxy, int64_t top_k,
                      double proxy_scale) {
  const Op op = Op::kSelect;
  SelectParams params;
  params.shape = select_shape(q_proxy, k_proxy, top_k);
  params.dtype = dtype_of(q_proxy);
  params.proxy_scale = scale_argument(proxy_scale, "proxy_scale", op);
  params.q_proxy = tensor_ref(q_proxy);
  params.k_proxy = tensor_ref(k_proxy);
  const ProblemShape& shape = params.shape;
  at::Tensor block_idx = at::empty({shape.batch, shape.num_proxy_heads, shape.seqlen, shape.top_k},
                                   q_proxy.options().dtype(at::kInt));
  params.block_idx = block_idx.data_ptr<int32_t>();
  check_status(validate(params), op, Check::kCallerInput);

  // Selection reads only the proxies; the main-branch tensors of the reference inputs are sized
  // with head_dim 1 and stay zero.
  reference::Inputs in;
  in.shape = shape;
  in.shape.head_dim = 1;
  in.proxy_scale = params.proxy_scale;
  in.q.assign(shape.batch * shape.seqlen * shape.num_heads, 0.0);
  in.k.assign(shape.batch * shape.seqlen * shape.num_kv_heads, 0.0);
  in.v = in.k;
  in.q_proxy = to_doubles(q_proxy);
  in.k_proxy = to_doubles(k_proxy);
  const std::vector<int32_t> values =
      run_reference(op, [&] { return reference::select(in, kPrecision); });
  std::memcpy(block_idx.data_ptr<int32_t>(), values.data(), values.size() * sizeof(int32_t));
  return block_idx;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_proxy,
    const at::Tensor& k_proxy, const std::optional<at::Tensor>& block_idx, int64_t top_k,
    c10::string_view mode, double softmax_scale, double proxy_scale, bool deterministic,
    const std::optional<at::Tensor>& kl_sink) {
  (void)deterministic;  // for the backward; the forward is deterministic
  const Op op = Op::kForward;
  ForwardParams params = forward_inputs(q, k, v, q_proxy, k_proxy, block_idx, top_k,
                                        std::string(mode), softmax_scale, proxy_scale, op);
  if (kl_sink.has_value()) check_scalar(*kl_sink, "kl_sink", q, op);
  ForwardOutputs outputs = allocate_forward_outputs(params, q);
  check_status(validate(params), op, Check::kCallerInput);

  const reference::Inputs in = reference_inputs(params, q, k, v, q_proxy, k_proxy);
  const reference::ForwardOutputs result = run_reference(op, [&] {
    return reference::forward(in, block_idx_values(params), params.mode, kPrecision);
  });
  copy_doubles(result.out, outputs.out);
  copy_doubles(result.lse, outputs.lse);
  copy_doubles(result.proxy_lse, outputs.proxy_lse);
  return {outputs.out, outputs.lse, outputs.proxy_lse,
          at::zeros({}, q.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& dout, const std::optional<at::Tensor>& kl_grad, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_proxy, const at::Tensor& k_proxy,
    const std::optional<at::Tensor>& block_idx, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& proxy_lse, int64_t top_k, c10::string_view mode, double softmax_scale,
    double proxy_scale, bool deterministic) {
  (void)deterministic;  // the reference is deterministic
  const Op op = Op::kBackward;
  BackwardParams backward_params;
  backward_params.fwd = forward_inputs(q, k, v, q_proxy, k_proxy, block_idx, top_k,
                                       std::string(mode), softmax_scale, proxy_scale, op);
  const ForwardParams& params = backward_params.fwd;
  check_saved_outputs(out, lse, proxy_lse, q, params.shape);
  const at::Tensor dout_view = kernel_layout(dout, "dout", q, op);
  if (kl_grad.has_value()) check_scalar(*kl_grad, "kl_grad", q, op);
  InputGradients grads = allocate_backward_arguments(
      backward_params, q, k, v, q_proxy, k_proxy, out, lse, proxy_lse, dout_view, kl_grad);
  check_status(validate(backward_params), op, Check::kCallerInput);

  const reference::Inputs in = reference_inputs(params, q, k, v, q_proxy, k_proxy);
  const std::vector<int32_t> blocks = block_idx_values(params);
  const double kl_gradient = kl_grad.has_value() ? kl_grad->item<double>() : 0.0;
  const reference::Gradients gradients = run_reference(op, [&] {
    return reference::backward(in, blocks, to_doubles(dout_view), kl_gradient, params.mode,
                               kPrecision);
  });
  const double kl =
      run_reference(op, [&] { return reference::forward(in, blocks, params.mode, kPrecision).kl; });
  copy_doubles(gradients.dq, grads.dq);
  copy_doubles(gradients.dk, grads.dk);
  copy_doubles(gradients.dv, grads.dv);
  copy_doubles(gradients.dq_proxy, grads.dq_proxy);
  copy_doubles(gradients.dk_proxy, grads.dk_proxy);
  return {grads.dq, grads.dk, grads.dv, grads.dq_proxy, grads.dk_proxy,
          at::full({}, kl, q.options().dtype(at::kFloat))};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashmsa, CPU, m) {
  m.impl("select", &select_cpu);
  m.impl("forward", &forward_cpu);
  m.impl("backward", &backward_cpu);
}

}  // namespace flashmsa::torch_binding
