// Argument checks and conversions shared by the CPU and CUDA implementations of the flashmsa torch
// ops (cpu_ops.cpp, cuda_ops.cpp). The op schemas live in library.cpp.
//
// Order of checks for every op: first what only torch knows (4-D, dtype, device, a contiguous last
// dim, sizes that must agree between tensors), with messages naming the torch argument; then the
// ProblemShape and the TensorRefs go through flashmsa::validate (src/api/validate.cpp, the same
// rules the C++ API applies), whose "<field>: <rule>" messages are translated back to torch names
// (`shape.top_k` -> `top_k`, `q.seq_stride` -> `q.stride(1)`). Errors raise ValueError (a violated
// rule), NotImplementedError (valid, but no kernel in this build) or RuntimeError (device/CUDA).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "flashmsa/api.h"

namespace flashmsa::torch_binding {

// Which op is checking: selects the error prefix and how shape fields are named.
enum class Op { kSelect, kForward, kBackward };

const char* op_name(Op op);  // "flashmsa.select", ...

// "sparse" -> Mode::kSparse, "warmup" -> Mode::kWarmup; anything else raises ValueError.
Mode parse_mode(const std::string& mode, Op op);

// The dtypes an op accepts on this device: bf16/fp16 everywhere, plus fp32/fp64 on the CPU
// (the reference computes in fp64 whatever the input; wider inputs make CPU tests exact).
void check_dtype(const at::Tensor& tensor, const char* name, Op op);

// A [batch, seqlen, heads, dim] activation on `like`'s device with `like`'s dtype and a contiguous
// last dim. `like` is itself checked when `name == like_name`.
void check_activation(const at::Tensor& tensor, const char* name, const at::Tensor& like,
                      const char* like_name, Op op);

// Sizes of the five attention inputs (q, k, v, q_proxy, k_proxy) checked against each other; the
// returned shape has top_k = `top_k` and is not yet validated against SPEC.md's rules.
ProblemShape attention_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& q_proxy, const at::Tensor& k_proxy, int64_t top_k,
                             Op op);

// The shape select() works on: H = Hp, Hkv = 1, D = Di (select reads only the proxy heads).
ProblemShape select_shape(const at::Tensor& q_proxy, const at::Tensor& k_proxy, int64_t top_k);

// block_idx [B, Hp, S, K] int32 contiguous on the device of `like`.
void check_block_idx(const at::Tensor& block_idx, const ProblemShape& shape, const at::Tensor& like,
                     Op op);

// An fp32 tensor of exactly `sizes`, contiguous, on the device of `like` (lse, proxy_lse,
// kl_value).
void check_float_array(const at::Tensor& tensor, const char* name, at::IntArrayRef sizes,
                       const at::Tensor& like, Op op);

// softmax_scale / proxy_scale as the kernels' fp32; raises ValueError for a finite nonzero value that
// fp32 cannot hold as a normal number (it would silently become 0, i.e. the default, or inf).
float scale_argument(double value, const char* name, Op op);

DType dtype_of(const at::Tensor& tensor);  // bf16 / fp16 (fp32 and fp64 CPU inputs report bf16)

// A TensorRef of a checked activation. Strides of extent-1 dims never address memory; they are
// replaced by the span of the dims inside them so that validation judges only real steps.
TensorRef tensor_ref(const at::Tensor& tensor);

// A gradient handed in by autograd (dout), checked like q (4-D, q's shape, dtype and device), in a
// layout the kernels read: `tensor` itself when its strides meet the rules (last dim contiguous,
// other strides positive multiples of 8 elements, 16-byte aligned), else a contiguous copy (e.g.
// the stride-0 gradient of a sum). Never used for the inputs of the forward.
at::Tensor kernel_layout(const at::Tensor& tensor, const char* name, const at::Tensor& q, Op op);

// How much of a Status counts. kCallerInput: only the rules about the caller's arguments. The
// device-only buffers (schedule, workspaces) are still null when the caller's input is checked, and
// kUnsupported is left to the kernels' own call. kFull: everything (a call of the C++ API).
// NOTES: validate() checks in a fixed order (src/api/validate.cpp: shape, scales, the caller's
// tensors, block_idx, then the device buffers), so a complaint about a still-null device buffer
// means every rule about the caller's input held. The CPU reference needs nothing more (it runs at
// any head dim); the CUDA path checks this way before it sizes and allocates the buffers.
enum class Check { kCallerInput, kFull };

// Raises for a non-ok Status, with the flashmsa field names translated to torch argument names.
void check_status(const Status& status, Op op, Check check);

// Checks the five attention inputs (and block_idx in sparse mode) and fills every input field of
// a ForwardParams; outputs, schedule, kl and workspace stay null.
ForwardParams forward_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& q_proxy, const at::Tensor& k_proxy,
                             const std::optional<at::Tensor>& block_idx, int64_t top_k,
                             const std::string& mode, double softmax_scale, double proxy_scale,
                             Op op);

// Checks the forward's saved outputs handed to the backward (out, lse, proxy_lse).
void check_saved_outputs(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& proxy_lse,
                         const at::Tensor& q, const ProblemShape& shape);

// An fp32 scalar (one element, contiguous) on the device of q: kl_grad and kl_value.
void check_scalar(const at::Tensor& tensor, const char* name, const at::Tensor& q, Op op);

// The forward's outputs (out like q; lse, proxy_lse fp32), allocated and set in `params`; out and
// lse only when params.main_branch (otherwise another kernel makes them).
struct ForwardOutputs {
  at::Tensor out, lse, proxy_lse;
};
ForwardOutputs allocate_forward_outputs(ForwardParams& params, const at::Tensor& q);

// The backward's gradients (each with its input's size and, for dense inputs, strides), allocated
// and set in `params` together with the saved outputs, dout and kl_grad; dq, dk, dv only when
// params.fwd.main_branch. `params.fwd` comes from forward_inputs; the inputs are the five attention
// tensors in the order q, k, v, q_proxy, k_proxy.
struct InputGradients {
  at::Tensor dq, dk, dv, dq_proxy, dk_proxy;
};
InputGradients allocate_backward_arguments(BackwardParams& params, const at::Tensor& q,
                                           const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& q_proxy, const at::Tensor& k_proxy,
                                           const at::Tensor& out, const at::Tensor& lse,
                                           const at::Tensor& proxy_lse, const at::Tensor& dout_view,
                                           const std::optional<at::Tensor>& kl_grad);

}  // namespace flashmsa::torch_binding
