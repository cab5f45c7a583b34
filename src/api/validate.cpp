// Host-side validation of every op's params (SPEC.md §6). The entry points in api.cpp call
// validate() first, then check the device, then hand over to the launchers of src/kernels/launch.h,
// which assume everything below holds.
//
// validate() is pure: it reads the params and the workspace-size queries of workspace.cpp, never a
// tensor and never the device, so it runs in CI without a GPU and nothing is written on error.
//
// Rules, in the order they are checked (every failure names the argument, the rule and the values):
//   shape      batch, seqlen, head counts, head dims >= 1; seqlen < 2^31 (token positions are
//              32-bit in the kernels); H % Hkv, H % Hp, Hp % Hpk, Hp % Hkv == 0; top_k in [1, 64];
//              the largest tensor of the op, in bytes, fits int64.
//   enums      dtype and mode are declared enumerators.
//   scales     softmax_scale / proxy_scale finite and >= 0 (0 selects the default).
//   tensors    ptr non-null and 16-byte aligned; batch/seq/head strides positive multiples of 16
//              bytes (8 elements); head_stride >= dim; the addressed range fits int64 and the
//              address space. Outputs must also map distinct (b, s, h) rows to distinct memory.
//   arrays     block_idx, lse, proxy_lse, kl, kl_grad non-null where required and 4-byte aligned;
//              schedule and workspace non-null where required and 16-byte aligned.
//   aliasing   no output shares memory with an input or with another output (inputs may alias).
//   supported  (dtype, head_dim, proxy_head_dim) is in supported_combinations(), and the op's
//              kernels hold the shape (each stage's *_limit in its config.h: in sparse mode the
//              schedule's 32-bit indices, H/Hp ≤ 128, B·Hp·S·K < 2^31, S < 2^26), else
//              kUnsupported; checked last, so kUnsupported always means "valid, but not built".
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "api/check.h"
#include "flashmsa/api.h"
#include "kernels/backward/config.h"
#include "kernels/common/limit.h"
#include "kernels/schedule/config.h"
#include "kernels/select/config.h"
#include "kernels/warmup/config.h"

namespace flashmsa {

namespace {

constexpr int64_t kTensorAlignBytes = 16;  // TMA and 128-bit vector accesses
constexpr int64_t kStrideAlignBytes = 16;  // TMA global strides are multiples of 16 bytes
constexpr int64_t kScalarAlignBytes = 4;   // int32 / fp32 arrays
constexpr int64_t kMaxSeqlen = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

enum class Access { kRead, kWrite };

int64_t element_bytes(DType dtype) {
  (void)dtype;  // bf16 and fp16 alike
  return 2;
}

const char* dtype_name(DType dtype) { return dtype == DType::kBF16 ? "bf16" : "fp16"; }

// The memory one argument may touch: element offsets Σ_k index_k · stride[k] for index_k in
// [0, extent[k]) from base, each elem_bytes wide. A fixed-layout array is one contiguous run.
struct Footprint {
  std::string name;
  uintptr_t base = 0;
  int64_t elem_bytes = 1;
  std::array<int64_t, 4> extent{1, 1, 1, 0};  // batch, seq, heads, dim
  std::array<int64_t, 4> stride{0, 0, 0, 1};  // in elements
  int64_t bytes = 0;                          // base to one past the last byte; 0 when absent
  bool strided = false;                       // a TensorRef view rather than a flat array
};

int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  return a / b - ((a % b != 0) && (a < 0));
}

int64_t ceil_div(int64_t a, int64_t b) {  // b > 0
  return a / b + ((a % b != 0) && (a > 0));
}

// ---------------------------------------------------------------------------------------------
// Shape, enums, scales
// ---------------------------------------------------------------------------------------------

Status check_shape(const ProblemShape& shape, const std::string& prefix) {
  const std::string arg = prefix + "shape.";
  const int64_t heads = shape.num_heads;
  const int64_t kv_heads = shape.num_kv_heads;
  const int64_t proxy_heads = shape.num_proxy_heads;
  const int64_t proxy_kv_heads = shape.num_proxy_kv_heads;

  FLASHMSA_CHECK_ARG(shape.batch >= 1, arg + "batch", "must be >= 1, got ", shape.batch);
  FLASHMSA_CHECK_ARG(shape.seqlen >= 1, arg + "seqlen", "must be >= 1, got ", shape.seqlen);
  FLASHMSA_CHECK_ARG(shape.seqlen <= kMaxSeqlen, arg + "seqlen",
                     "must be <= 2147483647 (token positions are 32-bit in the kernels), got ",
                     shape.seqlen);
  FLASHMSA_CHECK_ARG(heads >= 1, arg + "num_heads", "must be >= 1, got ", heads);
  FLASHMSA_CHECK_ARG(kv_heads >= 1, arg + "num_kv_heads", "must be >= 1, got ", kv_heads);
  FLASHMSA_CHECK_ARG(proxy_heads >= 1, arg + "num_proxy_heads", "must be >= 1, got ", proxy_heads);
  FLASHMSA_CHECK_ARG(proxy_kv_heads >= 1, arg + "num_proxy_kv_heads", "must be >= 1, got ",
                     proxy_kv_heads);

  FLASHMSA_CHECK_ARG(heads % kv_heads == 0, arg + "num_heads",
                     "must be divisible by num_kv_heads (H % Hkv == 0), got H=", heads,
                     ", Hkv=", kv_heads);
  FLASHMSA_CHECK_ARG(heads % proxy_heads == 0, arg + "num_heads",
                     "must be divisible by num_proxy_heads (H % Hp == 0), got H=", heads,
                     ", Hp=", proxy_heads);
  FLASHMSA_CHECK_ARG(proxy_heads % proxy_kv_heads == 0, arg + "num_proxy_heads",
                     "must be divisible by num_proxy_kv_heads (Hp % Hpk == 0), got Hp=",
                     proxy_heads, ", Hpk=", proxy_kv_heads);
  FLASHMSA_CHECK_ARG(proxy_heads % kv_heads == 0, arg + "num_proxy_heads",
                     "must be divisible by num_kv_heads (Hp % Hkv == 0: each proxy group lies "
                     "inside one KV group), got Hp=",
                     proxy_heads, ", Hkv=", kv_heads);

  FLASHMSA_CHECK_ARG(shape.top_k >= 1 && shape.top_k <= kMaxTopK, arg + "top_k", "must be in [1, ",
                     kMaxTopK, "], got ", shape.top_k);
  FLASHMSA_CHECK_ARG(shape.head_dim >= 1, arg + "head_dim", "must be >= 1, got ", shape.head_dim);
  FLASHMSA_CHECK_ARG(shape.proxy_head_dim >= 1, arg + "proxy_head_dim", "must be >= 1, got ",
                     shape.proxy_head_dim);

  // Every tensor of every op (activations, block_idx, lse, proxy_lse) has at most
  // B·S·max(H, Hp)·max(D, Di, K) elements of at most 4 bytes; bounding that product keeps all
  // element and byte counts derived from the shape inside int64.
  const int64_t max_heads = std::max(heads, proxy_heads);
  const int64_t max_inner = std::max<int64_t>({shape.head_dim, shape.proxy_head_dim, shape.top_k});
  int64_t bytes = 0;
  const bool fits = !__builtin_mul_overflow(shape.batch, shape.seqlen, &bytes) &&
                    !__builtin_mul_overflow(bytes, max_heads, &bytes) &&
                    !__builtin_mul_overflow(bytes, max_inner, &bytes) &&
                    !__builtin_mul_overflow(bytes, int64_t{4}, &bytes);
  FLASHMSA_CHECK_ARG(
      fits, prefix + "shape",
      "tensor sizes overflow int64: B*S*max(H, Hp)*max(D, Di, K)*4 bytes with B=", shape.batch,
      ", S=", shape.seqlen, ", max(H, Hp)=", max_heads, ", max(D, Di, K)=", max_inner);
  return Status::Ok();
}

Status check_dtype(DType dtype, const std::string& arg) {
  FLASHMSA_CHECK_ARG(dtype == DType::kBF16 || dtype == DType::kFP16, arg,
                     "must be DType::kBF16 (0) or DType::kFP16 (1), got ", static_cast<int>(dtype));
  return Status::Ok();
}

Status check_mode(Mode mode, const std::string& arg) {
  FLASHMSA_CHECK_ARG(mode == Mode::kSparse || mode == Mode::kWarmup, arg,
                     "must be Mode::kSparse (0) or Mode::kWarmup (1), got ",
                     static_cast<int>(mode));
  return Status::Ok();
}

Status check_scale(float scale, const std::string& arg) {
  FLASHMSA_CHECK_ARG(std::isfinite(scale) && scale >= 0.f, arg,
                     "must be finite and >= 0 (0 selects the default 1/sqrt(dim)), got ", scale);
  return Status::Ok();
}

bool head_dims_built(const ProblemShape& shape) {
  return shape.head_dim == 128 && shape.proxy_head_dim == 128;
}

// NOTES: run last, so that kUnsupported is only ever returned for input that is otherwise valid.
// `limit`: the op's kernel limits (kernels/common/limit.h), each stage's own function, which its
// launcher checks again; its field is named as in the op's params.
Status check_supported(const ProblemShape& shape, DType dtype, const std::string& prefix,
                       const kernels::Limit& limit) {
  FLASHMSA_CHECK_SUPPORTED(
      head_dims_built(shape),
      prefix + (shape.head_dim != 128 ? "shape.head_dim" : "shape.proxy_head_dim"),
      "no kernel is built for dtype=", dtype_name(dtype), ", head_dim=", shape.head_dim,
      ", proxy_head_dim=", shape.proxy_head_dim, "; supported combinations:\n",
      supported_combinations());
  FLASHMSA_CHECK_SUPPORTED(!limit, limit.field, limit.rule);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Tensors and arrays
// ---------------------------------------------------------------------------------------------

Status check_address_range(uintptr_t base, int64_t bytes, const std::string& arg) {
  FLASHMSA_CHECK_ARG(base <= std::numeric_limits<uintptr_t>::max() - static_cast<uintptr_t>(bytes),
                     arg, "the ", bytes,
                     " bytes it addresses run past the end of the address space");
  return Status::Ok();
}

// A [batch, seq, heads, dim] view. Outputs must not alias themselves: that is checked with a
// sufficient condition on the strides sorted ascending (dims of extent 1 skipped): each stride is
// at least the span, in elements, of everything inside it. Then distinct (b, s, h) rows never meet.
Status check_tensor(const TensorRef& ref, const std::string& name, const ProblemShape& shape,
                    int64_t heads, int64_t dim, DType dtype, Access access, Footprint* footprint) {
  const int64_t elem_bytes = element_bytes(dtype);
  const int64_t stride_multiple = kStrideAlignBytes / elem_bytes;
  const auto address = reinterpret_cast<uintptr_t>(ref.ptr);

  FLASHMSA_CHECK_ARG(ref.ptr != nullptr, name + ".ptr", "must not be null");
  FLASHMSA_CHECK_ARG(address % kTensorAlignBytes == 0, name + ".ptr", "must be ", kTensorAlignBytes,
                     "-byte aligned, got ", ref.ptr);

  const std::array<const char*, 3> fields = {"batch_stride", "seq_stride", "head_stride"};
  const std::array<int64_t, 3> strides = {ref.batch_stride, ref.seq_stride, ref.head_stride};
  for (int k = 0; k < 3; ++k) {
    FLASHMSA_CHECK_ARG(strides[k] >= 1 && strides[k] % stride_multiple == 0, name + "." + fields[k],
                       "must be a positive multiple of ", stride_multiple, " elements (",
                       kStrideAlignBytes, " bytes), got ", strides[k]);
  }
  FLASHMSA_CHECK_ARG(ref.head_stride >= dim, name + ".head_stride",
                     "must be >= the head dim (heads may not overlap), got ", ref.head_stride,
                     " < ", dim);

  footprint->name = name;
  footprint->base = address;
  footprint->elem_bytes = elem_bytes;
  footprint->extent = {shape.batch, shape.seqlen, heads, dim};
  footprint->stride = {ref.batch_stride, ref.seq_stride, ref.head_stride, 1};
  footprint->strided = true;

  int64_t last = 0;  // element offset of the last element
  bool fits = true;
  for (int k = 0; k < 4 && fits; ++k) {
    int64_t term = 0;
    fits = !__builtin_mul_overflow(footprint->extent[k] - 1, footprint->stride[k], &term) &&
           !__builtin_add_overflow(last, term, &last);
  }
  fits = fits && !__builtin_add_overflow(last, int64_t{1}, &last) &&
         !__builtin_mul_overflow(last, elem_bytes, &footprint->bytes);
  FLASHMSA_CHECK_ARG(fits, name,
                     "addresses more than 2^63 bytes with batch_stride=", ref.batch_stride,
                     ", seq_stride=", ref.seq_stride, ", head_stride=", ref.head_stride);
  FLASHMSA_RETURN_IF_ERROR(check_address_range(address, footprint->bytes, name));

  if (access == Access::kWrite) {
    std::array<int, 3> order = {0, 1, 2};
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return strides[a] < strides[b]; });
    int64_t covered = dim;  // elements spanned by the dims inside the current one
    for (int k : order) {
      if (footprint->extent[k] == 1) continue;
      FLASHMSA_CHECK_ARG(strides[k] >= covered, name + "." + fields[k],
                         "distinct (b, s, h) rows of an output must not overlap: ", strides[k],
                         " is less than the ", covered, " elements spanned by the dims inside it");
      covered += (footprint->extent[k] - 1) * strides[k];  // <= last, which fits
    }
  }
  return Status::Ok();
}

enum class Presence { kRequired, kOptional };

// A flat array of `bytes` bytes (block_idx, lse, proxy_lse, kl, kl_grad, schedule, workspace).
Status check_array(const void* ptr, const std::string& name, int64_t bytes, int64_t align,
                   Presence presence, Footprint* footprint) {
  footprint->name = name;
  if (ptr == nullptr) {
    FLASHMSA_CHECK_ARG(presence == Presence::kOptional, name, "must not be null");
    return Status::Ok();
  }
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  FLASHMSA_CHECK_ARG(address % align == 0, name, "must be ", align, "-byte aligned, got ", ptr);
  FLASHMSA_RETURN_IF_ERROR(check_address_range(address, bytes, name));
  footprint->base = address;
  footprint->extent = {1, 1, 1, bytes};
  footprint->bytes = bytes;
  return Status::Ok();
}

// The caller must pass a buffer when the op asks for one: `size` from the *_workspace_size() query.
Status check_workspace(const void* ptr, const std::string& name, size_t size, const char* query,
                       Footprint* footprint) {
  FLASHMSA_CHECK_ARG(size <= static_cast<size_t>(kInt64Max), name, query, "() returned ", size,
                     " bytes, more than int64 can hold");
  FLASHMSA_CHECK_ARG(size == 0 || ptr != nullptr, name, "must not be null: ", query, "() is ", size,
                     " bytes for this shape");
  return check_array(ptr, name, static_cast<int64_t>(size), kTensorAlignBytes, Presence::kOptional,
                     footprint);
}

// ---------------------------------------------------------------------------------------------
// Aliasing
// ---------------------------------------------------------------------------------------------

// One dim of the search below: d in [lo, hi] contributes d·stride; sum_lo/sum_hi bound the sum of
// this dim and every dim after it.
struct LatticeTerm {
  int64_t stride, lo, hi, sum_lo, sum_hi;
};

// True when target = Σ_{k >= level} d_k·stride_k for some d_k in [lo_k, hi_k], terms sorted by
// descending stride. `budget` caps the work; running out answers true (assume they share memory).
bool reachable(const std::vector<LatticeTerm>& terms, size_t level, int64_t target, int* budget) {
  if (level == terms.size()) return target == 0;
  const LatticeTerm& term = terms[level];
  const int64_t rest_lo = level + 1 < terms.size() ? terms[level + 1].sum_lo : 0;
  const int64_t rest_hi = level + 1 < terms.size() ? terms[level + 1].sum_hi : 0;
  const int64_t first = std::max(term.lo, ceil_div(target - rest_hi, term.stride));
  const int64_t last = std::min(term.hi, floor_div(target - rest_lo, term.stride));
  for (int64_t d = first; d <= last; ++d) {
    if (--*budget < 0) return true;
    if (reachable(terms, level + 1, target - d * term.stride, budget)) return true;
  }
  return false;
}

// NOTES: views cut from one buffer, such as q, k, v of a packed qkv tensor or dq, dk, dv of a
// packed dqkv gradient, have intersecting byte ranges yet never share an element. When two tensor
// views step with the same strides, they share an element exactly when their base distance t (in
// elements) is Σ_k d_k·stride_k with d_k in [-(extent_b[k] - 1), extent_a[k] - 1]; a short search
// over the dims, largest stride first, decides that (at most three candidates per dim when strides
// nest, as every layout of a real tensor does). Views with different strides fall back to the byte
// range test, which can only err towards refusing.
bool may_overlap(const Footprint& a, const Footprint& b) {
  if (a.bytes == 0 || b.bytes == 0) return false;
  if (a.base + a.bytes <= b.base || b.base + b.bytes <= a.base) return false;
  if (!a.strided || !b.strided || a.elem_bytes != b.elem_bytes) return true;
  const auto delta = static_cast<int64_t>(b.base - a.base);  // |delta| < 2^63: the ranges meet
  if (delta % a.elem_bytes != 0) return true;

  std::vector<LatticeTerm> terms;
  for (int k = 0; k < 4; ++k) {
    const int64_t lo = -(b.extent[k] - 1);
    const int64_t hi = a.extent[k] - 1;
    if (lo == 0 && hi == 0) continue;
    if (a.stride[k] != b.stride[k]) return true;
    terms.push_back({a.stride[k], lo, hi, 0, 0});
  }
  std::sort(terms.begin(), terms.end(),
            [](const LatticeTerm& x, const LatticeTerm& y) { return x.stride > y.stride; });
  // Both spans fit int64 in bytes and elements are 2 bytes, so these sums stay within ±2^62.
  int64_t sum_lo = 0;
  int64_t sum_hi = 0;
  for (size_t level = terms.size(); level-- > 0;) {
    sum_lo += terms[level].lo * terms[level].stride;
    sum_hi += terms[level].hi * terms[level].stride;
    terms[level].sum_lo = sum_lo;
    terms[level].sum_hi = sum_hi;
  }
  int budget = 4096;
  return reachable(terms, 0, delta / a.elem_bytes, &budget);
}

std::string describe(const Footprint& footprint) {
  std::ostringstream text;
  text << footprint.name << " [0x" << std::hex << footprint.base << ", 0x"
       << footprint.base + static_cast<uintptr_t>(footprint.bytes) << ")";
  return text.str();
}

// Outputs may share memory with nothing else; inputs may alias each other (packed qkv, k == v).
Status check_disjoint(const std::vector<const Footprint*>& outputs,
                      const std::vector<const Footprint*>& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Footprint& output = *outputs[i];
    for (const Footprint* input : inputs) {
      FLASHMSA_CHECK_ARG(!may_overlap(output, *input), output.name,
                         "an output must not share memory with the input ", input->name, " (",
                         describe(output), ", ", describe(*input), ")");
    }
    for (size_t j = 0; j < i; ++j) {
      FLASHMSA_CHECK_ARG(!may_overlap(output, *outputs[j]), output.name,
                         "an output must not share memory with the output ", outputs[j]->name, " (",
                         describe(output), ", ", describe(*outputs[j]), ")");
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Per op
// ---------------------------------------------------------------------------------------------

int64_t block_idx_bytes(const ProblemShape& shape) {
  return shape.batch * shape.num_proxy_heads * shape.seqlen * shape.top_k * 4;
}

// The views of a ForwardParams that forward() and backward() both read.
struct ForwardViews {
  Footprint q, k, v, q_proxy, k_proxy, block_idx, schedule, out, lse, proxy_lse;
};

// Checks shared by forward() and backward(); `prefix` is "" or "fwd.". `out_access` is kWrite for
// the forward and kRead for the backward, which reads the saved out, lse and proxy_lse.
// In warmup mode block_idx and schedule are not read, hence not checked.
Status check_forward_fields(const ForwardParams& params, const std::string& prefix,
                            Access out_access, ForwardViews* views) {
  const ProblemShape& shape = params.shape;
  FLASHMSA_RETURN_IF_ERROR(check_shape(shape, prefix));
  FLASHMSA_RETURN_IF_ERROR(check_dtype(params.dtype, prefix + "dtype"));
  FLASHMSA_RETURN_IF_ERROR(check_mode(params.mode, prefix + "mode"));
  FLASHMSA_RETURN_IF_ERROR(check_scale(params.softmax_scale, prefix + "softmax_scale"));
  FLASHMSA_RETURN_IF_ERROR(check_scale(params.proxy_scale, prefix + "proxy_scale"));
  const bool main_branch = params.main_branch;
  FLASHMSA_CHECK_ARG(main_branch || params.mode == Mode::kWarmup, prefix + "main_branch",
                     "may be false only in warmup mode (the sparse main branch is flashmsa's own)");

  const int64_t dim = shape.head_dim;
  const int64_t proxy_dim = shape.proxy_head_dim;
  const DType dtype = params.dtype;
  FLASHMSA_RETURN_IF_ERROR(check_tensor(params.q, prefix + "q", shape, shape.num_heads, dim, dtype,
                                        Access::kRead, &views->q));
  FLASHMSA_RETURN_IF_ERROR(check_tensor(params.k, prefix + "k", shape, shape.num_kv_heads, dim,
                                        dtype, Access::kRead, &views->k));
  if (main_branch) {
    FLASHMSA_RETURN_IF_ERROR(check_tensor(params.v, prefix + "v", shape, shape.num_kv_heads, dim,
                                          dtype, Access::kRead, &views->v));
  }
  FLASHMSA_RETURN_IF_ERROR(check_tensor(params.q_proxy, prefix + "q_proxy", shape,
                                        shape.num_proxy_heads, proxy_dim, dtype, Access::kRead,
                                        &views->q_proxy));
  FLASHMSA_RETURN_IF_ERROR(check_tensor(params.k_proxy, prefix + "k_proxy", shape,
                                        shape.num_proxy_kv_heads, proxy_dim, dtype, Access::kRead,
                                        &views->k_proxy));
  if (params.mode == Mode::kSparse) {
    FLASHMSA_RETURN_IF_ERROR(check_array(params.block_idx, prefix + "block_idx",
                                         block_idx_bytes(shape), kScalarAlignBytes,
                                         Presence::kRequired, &views->block_idx));
    const int64_t schedule_bytes = static_cast<int64_t>(schedule_workspace_size(shape));
    FLASHMSA_RETURN_IF_ERROR(check_array(params.schedule, prefix + "schedule", schedule_bytes,
                                         kTensorAlignBytes, Presence::kRequired, &views->schedule));
  }
  if (main_branch) {
    FLASHMSA_RETURN_IF_ERROR(check_tensor(params.out, prefix + "out", shape, shape.num_heads, dim,
                                          dtype, out_access, &views->out));
  }
  const int64_t rows = shape.batch * shape.seqlen;
  // Without the main branch the forward does not write lse; the backward still reads it.
  if (main_branch || out_access == Access::kRead) {
    FLASHMSA_RETURN_IF_ERROR(check_array(params.lse, prefix + "lse", rows * shape.num_heads * 4,
                                         kScalarAlignBytes, Presence::kRequired, &views->lse));
  }
  FLASHMSA_RETURN_IF_ERROR(check_array(params.proxy_lse, prefix + "proxy_lse",
                                       rows * shape.num_proxy_heads * 4, kScalarAlignBytes,
                                       Presence::kRequired, &views->proxy_lse));
  return Status::Ok();
}

}  // namespace

bool detail::workspace_defined(const ProblemShape& shape, Mode mode) {
  if (!check_shape(shape, "").ok() || !head_dims_built(shape)) return false;
  if (mode == Mode::kWarmup) return true;
  return mode == Mode::kSparse && !kernels::schedule::schedule_limit(shape);
}

Status validate(const SelectParams& params) {
  const ProblemShape& shape = params.shape;
  FLASHMSA_RETURN_IF_ERROR(check_shape(shape, ""));
  FLASHMSA_RETURN_IF_ERROR(check_dtype(params.dtype, "dtype"));
  FLASHMSA_RETURN_IF_ERROR(check_scale(params.proxy_scale, "proxy_scale"));

  Footprint q_proxy, k_proxy, block_idx;
  FLASHMSA_RETURN_IF_ERROR(check_tensor(params.q_proxy, "q_proxy", shape, shape.num_proxy_heads,
                                        shape.proxy_head_dim, params.dtype, Access::kRead,
                                        &q_proxy));
  FLASHMSA_RETURN_IF_ERROR(check_tensor(params.k_proxy, "k_proxy", shape, shape.num_proxy_kv_heads,
                                        shape.proxy_head_dim, params.dtype, Access::kRead,
                                        &k_proxy));
  FLASHMSA_RETURN_IF_ERROR(check_array(params.block_idx, "block_idx", block_idx_bytes(shape),
                                       kScalarAlignBytes, Presence::kRequired, &block_idx));
  FLASHMSA_RETURN_IF_ERROR(check_disjoint({&block_idx}, {&q_proxy, &k_proxy}));
  return check_supported(shape, params.dtype, "", kernels::select::select_limit(shape));
}

// NOTES: the schedule reads only block_idx (no dtype, no head dim), so of the supported checks only
// its own size limits apply.
Status validate(const ScheduleParams& params) {
  const ProblemShape& shape = params.shape;
  FLASHMSA_RETURN_IF_ERROR(check_shape(shape, ""));

  Footprint block_idx, workspace;
  FLASHMSA_RETURN_IF_ERROR(check_array(params.block_idx, "block_idx", block_idx_bytes(shape),
                                       kScalarAlignBytes, Presence::kRequired, &block_idx));
  FLASHMSA_RETURN_IF_ERROR(check_workspace(params.workspace, "workspace",
                                           schedule_workspace_size(shape),
                                           "schedule_workspace_size", &workspace));
  FLASHMSA_RETURN_IF_ERROR(check_disjoint({&workspace}, {&block_idx}));
  const kernels::Limit limit = kernels::schedule::schedule_limit(shape);
  FLASHMSA_CHECK_SUPPORTED(!limit, limit.field, limit.rule);
  return Status::Ok();
}

Status validate(const ForwardParams& params) {
  ForwardViews views;
  FLASHMSA_RETURN_IF_ERROR(check_forward_fields(params, "", Access::kWrite, &views));

  Footprint kl, workspace;
  FLASHMSA_RETURN_IF_ERROR(
      check_array(params.kl, "kl", 4, kScalarAlignBytes, Presence::kOptional, &kl));
  FLASHMSA_RETURN_IF_ERROR(check_workspace(params.workspace, "workspace",
                                           forward_workspace_size(params.shape, params.mode),
                                           "forward_workspace_size", &workspace));
  FLASHMSA_RETURN_IF_ERROR(
      check_disjoint({&views.out, &views.lse, &views.proxy_lse, &kl, &workspace},
                     {&views.q, &views.k, &views.v, &views.q_proxy, &views.k_proxy,
                      &views.block_idx, &views.schedule}));
  const bool sparse = params.mode == Mode::kSparse;
  return check_supported(params.shape, params.dtype, "",
                         sparse ? kernels::schedule::schedule_limit(params.shape)
                                : kernels::warmup::forward_limit(params.shape));
}

// NOTES: the backward writes the KL value into fwd.kl (optional; docs/design.md "Backward"), so it
// is checked as an output. fwd.workspace is not used by the backward (it has its own workspace).
Status validate(const BackwardParams& params) {
  const ForwardParams& fwd = params.fwd;
  const ProblemShape& shape = fwd.shape;
  ForwardViews views;
  FLASHMSA_RETURN_IF_ERROR(check_forward_fields(fwd, "fwd.", Access::kRead, &views));

  const int64_t dim = shape.head_dim;
  const int64_t proxy_dim = shape.proxy_head_dim;
  const DType dtype = fwd.dtype;
  Footprint dout, kl, kl_grad, dq, dk, dv, dq_proxy, dk_proxy, workspace;
  const bool main_branch = fwd.main_branch;
  if (main_branch) {
    FLASHMSA_RETURN_IF_ERROR(
        check_tensor(params.dout, "dout", shape, shape.num_heads, dim, dtype, Access::kRead, &dout));
  }
  FLASHMSA_RETURN_IF_ERROR(
      check_array(fwd.kl, "fwd.kl", 4, kScalarAlignBytes, Presence::kOptional, &kl));
  FLASHMSA_RETURN_IF_ERROR(
      check_array(params.kl_grad, "kl_grad", 4, kScalarAlignBytes, Presence::kOptional, &kl_grad));
  if (main_branch) {
    FLASHMSA_RETURN_IF_ERROR(
        check_tensor(params.dq, "dq", shape, shape.num_heads, dim, dtype, Access::kWrite, &dq));
    FLASHMSA_RETURN_IF_ERROR(
        check_tensor(params.dk, "dk", shape, shape.num_kv_heads, dim, dtype, Access::kWrite, &dk));
    FLASHMSA_RETURN_IF_ERROR(
        check_tensor(params.dv, "dv", shape, shape.num_kv_heads, dim, dtype, Access::kWrite, &dv));
  }
  FLASHMSA_RETURN_IF_ERROR(check_tensor(params.dq_proxy, "dq_proxy", shape, shape.num_proxy_heads,
                                        proxy_dim, dtype, Access::kWrite, &dq_proxy));
  FLASHMSA_RETURN_IF_ERROR(check_tensor(params.dk_proxy, "dk_proxy", shape,
                                        shape.num_proxy_kv_heads, proxy_dim, dtype, Access::kWrite,
                                        &dk_proxy));
  FLASHMSA_RETURN_IF_ERROR(check_workspace(
      params.workspace, "workspace", backward_workspace_size(shape, fwd.mode, params.deterministic, fwd.dtype),
      "backward_workspace_size", &workspace));
  FLASHMSA_RETURN_IF_ERROR(check_disjoint(
      {&dq, &dk, &dv, &dq_proxy, &dk_proxy, &kl, &workspace},
      {&views.q, &views.k, &views.v, &views.q_proxy, &views.k_proxy, &views.block_idx,
       &views.schedule, &views.out, &views.lse, &views.proxy_lse, &dout, &kl_grad}));
  kernels::Limit limit;
  if (fwd.mode == Mode::kWarmup) {
    limit = kernels::warmup::backward_limit(shape, params.deterministic, fwd.main_branch);
  } else {
    limit = kernels::schedule::schedule_limit(shape, "fwd.shape");
    if (!limit) limit = kernels::backward::sparse_limit(shape, params.deterministic);
  }
  return check_supported(shape, dtype, "fwd.", limit);
}

}  // namespace flashmsa
