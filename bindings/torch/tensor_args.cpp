// Argument checks and conversions of tensor_args.h: torch-level checks with torch argument names,
// then the translation of flashmsa::validate's field names into torch ones.
#include "tensor_args.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <utility>

namespace flashmsa::torch_binding {

namespace {

std::string sizes_text(const at::Tensor& tensor) {
  std::ostringstream text;
  text << tensor.sizes();
  return text.str();
}

bool is_cpu(const at::Tensor& tensor) { return tensor.device().is_cpu(); }

// A dtype as Python users write it ("torch.float32"), not as c10 prints it ("Float").
std::string dtype_text(at::ScalarType dtype) { return "torch." + c10::getDtypeNames(dtype).first; }

// Field names of flashmsa's ProblemShape, as validate() reports them, and the torch argument each
// one comes from in the attention ops and in select (where H = Hp, Hkv = Hpk, D = Di).
struct ShapeField {
  const char* field;
  const char* attention_name;
  const char* select_name;
};

constexpr std::array<ShapeField, 9> kShapeFields = {{
    {"shape.batch", "q.size(0) (batch)", "q_proxy.size(0) (batch)"},
    {"shape.seqlen", "q.size(1) (seqlen)", "q_proxy.size(1) (seqlen)"},
    {"shape.num_heads", "q.size(2) (num_heads)", "q_proxy.size(2) (num_proxy_heads)"},
    {"shape.num_kv_heads", "k.size(2) (num_kv_heads)", "k_proxy.size(2) (num_proxy_kv_heads)"},
    {"shape.num_proxy_heads", "q_proxy.size(2) (num_proxy_heads)",
     "q_proxy.size(2) (num_proxy_heads)"},
    {"shape.num_proxy_kv_heads", "k_proxy.size(2) (num_proxy_kv_heads)",
     "k_proxy.size(2) (num_proxy_kv_heads)"},
    {"shape.head_dim", "q.size(3) (head_dim)", "q_proxy.size(3) (proxy_head_dim)"},
    {"shape.proxy_head_dim", "q_proxy.size(3) (proxy_head_dim)",
     "q_proxy.size(3) (proxy_head_dim)"},
    {"shape.top_k", "top_k (blocks)", "top_k (blocks)"},
}};

constexpr std::array<std::pair<const char*, const char*>, 4> kTensorFields = {{
    {".batch_stride", ".stride(0)"},
    {".seq_stride", ".stride(1)"},
    {".head_stride", ".stride(2)"},
    {".ptr", ".data_ptr()"},
}};

// Appended where token counts disagree: the usual cause is a head-major tensor passed as it is.
constexpr const char* kLayoutHint =
    " (tensors are [batch, seqlen, heads, dim]; pass a [batch, heads, seqlen, dim] one as "
    ".transpose(1, 2))";

// Checked before any output is sized from it (select's block_idx, the forward's block_idx shape).
void check_top_k(int64_t top_k, Op op) {
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= kMaxTopK, op_name(op),
                    ": top_k (blocks): must be in [1, ", kMaxTopK, "], got ", top_k);
}

// Row strides are multiples of 8 elements (validate's rule for every layout), so a tensor whose
// heads are packed needs a head dim that is a multiple of 8; said in terms of the head dim, which
// is what the caller chose, rather than as a stride complaint.
void check_head_dim(const at::Tensor& tensor, const char* name, const char* dim_name, Op op) {
  TORCH_CHECK_VALUE(tensor.size(3) % 8 == 0, op_name(op), ": ", name, ".size(3) (", dim_name,
                    "): must be a multiple of 8 (row strides are multiples of 8 elements), got ",
                    tensor.size(3));
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// "fwd.q.seq_stride" -> "q.stride(1)", "shape.top_k" -> "top_k (blocks)".
std::string torch_argument(std::string field, Op op) {
  if (field.rfind("fwd.", 0) == 0) field = field.substr(4);
  for (const ShapeField& shape_field : kShapeFields) {
    if (field == shape_field.field) {
      return op == Op::kSelect ? shape_field.select_name : shape_field.attention_name;
    }
  }
  for (const auto& [suffix, replacement] : kTensorFields) {
    if (ends_with(field, suffix))
      return field.substr(0, field.size() - std::string(suffix).size()) + replacement;
  }
  return field;
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kSelect:
      return "flashmsa.select";
    case Op::kForward:
      return "flashmsa.forward";
    case Op::kBackward:
      return "flashmsa.backward";
  }
  return "flashmsa";
}

Mode parse_mode(const std::string& mode, Op op) {
  if (mode == "sparse") return Mode::kSparse;
  if (mode == "warmup") return Mode::kWarmup;
  TORCH_CHECK_VALUE(false, op_name(op), ": mode: must be \"sparse\" or \"warmup\", got \"", mode,
                    "\"");
}

void check_dtype(const at::Tensor& tensor, const char* name, Op op) {
  const at::ScalarType dtype = tensor.scalar_type();
  const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
  const bool wide = dtype == at::kFloat || dtype == at::kDouble;
  TORCH_CHECK_VALUE(half || (wide && is_cpu(tensor)), op_name(op), ": ", name,
                    ": dtype must be torch.bfloat16 or torch.float16 (CPU also accepts "
                    "torch.float32 and torch.float64), got ",
                    dtype_text(dtype), " on ", tensor.device());
}

void check_activation(const at::Tensor& tensor, const char* name, const at::Tensor& like,
                      const char* like_name, Op op) {
  TORCH_CHECK_VALUE(tensor.defined(), op_name(op), ": ", name, ": must be a tensor, got None");
  TORCH_CHECK_VALUE(tensor.dim() == 4, op_name(op), ": ", name,
                    ": must be 4-D [batch, seqlen, heads, dim], got shape ", sizes_text(tensor));
  const bool is_like = std::string(name) == like_name;
  if (is_like) {
    TORCH_CHECK_VALUE(is_cpu(tensor) || tensor.is_cuda(), op_name(op), ": ", name,
                      ": must be a CPU or CUDA tensor, got device ", tensor.device());
    check_dtype(tensor, name, op);
  } else {
    TORCH_CHECK_VALUE(tensor.device() == like.device(), op_name(op), ": ", name,
                      ": must be on the device of ", like_name, " (", like.device(), "), got ",
                      tensor.device());
    TORCH_CHECK_VALUE(tensor.scalar_type() == like.scalar_type(), op_name(op), ": ", name,
                      ": dtype must match ", like_name, " (", dtype_text(like.scalar_type()),
                      "), got ", dtype_text(tensor.scalar_type()));
  }
  TORCH_CHECK_VALUE(tensor.stride(3) == 1 || tensor.size(3) == 1, op_name(op), ": ", name,
                    ": the last dim must be contiguous (stride 1), got strides ", tensor.strides());
}

ProblemShape attention_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& q_proxy, const at::Tensor& k_proxy, int64_t top_k,
                             Op op) {
  check_activation(q, "q", q, "q", op);
  check_activation(k, "k", q, "q", op);
  check_activation(v, "v", q, "q", op);
  check_activation(q_proxy, "q_proxy", q, "q", op);
  check_activation(k_proxy, "k_proxy", q, "q", op);

  const auto same_tokens = [&](const at::Tensor& tensor, const char* name) {
    TORCH_CHECK_VALUE(tensor.size(0) == q.size(0) && tensor.size(1) == q.size(1), op_name(op), ": ",
                      name, ": [batch, seqlen] must match q's [", q.size(0), ", ", q.size(1),
                      "], got shape ", sizes_text(tensor), kLayoutHint);
  };
  same_tokens(k, "k");
  same_tokens(v, "v");
  same_tokens(q_proxy, "q_proxy");
  same_tokens(k_proxy, "k_proxy");
  TORCH_CHECK_VALUE(k.size(3) == q.size(3), op_name(op), ": k: head dim must match q's (",
                    q.size(3), "), got ", k.size(3));
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), op_name(op), ": v: shape must match k's ",
                    sizes_text(k), ", got ", sizes_text(v));
  TORCH_CHECK_VALUE(k_proxy.size(3) == q_proxy.size(3), op_name(op),
                    ": k_proxy: head dim must match q_proxy's (", q_proxy.size(3), "), got ",
                    k_proxy.size(3));
  check_head_dim(q, "q", "head_dim", op);
  check_head_dim(q_proxy, "q_proxy", "proxy_head_dim", op);
  const auto narrow = [&](int64_t value, const char* name) {
    TORCH_CHECK_VALUE(value <= INT32_MAX, op_name(op), ": ", name, ": must be < 2^31, got ", value);
    return static_cast<int>(value);
  };

  ProblemShape shape;
  shape.batch = q.size(0);
  shape.seqlen = q.size(1);
  shape.num_heads = narrow(q.size(2), "q.size(2)");
  shape.num_kv_heads = narrow(k.size(2), "k.size(2)");
  shape.num_proxy_heads = narrow(q_proxy.size(2), "q_proxy.size(2)");
  shape.num_proxy_kv_heads = narrow(k_proxy.size(2), "k_proxy.size(2)");
  shape.head_dim = narrow(q.size(3), "q.size(3)");
  shape.proxy_head_dim = narrow(q_proxy.size(3), "q_proxy.size(3)");
  check_top_k(top_k, op);
  shape.top_k = static_cast<int>(top_k);
  return shape;
}

ProblemShape select_shape(const at::Tensor& q_proxy, const at::Tensor& k_proxy, int64_t top_k) {
  const Op op = Op::kSelect;
  check_activation(q_proxy, "q_proxy", q_proxy, "q_proxy", op);
  check_activation(k_proxy, "k_proxy", q_proxy, "q_proxy", op);
  TORCH_CHECK_VALUE(k_proxy.size(0) == q_proxy.size(0) && k_proxy.size(1) == q_proxy.size(1),
                    op_name(op), ": k_proxy: [batch, seqlen] must match q_proxy's [",
                    q_proxy.size(0), ", ", q_proxy.size(1), "], got shape ", sizes_text(k_proxy),
                    kLayoutHint);
  TORCH_CHECK_VALUE(k_proxy.size(3) == q_proxy.size(3), op_name(op),
                    ": k_proxy: head dim must match q_proxy's (", q_proxy.size(3), "), got ",
                    k_proxy.size(3));
  check_head_dim(q_proxy, "q_proxy", "proxy_head_dim", op);
  TORCH_CHECK_VALUE(
      q_proxy.size(2) <= INT32_MAX && k_proxy.size(2) <= INT32_MAX && q_proxy.size(3) <= INT32_MAX,
      op_name(op), ": q_proxy, k_proxy: head counts and dims must be < 2^31");
  check_top_k(top_k, op);
  ProblemShape shape;
  shape.batch = q_proxy.size(0);
  shape.seqlen = q_proxy.size(1);
  // Select reads only the proxy heads; one main head per proxy head and one KV group make every
  // main-head rule hold, so validate words a violated head rule as the proxies' (Hp % Hpk).
  shape.num_heads = static_cast<int>(q_proxy.size(2));
  shape.num_kv_heads = 1;
  shape.num_proxy_heads = static_cast<int>(q_proxy.size(2));
  shape.num_proxy_kv_heads = static_cast<int>(k_proxy.size(2));
  shape.head_dim = static_cast<int>(q_proxy.size(3));
  shape.proxy_head_dim = static_cast<int>(q_proxy.size(3));
  shape.top_k = static_cast<int>(top_k);
  return shape;
}

void check_block_idx(const at::Tensor& block_idx, const ProblemShape& shape, const at::Tensor& like,
                     Op op) {
  TORCH_CHECK_VALUE(block_idx.defined(), op_name(op),
                    ": block_idx: required in sparse mode, got None");
  TORCH_CHECK_VALUE(block_idx.device() == like.device(), op_name(op),
                    ": block_idx: must be on the device of q (", like.device(), "), got ",
                    block_idx.device());
  TORCH_CHECK_VALUE(block_idx.scalar_type() == at::kInt, op_name(op),
                    ": block_idx: dtype must be torch.int32, got ", dtype_text(block_idx.scalar_type()));
  const std::array<int64_t, 4> expected = {shape.batch, shape.num_proxy_heads, shape.seqlen,
                                           shape.top_k};
  TORCH_CHECK_VALUE(block_idx.sizes() == at::IntArrayRef(expected), op_name(op),
                    ": block_idx: shape must be [batch, num_proxy_heads, seqlen, top_k] = ",
                    at::IntArrayRef(expected), ", got ", sizes_text(block_idx));
  TORCH_CHECK_VALUE(block_idx.is_contiguous(), op_name(op),
                    ": block_idx: must be contiguous, got strides ", block_idx.strides());
}

void check_float_array(const at::Tensor& tensor, const char* name, at::IntArrayRef sizes,
                       const at::Tensor& like, Op op) {
  TORCH_CHECK_VALUE(tensor.device() == like.device(), op_name(op), ": ", name,
                    ": must be on the device of q (", like.device(), "), got ", tensor.device());
  TORCH_CHECK_VALUE(tensor.scalar_type() == at::kFloat, op_name(op), ": ", name,
                    ": dtype must be torch.float32, got ", dtype_text(tensor.scalar_type()));
  TORCH_CHECK_VALUE(tensor.sizes() == sizes, op_name(op), ": ", name, ": shape must be ", sizes,
                    ", got ", sizes_text(tensor));
  TORCH_CHECK_VALUE(tensor.is_contiguous(), op_name(op), ": ", name,
                    ": must be contiguous, got strides ", tensor.strides());
}

float scale_argument(double value, const char* name, Op op) {
  const auto narrowed = static_cast<float>(value);
  // 0 selects the default and negative or non-finite values are validate's to report; a finite,
  // nonzero value must survive the conversion to the kernels' fp32 (1e-50 would become 0, the
  // default, and 1e39 inf).
  const bool lost = std::isfinite(value) && value != 0.0 &&
                    (!std::isfinite(narrowed) || std::fabs(narrowed) < FLT_MIN);
  TORCH_CHECK_VALUE(!lost, op_name(op), ": ", name,
                    ": must be 0 (the default) or within float32's normal range [", FLT_MIN, ", ",
                    FLT_MAX, "], got ", value);
  return narrowed;
}

DType dtype_of(const at::Tensor& tensor) {
  return tensor.scalar_type() == at::kHalf ? DType::kFP16 : DType::kBF16;
}

TensorRef tensor_ref(const at::Tensor& tensor) {
  std::array<int64_t, 3> strides = {tensor.stride(0), tensor.stride(1), tensor.stride(2)};
  int64_t inner_span = tensor.size(3);
  for (int dim = 2; dim >= 0; --dim) {
    if (tensor.size(dim) == 1) strides[dim] = inner_span;
    inner_span = std::max(inner_span, strides[dim] * tensor.size(dim));
  }
  return {tensor.data_ptr(), strides[0], strides[1], strides[2]};
}

at::Tensor kernel_layout(const at::Tensor& tensor, const char* name, const at::Tensor& q, Op op) {
  TORCH_CHECK_VALUE(tensor.defined(), op_name(op), ": ", name, ": must be a tensor, got None");
  TORCH_CHECK_VALUE(tensor.sizes() == q.sizes(), op_name(op), ": ", name, ": shape must match q's ",
                    sizes_text(q), ", got ", sizes_text(tensor));
  constexpr int64_t kStrideMultiple = 8;  // 16 bytes of 16-bit elements
  bool usable = tensor.stride(3) == 1 && reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 16 == 0;
  for (int dim = 0; dim < 3 && usable; ++dim) {
    usable = tensor.size(dim) == 1 ||
             (tensor.stride(dim) > 0 && tensor.stride(dim) % kStrideMultiple == 0);
  }
  const at::Tensor view = usable ? tensor : tensor.contiguous();
  check_activation(view, name, q, "q", op);
  return view;
}

void check_status(const Status& status, Op op, Check check) {
  if (status.ok()) return;
  const size_t colon = status.message.find(": ");
  const std::string field = colon == std::string::npos ? "" : status.message.substr(0, colon);
  if (check == Check::kCallerInput) {
    if (status.code == StatusCode::kUnsupported) return;
    for (const char* device_buffer : {"schedule", "workspace", "fwd.schedule", "fwd.workspace"}) {
      if (field == device_buffer) return;
    }
  }
  const std::string message = colon == std::string::npos
                                  ? status.message
                                  : torch_argument(field, op) + status.message.substr(colon);
  switch (status.code) {
    case StatusCode::kInvalidArgument:
      TORCH_CHECK_VALUE(false, op_name(op), ": ", message);
    case StatusCode::kUnsupported:
      TORCH_CHECK_NOT_IMPLEMENTED(false, op_name(op), ": ", message);
    default:
      TORCH_CHECK(false, op_name(op), ": ", message);
  }
}

ForwardParams forward_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& q_proxy, const at::Tensor& k_proxy,
                             const std::optional<at::Tensor>& block_idx, int64_t top_k,
                             const std::string& mode, double softmax_scale, double proxy_scale,
                             Op op) {
  ForwardParams params;
  params.shape = attention_shape(q, k, v, q_proxy, k_proxy, top_k, op);
  params.mode = parse_mode(mode, op);
  params.dtype = dtype_of(q);
  params.softmax_scale = scale_argument(softmax_scale, "softmax_scale", op);
  params.proxy_scale = scale_argument(proxy_scale, "proxy_scale", op);
  params.q = tensor_ref(q);
  params.k = tensor_ref(k);
  params.v = tensor_ref(v);
  params.q_proxy = tensor_ref(q_proxy);
  params.k_proxy = tensor_ref(k_proxy);
  if (params.mode == Mode::kSparse) {
    TORCH_CHECK_VALUE(block_idx.has_value(), op_name(op),
                      ": block_idx: required in sparse mode, got None");
    check_block_idx(*block_idx, params.shape, q, op);
    params.block_idx = block_idx->data_ptr<int32_t>();
  }
  return params;
}

void check_saved_outputs(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& proxy_lse,
                         const at::Tensor& q, const ProblemShape& shape) {
  const Op op = Op::kBackward;
  check_activation(out, "out", q, "q", op);
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), op_name(op), ": out: shape must match q's ",
                    sizes_text(q), ", got ", sizes_text(out));
  check_float_array(lse, "lse", {shape.batch, shape.num_heads, shape.seqlen}, q, op);
  check_float_array(proxy_lse, "proxy_lse", {shape.batch, shape.num_proxy_heads, shape.seqlen}, q,
                    op);
}

void check_scalar(const at::Tensor& tensor, const char* name, const at::Tensor& q, Op op) {
  TORCH_CHECK_VALUE(tensor.device() == q.device(), op_name(op), ": ", name,
                    ": must be on the device of q (", q.device(), "), got ", tensor.device());
  TORCH_CHECK_VALUE(
      tensor.scalar_type() == at::kFloat && tensor.numel() == 1 && tensor.is_contiguous(),
      op_name(op), ": ", name, ": must be a contiguous one-element torch.float32 tensor, got ",
      dtype_text(tensor.scalar_type()), " of shape ", sizes_text(tensor));
}

ForwardOutputs allocate_forward_outputs(ForwardParams& params, const at::Tensor& q) {
  const ProblemShape& shape = params.shape;
  const at::TensorOptions fp32 = q.options().dtype(at::kFloat);
  ForwardOutputs outputs;
  if (params.main_branch) {
    outputs.out = at::empty(q.sizes(), q.options());
    outputs.lse = at::empty({shape.batch, shape.num_heads, shape.seqlen}, fp32);
    params.out = tensor_ref(outputs.out);
    params.lse = outputs.lse.data_ptr<float>();
  }
  outputs.proxy_lse = at::empty({shape.batch, shape.num_proxy_heads, shape.seqlen}, fp32);
  params.proxy_lse = outputs.proxy_lse.data_ptr<float>();
  return outputs;
}

InputGradients allocate_backward_arguments(BackwardParams& params, const at::Tensor& q,
                                           const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& q_proxy, const at::Tensor& k_proxy,
                                           const at::Tensor& out, const at::Tensor& lse,
                                           const at::Tensor& proxy_lse, const at::Tensor& dout_view,
                                           const std::optional<at::Tensor>& kl_grad) {
  InputGradients grads;
  if (params.fwd.main_branch) {
    grads.dq = at::empty_like(q);
    grads.dk = at::empty_like(k);
    grads.dv = at::empty_like(v);
    params.dq = tensor_ref(grads.dq);
    params.dk = tensor_ref(grads.dk);
    params.dv = tensor_ref(grads.dv);
  }
  grads.dq_proxy = at::empty_like(q_proxy);
  grads.dk_proxy = at::empty_like(k_proxy);
  params.fwd.out = tensor_ref(out);
  params.fwd.lse = lse.data_ptr<float>();
  params.fwd.proxy_lse = proxy_lse.data_ptr<float>();
  params.dout = tensor_ref(dout_view);
  params.kl_grad = kl_grad.has_value() ? kl_grad->data_ptr<float>() : nullptr;
  params.dq_proxy = tensor_ref(grads.dq_proxy);
  params.dk_proxy = tensor_ref(grads.dk_proxy);
  return grads;
}

}  // namespace flashmsa::torch_binding
