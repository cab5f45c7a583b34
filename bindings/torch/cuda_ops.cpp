// CUDA implementations of the flashmsa ops: the C++ API of include/flashmsa/api.h on the current
// torch CUDA stream. Workspaces come from torch's caching allocator, sized by the API's queries;
// nothing here synchronises the host, so every op is CUDA-graph capturable.
//
// Comes after library.cpp (schemas) and tensor_args.cpp (checks); cpu_ops.cpp is its CPU twin.
// Per op: check the caller's input (Check::kCallerInput), size and allocate the device buffers
// (outputs, then one buffer for the schedule and the workspace), then call the API, which
// validates everything once more and launches.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "tensor_args.h"
#include "warmup_cudnn.h"

namespace flashmsa::torch_binding {

namespace {

at::Tensor device_buffer(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

void* pointer_or_null(const at::Tensor& buffer) {
  return buffer.numel() > 0 ? buffer.data_ptr() : nullptr;
}

cudaStream_t current_stream(const at::Tensor& like) {
  return c10::cuda::getCurrentCUDAStream(like.device().index()).stream();
}

// The reverse index of block_idx (sparse mode), built in `workspace` (schedule_workspace_size()
// bytes). The backward builds its own from block_idx;
// NOTES: the forward's schedule is rebuilt here rather than saved from the forward, so that no
// opaque byte buffer crosses the op boundary (fake tensors, opcheck and torch.compile see plain
// outputs). It costs one schedule launch per backward (docs/design.md §3: < 0.1 ms at 128K).
void build_schedule(const ProblemShape& shape, const int32_t* block_idx, void* workspace,
                    cudaStream_t stream, Op op) {
  ScheduleParams params;
  params.shape = shape;
  params.block_idx = block_idx;
  params.workspace = workspace;
  check_status(flashmsa::schedule(params, stream), op, Check::kFull);
}

size_t align_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// A 0-valued fp32 scalar on the device of `like`, zeroed on `stream`.
// NOTES: one cudaMemsetAsync rather than at::zeros, whose fill kernel goes through TensorIterator
// and costs several µs more host time per call.
at::Tensor zero_scalar(const at::Tensor& like, cudaStream_t stream, Op op) {
  at::Tensor scalar = at::empty({}, like.options().dtype(at::kFloat));
  const cudaError_t error = cudaMemsetAsync(scalar.data_ptr(), 0, sizeof(float), stream);
  TORCH_CHECK(error == cudaSuccess, op_name(op), ": cudaMemsetAsync: ", cudaGetErrorString(error));
  return scalar;
}

at::Tensor select_cuda(const at::Tensor& q_proxy, const at::Tensor& k_proxy, int64_t top_k,
                       double proxy_scale) {
  SelectParams params;
  params.shape = select_shape(q_proxy, k_proxy, top_k);
  params.dtype = dtype_of(q_proxy);
  params.proxy_scale = scale_argument(proxy_scale, "proxy_scale", Op::kSelect);
  params.q_proxy = tensor_ref(q_proxy);
  params.k_proxy = tensor_ref(k_proxy);
  const ProblemShape& shape = params.shape;
  const c10::cuda::CUDAGuard guard(q_proxy.device());
  at::Tensor block_idx = at::empty({shape.batch, shape.num_proxy_heads, shape.seqlen, shape.top_k},
                                   q_proxy.options().dtype(at::kInt));
  params.block_idx = block_idx.data_ptr<int32_t>();
  check_status(flashmsa::select(params, current_stream(q_proxy)), Op::kSelect, Check::kFull);
  return block_idx;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_proxy,
    const at::Tensor& k_proxy, const std::optional<at::Tensor>& block_idx, int64_t top_k,
    c10::string_view mode, double softmax_scale, double proxy_scale, bool deterministic,
    const std::optional<at::Tensor>& kl_sink) {
  const Op op = Op::kForward;
  ForwardParams params = forward_inputs(q, k, v, q_proxy, k_proxy, block_idx, top_k,
                                        std::string(mode), softmax_scale, proxy_scale, op);
  if (kl_sink.has_value()) check_scalar(*kl_sink, "kl_sink", q, op);
  const ProblemShape& shape = params.shape;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = current_stream(q);
  // Warmup: O and LSE from cuDNN where it serves, flashmsa then adds the proxy LSE (warmup_cudnn.cpp).
  std::optional<CudnnForward> main;
  if (params.mode == Mode::kWarmup && warmup_main_on_cudnn(shape, deterministic)) {
    main = cudnn_dense_forward(q, k, v, shape, effective_scale(params.softmax_scale, shape.head_dim));
  }
  params.main_branch = !main.has_value();
  const ForwardOutputs outputs = allocate_forward_outputs(params, q);
  check_status(validate(params), op, Check::kCallerInput);

  // One device buffer for the schedule and the forward's workspace, in that order.
  const size_t schedule_bytes =
      params.mode == Mode::kSparse ? align_256(schedule_workspace_size(shape)) : 0;
  const at::Tensor buffers =
      device_buffer(schedule_bytes + forward_workspace_size(shape, params.mode), q);
  char* base = static_cast<char*>(pointer_or_null(buffers));
  if (params.mode == Mode::kSparse) {
    build_schedule(shape, params.block_idx, base, stream, op);
    params.schedule = base;
  }
  params.workspace = buffers.numel() > int64_t(schedule_bytes) ? base + schedule_bytes : nullptr;
  check_status(flashmsa::forward(params, stream), op, Check::kFull);
  if (main) return {main->out, main->lse, outputs.proxy_lse, zero_scalar(q, stream, op)};
  return {outputs.out, outputs.lse, outputs.proxy_lse, zero_scalar(q, stream, op)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& dout, const std::optional<at::Tensor>& kl_grad, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_proxy, const at::Tensor& k_proxy,
    const std::optional<at::Tensor>& block_idx, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& proxy_lse, int64_t top_k, c10::string_view mode, double softmax_scale,
    double proxy_scale, bool deterministic) {
  const Op op = Op::kBackward;
  BackwardParams params;
  params.fwd = forward_inputs(q, k, v, q_proxy, k_proxy, block_idx, top_k, std::string(mode),
                              softmax_scale, proxy_scale, op);
  const ProblemShape& shape = params.fwd.shape;
  check_saved_outputs(out, lse, proxy_lse, q, shape);
  const at::Tensor dout_view = kernel_layout(dout, "dout", q, op);
  if (kl_grad.has_value()) check_scalar(*kl_grad, "kl_grad", q, op);

  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = current_stream(q);
  // Warmup: dq, dk, dv from cuDNN where it serves, flashmsa then runs its KL-only backward.
  std::optional<CudnnGradients> main;
  if (params.fwd.mode == Mode::kWarmup && warmup_main_on_cudnn(shape, deterministic)) {
    main = cudnn_dense_backward(dout_view, q, k, v, out, lse, shape,
                                effective_scale(params.fwd.softmax_scale, shape.head_dim));
  }
  params.fwd.main_branch = !main.has_value();
  const InputGradients grads = allocate_backward_arguments(
      params, q, k, v, q_proxy, k_proxy, out, lse, proxy_lse, dout_view, kl_grad);
  // Written by the backward's last kernel (SPEC.md §3); no fill needed.
  at::Tensor kl_value = at::empty({}, q.options().dtype(at::kFloat));
  params.fwd.kl = kl_value.data_ptr<float>();
  params.deterministic = deterministic;
  check_status(validate(params), op, Check::kCallerInput);

  // One device buffer for the schedule and the backward's workspace, in that order.
  const size_t schedule_bytes =
      params.fwd.mode == Mode::kSparse ? align_256(schedule_workspace_size(shape)) : 0;
  const at::Tensor buffers = device_buffer(
      schedule_bytes + backward_workspace_size(shape, params.fwd.mode, deterministic, params.fwd.dtype), q);
  char* base = static_cast<char*>(pointer_or_null(buffers));
  if (params.fwd.mode == Mode::kSparse) {
    build_schedule(shape, params.fwd.block_idx, base, stream, op);
    params.fwd.schedule = base;
  }
  params.workspace = buffers.numel() > int64_t(schedule_bytes) ? base + schedule_bytes : nullptr;
  check_status(flashmsa::backward(params, stream), op, Check::kFull);
  if (main) return {main->dq, main->dk, main->dv, grads.dq_proxy, grads.dk_proxy, kl_value};
  return {grads.dq, grads.dk, grads.dv, grads.dq_proxy, grads.dk_proxy, kl_value};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashmsa, CUDA, m) {
  m.impl("select", &select_cuda);
  m.impl("forward", &forward_cuda);
  m.impl("backward", &backward_cuda);
}

}  // namespace flashmsa::torch_binding
