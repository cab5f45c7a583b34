// Host-side validation of every op's params (src/api/validate.cpp, SPEC.md §6), without a GPU.
//
// Tensors are real, aligned host allocations: validate() never reads them, but the aliasing rules
// compare their addresses, and the "nothing is written" tests hand them to the public ops, which
// refuse bad params before they look for a device.
//
// Layout of this file: a Problem (one named configuration with all its buffers) · valid configs
// that must pass every op · a table of bad inputs, one test instance each, asserting the exact
// StatusCode and that the message starts with the argument's name · the "nothing is written" tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "common/cases.h"
#include "flashmsa/api.h"

namespace flashmsa {
namespace {

constexpr unsigned char kSentinel = 0xA5;

// ---------------------------------------------------------------------------------------------
// Problem: a named configuration and its host buffers
// ---------------------------------------------------------------------------------------------

enum class Layout {
  kBSHD,    // [B, S, H, D]: the FlashAttention layout
  kBHSD,    // [B, H, S, D]: the seed-compatible layout
  kPacked,  // q, k, v as slices of one [B, S, H + 2·Hkv, D] tensor; dq, dk, dv of a packed dqkv;
            // q_proxy, k_proxy of one [B, S, Hp + Hpk, Di] tensor; dq_proxy, dk_proxy likewise
};

struct Config {
  const char* name;
  int64_t batch;
  int64_t seqlen;
  int num_heads, num_kv_heads, num_proxy_heads, num_proxy_kv_heads;
  int top_k;
  DType dtype;
  Layout layout;
};

// A host allocation whose data() is 64-byte aligned. kSentinel buffers are filled with kSentinel so
// that a test can tell they were never written; kReserved ones (the forward/backward workspaces,
// up to gigabytes) are left uninitialised, which costs address space only, and are not tracked.
enum class Fill { kSentinel, kReserved };

class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes, Fill fill = Fill::kSentinel)
      : storage_(new unsigned char[bytes + 64]), size_(bytes + 64), fill_(fill) {
    if (fill_ == Fill::kSentinel) std::fill(storage_.get(), storage_.get() + size_, kSentinel);
  }

  void* data() {
    const auto address = reinterpret_cast<uintptr_t>(storage_.get());
    return storage_.get() + ((64 - address % 64) % 64);
  }
  bool untouched() const {
    if (fill_ == Fill::kReserved) return true;
    return std::all_of(storage_.get(), storage_.get() + size_,
                       [](unsigned char byte) { return byte == kSentinel; });
  }

 private:
  std::unique_ptr<unsigned char[]> storage_;
  size_t size_ = 0;
  Fill fill_ = Fill::kSentinel;
};

void* offset_bytes(const void* ptr, ptrdiff_t bytes) {
  return const_cast<char*>(static_cast<const char*>(ptr)) + bytes;
}

class Problem {
 public:
  explicit Problem(const Config& config) : config_(config) {
    shape_ = cases::problem_shape(config.batch, config.seqlen, config.num_heads,
                                  config.num_kv_heads, config.num_proxy_heads,
                                  config.num_proxy_kv_heads, config.top_k);

    const int64_t heads = shape_.num_heads;
    const int64_t kv_heads = shape_.num_kv_heads;
    const int64_t proxy_heads = shape_.num_proxy_heads;
    const int64_t proxy_kv_heads = shape_.num_proxy_kv_heads;
    if (config.layout == Layout::kPacked) {
      qkv_ = make_tensor(heads + 2 * kv_heads, shape_.head_dim);
      dqkv_ = make_tensor(heads + 2 * kv_heads, shape_.head_dim);
      proxies_ = make_tensor(proxy_heads + proxy_kv_heads, shape_.proxy_head_dim);
      dproxies_ = make_tensor(proxy_heads + proxy_kv_heads, shape_.proxy_head_dim);
    } else {
      q_ = make_tensor(heads, shape_.head_dim);
      k_ = make_tensor(kv_heads, shape_.head_dim);
      v_ = make_tensor(kv_heads, shape_.head_dim);
      q_proxy_ = make_tensor(proxy_heads, shape_.proxy_head_dim);
      k_proxy_ = make_tensor(proxy_kv_heads, shape_.proxy_head_dim);
      dq_ = make_tensor(heads, shape_.head_dim);
      dk_ = make_tensor(kv_heads, shape_.head_dim);
      dv_ = make_tensor(kv_heads, shape_.head_dim);
      dq_proxy_ = make_tensor(proxy_heads, shape_.proxy_head_dim);
      dk_proxy_ = make_tensor(proxy_kv_heads, shape_.proxy_head_dim);
    }
    out_ = make_tensor(heads, shape_.head_dim);
    dout_ = make_tensor(heads, shape_.head_dim);

    const int64_t rows = shape_.batch * shape_.seqlen;
    block_idx_ = Buffer(static_cast<size_t>(rows * proxy_heads * shape_.top_k) * sizeof(int32_t));
    lse_ = Buffer(static_cast<size_t>(rows * heads) * sizeof(float));
    proxy_lse_ = Buffer(static_cast<size_t>(rows * proxy_heads) * sizeof(float));
    kl_ = Buffer(sizeof(float));
    kl_grad_ = Buffer(sizeof(float));
    // At least 64 bytes: the schedule is required in sparse mode even if its size were 0.
    schedule_ = Buffer(std::max<size_t>(schedule_workspace_size(shape_), 64));
    workspace_ =
        Buffer(std::max({forward_workspace_size(shape_, Mode::kSparse),
                         forward_workspace_size(shape_, Mode::kWarmup),
                         backward_workspace_size(shape_, Mode::kSparse, false),
                         backward_workspace_size(shape_, Mode::kSparse, true),
                         backward_workspace_size(shape_, Mode::kWarmup, false),
                         backward_workspace_size(shape_, Mode::kWarmup, true), size_t{64}}),
               Fill::kReserved);
  }

  const ProblemShape& shape() const { return shape_; }

  SelectParams select_params() {
    SelectParams params;
    params.shape = shape_;
    params.dtype = config_.dtype;
    params.q_proxy = q_proxy();
    params.k_proxy = k_proxy();
    params.block_idx = static_cast<int32_t*>(block_idx_.data());
    return params;
  }

  ScheduleParams schedule_params() {
    ScheduleParams params;
    params.shape = shape_;
    params.block_idx = static_cast<const int32_t*>(block_idx_.data());
    params.workspace = schedule_.data();
    return params;
  }

  ForwardParams forward_params(Mode mode = Mode::kSparse) {
    ForwardParams params;
    params.shape = shape_;
    params.dtype = config_.dtype;
    params.mode = mode;
    params.q = q();
    params.k = k();
    params.v = v();
    params.q_proxy = q_proxy();
    params.k_proxy = k_proxy();
    params.block_idx = static_cast<const int32_t*>(block_idx_.data());
    params.schedule = schedule_.data();
    params.out = view(out_, shape_.num_heads, shape_.head_dim);
    params.lse = static_cast<float*>(lse_.data());
    params.proxy_lse = static_cast<float*>(proxy_lse_.data());
    params.kl = static_cast<float*>(kl_.data());
    params.workspace = workspace_.data();
    return params;
  }

  BackwardParams backward_params(Mode mode = Mode::kSparse) {
    BackwardParams params;
    params.fwd = forward_params(mode);
    params.fwd.workspace = nullptr;  // not read by the backward
    params.fwd.kl = nullptr;
    params.dout = view(dout_, shape_.num_heads, shape_.head_dim);
    params.kl_grad = static_cast<const float*>(kl_grad_.data());
    params.dq = dq();
    params.dk = dk();
    params.dv = dv();
    params.dq_proxy = dq_proxy();
    params.dk_proxy = dk_proxy();
    params.workspace = workspace_.data();
    return params;
  }

  // True when no byte of any buffer changed since construction.
  bool untouched() const {
    for (const Buffer* buffer :
         {&q_,         &k_,        &v_,        &q_proxy_,  &k_proxy_,   &dq_,
          &dk_,        &dv_,       &dq_proxy_, &dk_proxy_, &qkv_,       &dqkv_,
          &proxies_,   &dproxies_, &out_,      &dout_,     &block_idx_, &lse_,
          &proxy_lse_, &kl_,       &kl_grad_,  &schedule_, &workspace_}) {
      if (!buffer->untouched()) return false;
    }
    return true;
  }

 private:
  // A buffer for a [B, S, heads, dim] tensor (or a [B, heads, S, dim] one: same size).
  Buffer make_tensor(int64_t heads, int64_t dim) const {
    return Buffer(static_cast<size_t>(shape_.batch * shape_.seqlen * heads * dim) * 2);
  }

  // The view of heads [first_head, first_head + heads) of a buffer holding `total_heads` heads.
  TensorRef view(Buffer& buffer, int64_t heads, int64_t dim, int64_t first_head = 0,
                 int64_t total_heads = 0) {
    if (total_heads == 0) total_heads = heads;
    TensorRef ref;
    if (config_.layout == Layout::kBHSD) {
      ref.seq_stride = dim;
      ref.head_stride = shape_.seqlen * dim;
      ref.batch_stride = total_heads * shape_.seqlen * dim;
      ref.ptr = offset_bytes(buffer.data(), first_head * ref.head_stride * 2);
    } else {
      ref.head_stride = dim;
      ref.seq_stride = total_heads * dim;
      ref.batch_stride = shape_.seqlen * total_heads * dim;
      ref.ptr = offset_bytes(buffer.data(), first_head * ref.head_stride * 2);
    }
    return ref;
  }

  bool packed() const { return config_.layout == Layout::kPacked; }
  int64_t qkv_heads() const { return shape_.num_heads + 2 * shape_.num_kv_heads; }
  int64_t proxy_heads() const { return shape_.num_proxy_heads + shape_.num_proxy_kv_heads; }

  TensorRef main_view(Buffer& own, Buffer& packed_buffer, int64_t heads, int64_t first_head) {
    return packed() ? view(packed_buffer, heads, shape_.head_dim, first_head, qkv_heads())
                    : view(own, heads, shape_.head_dim);
  }
  TensorRef proxy_view(Buffer& own, Buffer& packed_buffer, int64_t heads, int64_t first_head) {
    return packed() ? view(packed_buffer, heads, shape_.proxy_head_dim, first_head, proxy_heads())
                    : view(own, heads, shape_.proxy_head_dim);
  }

  TensorRef q() { return main_view(q_, qkv_, shape_.num_heads, 0); }
  TensorRef k() { return main_view(k_, qkv_, shape_.num_kv_heads, shape_.num_heads); }
  TensorRef v() {
    return main_view(v_, qkv_, shape_.num_kv_heads, shape_.num_heads + shape_.num_kv_heads);
  }
  TensorRef dq() { return main_view(dq_, dqkv_, shape_.num_heads, 0); }
  TensorRef dk() { return main_view(dk_, dqkv_, shape_.num_kv_heads, shape_.num_heads); }
  TensorRef dv() {
    return main_view(dv_, dqkv_, shape_.num_kv_heads, shape_.num_heads + shape_.num_kv_heads);
  }
  TensorRef q_proxy() { return proxy_view(q_proxy_, proxies_, shape_.num_proxy_heads, 0); }
  TensorRef k_proxy() {
    return proxy_view(k_proxy_, proxies_, shape_.num_proxy_kv_heads, shape_.num_proxy_heads);
  }
  TensorRef dq_proxy() { return proxy_view(dq_proxy_, dproxies_, shape_.num_proxy_heads, 0); }
  TensorRef dk_proxy() {
    return proxy_view(dk_proxy_, dproxies_, shape_.num_proxy_kv_heads, shape_.num_proxy_heads);
  }

  Config config_;
  ProblemShape shape_;
  Buffer q_, k_, v_, q_proxy_, k_proxy_, dq_, dk_, dv_, dq_proxy_, dk_proxy_;
  Buffer qkv_, dqkv_, proxies_, dproxies_;
  Buffer out_, dout_, block_idx_, lse_, proxy_lse_, kl_, kl_grad_, schedule_, workspace_;
};

// S = 200 is not a multiple of 128 (the last block is partial), and K = 16 > NB = 2 is valid.
const Config kPaper = {"paper_bshd", 2, 200, 64, 4, 4, 1, 16, DType::kBF16, Layout::kBSHD};
const Config kPaperPacked = {"paper_packed", 2, 200, 64, 4, 4, 1, 16, DType::kBF16,
                             Layout::kPacked};
// H/Hp = 256 (valid by SPEC.md): no 128-row tile of the schedule holds one token's heads, so every
// sparse-mode op refuses it as unsupported.
const Config kManyHeadsPerProxy = {"h256_hp1", 1, 256, 256, 1, 1, 1, 2, DType::kBF16,
                                   Layout::kBSHD};

const std::vector<Config> kValidConfigs = {
    kPaper,
    kPaperPacked,
    {"paper_bhsd", 2, 200, 64, 4, 4, 1, 16, DType::kBF16, Layout::kBHSD},
    {"specialized_bshd", 1, 256, 64, 4, 16, 1, 16, DType::kBF16, Layout::kBSHD},
    {"specialized_bhsd_fp16", 1, 300, 64, 4, 16, 1, 8, DType::kFP16, Layout::kBHSD},
    {"seed_bshd", 2, 129, 16, 2, 4, 1, 16, DType::kBF16, Layout::kBSHD},
    {"seed_bhsd_one_token", 3, 1, 16, 2, 4, 1, 1, DType::kFP16, Layout::kBHSD},
    {"seed_packed_top_k_64", 1, 130, 16, 2, 4, 1, 64, DType::kBF16, Layout::kPacked},
    {"mha_single_heads", 1, 7, 1, 1, 1, 1, 1, DType::kBF16, Layout::kBSHD},
};

// One Problem per configuration, built on first use and shared by every test.
Problem& problem(const Config& config) {
  static std::map<std::string, Problem> problems;
  auto found = problems.find(config.name);
  if (found == problems.end()) found = problems.emplace(config.name, Problem(config)).first;
  return found->second;
}

// ---------------------------------------------------------------------------------------------
// Valid configurations: every op accepts them, in both modes
// ---------------------------------------------------------------------------------------------

void PrintTo(const Config& config, std::ostream* os) { *os << config.name; }

class ValidConfig : public testing::TestWithParam<Config> {};

TEST_P(ValidConfig, EveryOpAccepts) {
  Problem& p = problem(GetParam());
  for (const Status& status :
       {validate(p.select_params()), validate(p.schedule_params()),
        validate(p.forward_params(Mode::kSparse)), validate(p.forward_params(Mode::kWarmup)),
        validate(p.backward_params(Mode::kSparse)), validate(p.backward_params(Mode::kWarmup))}) {
    EXPECT_TRUE(status.ok()) << status.message;
  }
}

INSTANTIATE_TEST_SUITE_P(Validation, ValidConfig, testing::ValuesIn(kValidConfigs),
                         [](const testing::TestParamInfo<Config>& config_info) {
                           return std::string(config_info.param.name);
                         });

TEST(ValidParams, WarmupNeedsNoSelection) {
  Problem& p = problem(kPaper);
  ForwardParams forward = p.forward_params(Mode::kWarmup);
  forward.block_idx = nullptr;
  forward.schedule = nullptr;
  EXPECT_TRUE(validate(forward).ok()) << validate(forward).message;

  BackwardParams backward = p.backward_params(Mode::kWarmup);
  backward.fwd.block_idx = nullptr;
  backward.fwd.schedule = nullptr;
  EXPECT_TRUE(validate(backward).ok()) << validate(backward).message;
}

// Warmup with the main branch elsewhere: the tensors of the main branch are not read or written.
TEST(ValidParams, WarmupWithoutMainBranchNeedsNoMainTensors) {
  Problem& p = problem(kPaper);
  ForwardParams forward = p.forward_params(Mode::kWarmup);
  forward.main_branch = false;
  forward.v = {};
  forward.out = {};
  forward.lse = nullptr;
  EXPECT_TRUE(validate(forward).ok()) << validate(forward).message;

  BackwardParams backward = p.backward_params(Mode::kWarmup);
  backward.fwd.main_branch = false;
  backward.fwd.v = {};
  backward.fwd.out = {};
  backward.dout = {};
  backward.dq = {};
  backward.dk = {};
  backward.dv = {};
  EXPECT_TRUE(validate(backward).ok()) << validate(backward).message;
}

TEST(ValidParams, OptionalScalarsMayBeNull) {
  Problem& p = problem(kPaper);
  ForwardParams forward = p.forward_params();
  forward.kl = nullptr;
  EXPECT_TRUE(validate(forward).ok()) << validate(forward).message;

  BackwardParams backward = p.backward_params();
  backward.kl_grad = nullptr;
  EXPECT_TRUE(validate(backward).ok()) << validate(backward).message;
}

TEST(ValidParams, ExplicitScales) {
  Problem& p = problem(kPaper);
  ForwardParams forward = p.forward_params();
  forward.softmax_scale = 0.0883883f;
  forward.proxy_scale = 1.f;
  EXPECT_TRUE(validate(forward).ok()) << validate(forward).message;
}

TEST(ValidParams, InputsMayAliasEachOther) {
  Problem& p = problem(kPaper);
  BackwardParams backward = p.backward_params();
  backward.fwd.v = backward.fwd.k;  // k == v
  backward.dout = backward.fwd.out;
  backward.fwd.k_proxy = backward.fwd.q_proxy;  // proxy key head 0 is proxy query head 0
  EXPECT_TRUE(validate(backward).ok()) << validate(backward).message;
}

TEST(ValidParams, WorkspaceIsRequiredExactlyWhenSized) {
  Problem& p = problem(kPaper);
  ForwardParams forward = p.forward_params();
  forward.workspace = nullptr;
  const Status forward_status = validate(forward);
  if (forward_workspace_size(forward.shape, forward.mode) == 0) {
    EXPECT_TRUE(forward_status.ok()) << forward_status.message;
  } else {
    EXPECT_EQ(forward_status.code, StatusCode::kInvalidArgument);
    EXPECT_EQ(forward_status.message.rfind("workspace:", 0), 0u) << forward_status.message;
  }

  ScheduleParams schedule = p.schedule_params();
  schedule.workspace = nullptr;
  const Status schedule_status = validate(schedule);
  if (schedule_workspace_size(schedule.shape) == 0) {
    EXPECT_TRUE(schedule_status.ok()) << schedule_status.message;
  } else {
    EXPECT_EQ(schedule_status.code, StatusCode::kInvalidArgument);
    EXPECT_EQ(schedule_status.message.rfind("workspace:", 0), 0u) << schedule_status.message;
  }

  BackwardParams backward = p.backward_params();
  backward.workspace = nullptr;
  const Status backward_status = validate(backward);
  if (backward_workspace_size(backward.fwd.shape, backward.fwd.mode, false) == 0) {
    EXPECT_TRUE(backward_status.ok()) << backward_status.message;
  } else {
    EXPECT_EQ(backward_status.code, StatusCode::kInvalidArgument);
    EXPECT_EQ(backward_status.message.rfind("workspace:", 0), 0u) << backward_status.message;
  }
}

// The size queries are total: a shape the ops refuse sizes to 0 (and returns at once: an invalid
// top_k once made the chunk search loop forever, H/Hp > 128 divided by zero).
TEST(WorkspaceSizes, ZeroForShapesTheOpsRefuse) {
  const ProblemShape paper = cases::problem_shape(1, 4096, 64, 4, 4, 1, 16);
  ASSERT_GT(schedule_workspace_size(paper), 0u);
  ASSERT_GT(forward_workspace_size(paper, Mode::kSparse), 0u);
  ASSERT_GT(backward_workspace_size(paper, Mode::kSparse, false), 0u);
  ASSERT_GT(backward_workspace_size(paper, Mode::kWarmup, false), 0u);
  auto with = [&](const std::function<void(ProblemShape&)>& change) {
    ProblemShape shape = paper;
    change(shape);
    return shape;
  };
  struct Refused {
    const char* name;
    ProblemShape shape;
    bool warmup_too;  // refused by the warmup ops as well (no schedule there)
  };
  const Refused refused[] = {
      {"top_k 0", with([](ProblemShape& s) { s.top_k = 0; }), true},
      {"top_k -3", with([](ProblemShape& s) { s.top_k = -3; }), true},
      {"no heads", ProblemShape{}, true},
      {"seqlen -5", with([](ProblemShape& s) { s.seqlen = -5; }), true},
      {"head_dim 64", with([](ProblemShape& s) { s.head_dim = s.proxy_head_dim = 64; }), true},
      {"H/Hp 256", cases::problem_shape(1, 1024, 256, 1, 1, 1, 16), false},
      {"S 2^26", cases::problem_shape(1, int64_t(1) << 26, 4, 1, 1, 1, 1), false},
  };
  for (const Refused& r : refused) {
    SCOPED_TRACE(r.name);
    EXPECT_EQ(schedule_workspace_size(r.shape), 0u);
    EXPECT_EQ(forward_workspace_size(r.shape, Mode::kSparse), 0u);
    EXPECT_EQ(backward_workspace_size(r.shape, Mode::kSparse, false), 0u);
    EXPECT_EQ(backward_workspace_size(r.shape, Mode::kSparse, true), 0u);
    if (r.warmup_too) {
      EXPECT_EQ(backward_workspace_size(r.shape, Mode::kWarmup, false), 0u);
    } else {
      EXPECT_GT(backward_workspace_size(r.shape, Mode::kWarmup, false), 0u);
    }
  }
  EXPECT_EQ(forward_workspace_size(paper, static_cast<Mode>(7)), 0u);
  EXPECT_EQ(backward_workspace_size(paper, static_cast<Mode>(7), false), 0u);
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: one named case each
// ---------------------------------------------------------------------------------------------

struct BadCase {
  const char* name;
  std::function<Status()> run;  // builds valid params, breaks one rule, validates
  StatusCode code;
  const char* argument;  // the message must start with "<argument>:"
  const char* detail;    // and contain this (the rule, or the other argument); "" for none
};

std::function<Status()> on_select(std::function<void(SelectParams&)> change) {
  return [change] {
    SelectParams params = problem(kPaper).select_params();
    change(params);
    return validate(params);
  };
}

std::function<Status()> on_schedule(std::function<void(ScheduleParams&)> change,
                                    const Config& config = kPaper) {
  return [change, config] {
    ScheduleParams params = problem(config).schedule_params();
    change(params);
    return validate(params);
  };
}

std::function<Status()> on_forward(std::function<void(ForwardParams&)> change,
                                   const Config& config = kPaper) {
  return [change, config] {
    ForwardParams params = problem(config).forward_params();
    change(params);
    return validate(params);
  };
}

std::function<Status()> on_backward(std::function<void(BackwardParams&)> change,
                                    const Config& config = kPaper) {
  return [change, config] {
    BackwardParams params = problem(config).backward_params();
    change(params);
    return validate(params);
  };
}

constexpr StatusCode kInvalid = StatusCode::kInvalidArgument;
constexpr StatusCode kUnsupported = StatusCode::kUnsupported;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

const std::vector<BadCase> kBadCases = {
    // ---- shape ----
    {"batch_zero", on_select([](SelectParams& p) { p.shape.batch = 0; }), kInvalid, "shape.batch",
     "got 0"},
    {"seqlen_zero", on_forward([](ForwardParams& p) { p.shape.seqlen = 0; }), kInvalid,
     "shape.seqlen", "got 0"},
    {"seqlen_negative", on_schedule([](ScheduleParams& p) { p.shape.seqlen = -5; }), kInvalid,
     "shape.seqlen", "got -5"},
    {"seqlen_past_int32", on_forward([](ForwardParams& p) { p.shape.seqlen = int64_t{1} << 31; }),
     kInvalid, "shape.seqlen", "2147483648"},
    {"num_heads_zero", on_forward([](ForwardParams& p) { p.shape.num_heads = 0; }), kInvalid,
     "shape.num_heads", "got 0"},
    {"num_kv_heads_negative", on_forward([](ForwardParams& p) { p.shape.num_kv_heads = -4; }),
     kInvalid, "shape.num_kv_heads", "got -4"},
    {"num_proxy_heads_zero", on_select([](SelectParams& p) { p.shape.num_proxy_heads = 0; }),
     kInvalid, "shape.num_proxy_heads", "got 0"},
    {"num_proxy_kv_heads_zero", on_select([](SelectParams& p) { p.shape.num_proxy_kv_heads = 0; }),
     kInvalid, "shape.num_proxy_kv_heads", "got 0"},
    {"heads_not_multiple_of_kv_heads",
     on_forward([](ForwardParams& p) { p.shape.num_kv_heads = 6; }), kInvalid, "shape.num_heads",
     "H % Hkv == 0), got H=64, Hkv=6"},
    {"heads_not_multiple_of_proxy_heads", on_forward([](ForwardParams& p) {
       p.shape.num_kv_heads = 2;
       p.shape.num_proxy_heads = 6;
     }),
     kInvalid, "shape.num_heads", "H % Hp == 0), got H=64, Hp=6"},
    {"proxy_heads_not_multiple_of_proxy_kv_heads",
     on_select([](SelectParams& p) { p.shape.num_proxy_kv_heads = 3; }), kInvalid,
     "shape.num_proxy_heads", "Hp % Hpk == 0), got Hp=4, Hpk=3"},
    {"proxy_group_spans_kv_groups", on_forward([](ForwardParams& p) { p.shape.num_kv_heads = 8; }),
     kInvalid, "shape.num_proxy_heads", "got Hp=4, Hkv=8"},
    {"top_k_zero", on_select([](SelectParams& p) { p.shape.top_k = 0; }), kInvalid, "shape.top_k",
     "must be in [1, 64], got 0"},
    {"top_k_65", on_forward([](ForwardParams& p) { p.shape.top_k = 65; }), kInvalid, "shape.top_k",
     "got 65"},
    {"schedule_top_k_negative", on_schedule([](ScheduleParams& p) { p.shape.top_k = -1; }),
     kInvalid, "shape.top_k", "got -1"},
    {"head_dim_zero", on_forward([](ForwardParams& p) { p.shape.head_dim = 0; }), kInvalid,
     "shape.head_dim", "got 0"},
    {"proxy_head_dim_negative", on_select([](SelectParams& p) { p.shape.proxy_head_dim = -128; }),
     kInvalid, "shape.proxy_head_dim", "got -128"},
    {"sizes_overflow_int64", on_forward([](ForwardParams& p) {
       p.shape.batch = int64_t{1} << 40;
       p.shape.seqlen = int64_t{1} << 20;
     }),
     kInvalid, "shape", "overflow int64"},

    // ---- enums and scales ----
    {"dtype_out_of_range", on_select([](SelectParams& p) { p.dtype = static_cast<DType>(7); }),
     kInvalid, "dtype", "got 7"},
    {"mode_out_of_range", on_forward([](ForwardParams& p) { p.mode = static_cast<Mode>(5); }),
     kInvalid, "mode", "got 5"},
    {"proxy_scale_nan", on_select([](SelectParams& p) { p.proxy_scale = kNaN; }), kInvalid,
     "proxy_scale", "finite"},
    {"softmax_scale_negative", on_forward([](ForwardParams& p) { p.softmax_scale = -0.5f; }),
     kInvalid, "softmax_scale", "got -0.5"},
    {"softmax_scale_infinite", on_forward([](ForwardParams& p) { p.softmax_scale = kInf; }),
     kInvalid, "softmax_scale", "got inf"},

    // ---- unsupported but valid ----
    {"head_dim_64_unsupported", on_forward([](ForwardParams& p) { p.shape.head_dim = 64; }),
     kUnsupported, "shape.head_dim", "bf16       128       128"},
    {"proxy_head_dim_64_unsupported",
     on_select([](SelectParams& p) { p.shape.proxy_head_dim = 64; }), kUnsupported,
     "shape.proxy_head_dim", "supported combinations"},
    {"invalid_before_unsupported", on_forward([](ForwardParams& p) {
       p.shape.head_dim = 64;
       p.q.ptr = nullptr;
     }),
     kInvalid, "q.ptr", "must not be null"},

    // ---- required pointers ----
    {"select_q_proxy_null", on_select([](SelectParams& p) { p.q_proxy.ptr = nullptr; }), kInvalid,
     "q_proxy.ptr", "must not be null"},
    {"select_block_idx_null", on_select([](SelectParams& p) { p.block_idx = nullptr; }), kInvalid,
     "block_idx", "must not be null"},
    {"schedule_block_idx_null", on_schedule([](ScheduleParams& p) { p.block_idx = nullptr; }),
     kInvalid, "block_idx", "must not be null"},
    {"forward_v_null", on_forward([](ForwardParams& p) { p.v.ptr = nullptr; }), kInvalid, "v.ptr",
     "must not be null"},
    {"forward_block_idx_null_sparse", on_forward([](ForwardParams& p) { p.block_idx = nullptr; }),
     kInvalid, "block_idx", "must not be null"},
    {"forward_schedule_null_sparse", on_forward([](ForwardParams& p) { p.schedule = nullptr; }),
     kInvalid, "schedule", "must not be null"},
    {"forward_out_null", on_forward([](ForwardParams& p) { p.out.ptr = nullptr; }), kInvalid,
     "out.ptr", "must not be null"},
    {"forward_lse_null", on_forward([](ForwardParams& p) { p.lse = nullptr; }), kInvalid, "lse",
     "must not be null"},
    {"forward_proxy_lse_null", on_forward([](ForwardParams& p) { p.proxy_lse = nullptr; }),
     kInvalid, "proxy_lse", "must not be null"},
    {"backward_fwd_out_null", on_backward([](BackwardParams& p) { p.fwd.out.ptr = nullptr; }),
     kInvalid, "fwd.out.ptr", "must not be null"},
    {"backward_fwd_lse_null", on_backward([](BackwardParams& p) { p.fwd.lse = nullptr; }), kInvalid,
     "fwd.lse", "must not be null"},
    {"backward_fwd_block_idx_null",
     on_backward([](BackwardParams& p) { p.fwd.block_idx = nullptr; }), kInvalid, "fwd.block_idx",
     "must not be null"},
    {"backward_dout_null", on_backward([](BackwardParams& p) { p.dout.ptr = nullptr; }), kInvalid,
     "dout.ptr", "must not be null"},
    {"backward_dq_null", on_backward([](BackwardParams& p) { p.dq.ptr = nullptr; }), kInvalid,
     "dq.ptr", "must not be null"},
    {"backward_dk_proxy_null", on_backward([](BackwardParams& p) { p.dk_proxy.ptr = nullptr; }),
     kInvalid, "dk_proxy.ptr", "must not be null"},

    // ---- alignment ----
    {"q_misaligned", on_forward([](ForwardParams& p) { p.q.ptr = offset_bytes(p.q.ptr, 2); }),
     kInvalid, "q.ptr", "16-byte aligned"},
    {"k_proxy_misaligned",
     on_select([](SelectParams& p) { p.k_proxy.ptr = offset_bytes(p.k_proxy.ptr, 8); }), kInvalid,
     "k_proxy.ptr", "16-byte aligned"},
    {"block_idx_misaligned", on_select([](SelectParams& p) {
       p.block_idx = static_cast<int32_t*>(offset_bytes(p.block_idx, 2));
     }),
     kInvalid, "block_idx", "4-byte aligned"},
    {"lse_misaligned",
     on_forward([](ForwardParams& p) { p.lse = static_cast<float*>(offset_bytes(p.lse, 1)); }),
     kInvalid, "lse", "4-byte aligned"},
    {"kl_misaligned",
     on_forward([](ForwardParams& p) { p.kl = static_cast<float*>(offset_bytes(p.kl, 2)); }),
     kInvalid, "kl", "4-byte aligned"},
    {"kl_grad_misaligned", on_backward([](BackwardParams& p) {
       p.kl_grad = static_cast<const float*>(offset_bytes(p.kl_grad, 2));
     }),
     kInvalid, "kl_grad", "4-byte aligned"},
    {"schedule_misaligned",
     on_forward([](ForwardParams& p) { p.schedule = offset_bytes(p.schedule, 4); }), kInvalid,
     "schedule", "16-byte aligned"},
    {"dv_misaligned", on_backward([](BackwardParams& p) { p.dv.ptr = offset_bytes(p.dv.ptr, 2); }),
     kInvalid, "dv.ptr", "16-byte aligned"},

    // ---- strides ----
    {"q_seq_stride_not_multiple_of_8", on_forward([](ForwardParams& p) { p.q.seq_stride += 4; }),
     kInvalid, "q.seq_stride", "multiple of 8 elements"},
    {"k_head_stride_zero", on_forward([](ForwardParams& p) { p.k.head_stride = 0; }), kInvalid,
     "k.head_stride", "got 0"},
    {"v_batch_stride_negative",
     on_forward([](ForwardParams& p) { p.v.batch_stride = -p.v.batch_stride; }), kInvalid,
     "v.batch_stride", "positive"},
    {"q_proxy_heads_overlap", on_select([](SelectParams& p) { p.q_proxy.head_stride = 64; }),
     kInvalid, "q_proxy.head_stride", "got 64 < 128"},
    {"fwd_k_proxy_stride_not_multiple_of_8",
     on_backward([](BackwardParams& p) { p.fwd.k_proxy.batch_stride += 2; }), kInvalid,
     "fwd.k_proxy.batch_stride", "multiple of 8"},
    {"dq_proxy_head_stride_not_multiple_of_8",
     on_backward([](BackwardParams& p) { p.dq_proxy.head_stride = 132; }), kInvalid,
     "dq_proxy.head_stride", "got 132"},
    {"q_addresses_past_int64",
     on_forward([](ForwardParams& p) { p.q.batch_stride = int64_t{1} << 62; }), kInvalid, "q",
     "more than 2^63 bytes"},

    // ---- outputs must not alias themselves ----
    {"out_rows_overlap", on_forward([](ForwardParams& p) { p.out.seq_stride = 8 * 128; }), kInvalid,
     "out.seq_stride", "must not overlap"},
    {"dq_batches_overlap",
     on_backward([](BackwardParams& p) { p.dq.batch_stride = 100 * p.dq.seq_stride; }), kInvalid,
     "dq.batch_stride", "must not overlap"},
    {"dk_proxy_rows_overlap", on_backward([](BackwardParams& p) { p.dk_proxy.seq_stride = 64; }),
     kInvalid, "dk_proxy.seq_stride", "must not overlap"},

    // ---- outputs must not share memory with inputs or other outputs ----
    {"out_aliases_q", on_forward([](ForwardParams& p) { p.out = p.q; }), kInvalid, "out",
     "the input q "},
    {"lse_inside_out", on_forward([](ForwardParams& p) { p.lse = static_cast<float*>(p.out.ptr); }),
     kInvalid, "lse", "the output out "},
    {"proxy_lse_overlaps_lse", on_forward([](ForwardParams& p) { p.proxy_lse = p.lse + 4; }),
     kInvalid, "proxy_lse", "the output lse "},
    {"kl_inside_block_idx", on_forward([](ForwardParams& p) {
       p.kl = static_cast<float*>(offset_bytes(p.block_idx, 64));
     }),
     kInvalid, "kl", "the input block_idx "},
    {"block_idx_inside_q_proxy", on_select([](SelectParams& p) {
       p.block_idx = static_cast<int32_t*>(offset_bytes(p.q_proxy.ptr, 4096));
     }),
     kInvalid, "block_idx", "the input q_proxy "},
    {"dk_aliases_fwd_k", on_backward([](BackwardParams& p) { p.dk = p.fwd.k; }), kInvalid, "dk",
     "the input fwd.k "},
    {"dq_aliases_dout", on_backward([](BackwardParams& p) { p.dq = p.dout; }), kInvalid, "dq",
     "the input dout "},
    {"schedule_workspace_overlaps_block_idx",
     on_schedule([](ScheduleParams& p) { p.workspace = const_cast<int32_t*>(p.block_idx) + 16; }),
     kInvalid, "workspace", "the input block_idx "},
    {"dq_aliases_fwd_out", on_backward([](BackwardParams& p) { p.dq = p.fwd.out; }), kInvalid, "dq",
     "the input fwd.out "},
    {"dv_aliases_dk", on_backward([](BackwardParams& p) { p.dv = p.dk; }), kInvalid, "dv",
     "the output dk "},
    {"dq_proxy_aliases_fwd_q_proxy",
     on_backward([](BackwardParams& p) { p.dq_proxy = p.fwd.q_proxy; }), kInvalid, "dq_proxy",
     "the input fwd.q_proxy "},
    {"packed_dk_overlaps_last_dq_head",
     on_backward([](BackwardParams& p) { p.dk.ptr = offset_bytes(p.dq.ptr, (64 - 1) * 128 * 2); },
                 kPaperPacked),
     kInvalid, "dk", "the output dq "},
    {"packed_out_inside_qkv",
     on_forward([](ForwardParams& p) { p.out.ptr = p.v.ptr; }, kPaperPacked), kInvalid, "out",
     "the input q "},

    // ---- the backward checks its embedded forward params ----
    {"backward_fwd_top_k_zero", on_backward([](BackwardParams& p) { p.fwd.shape.top_k = 0; }),
     kInvalid, "fwd.shape.top_k", "got 0"},
    {"backward_fwd_dtype_out_of_range",
     on_backward([](BackwardParams& p) { p.fwd.dtype = static_cast<DType>(3); }), kInvalid,
     "fwd.dtype", "got 3"},
    {"backward_fwd_mode_negative",
     on_backward([](BackwardParams& p) { p.fwd.mode = static_cast<Mode>(-1); }), kInvalid,
     "fwd.mode", "got -1"},
    {"backward_fwd_proxy_scale_negative",
     on_backward([](BackwardParams& p) { p.fwd.proxy_scale = -1.f; }), kInvalid, "fwd.proxy_scale",
     "got -1"},
    {"backward_fwd_head_dim_unsupported",
     on_backward([](BackwardParams& p) { p.fwd.shape.head_dim = 64; }), kUnsupported,
     "fwd.shape.head_dim", "supported combinations"},
    {"backward_fwd_kl_misaligned",
     on_backward([](BackwardParams& p) { p.fwd.kl = static_cast<float*>(offset_bytes(p.fwd.kl, 2)); }),
     kInvalid, "fwd.kl", "aligned"},
    {"forward_main_branch_off_in_sparse_mode", on_forward([](ForwardParams& p) { p.main_branch = false; }),
     kInvalid, "main_branch", "warmup"},
    {"backward_main_branch_off_in_sparse_mode",
     on_backward([](BackwardParams& p) { p.fwd.main_branch = false; }), kInvalid, "fwd.main_branch", "warmup"},
    {"backward_without_main_branch_needs_lse", on_backward([](BackwardParams& p) {
       p.fwd.mode = Mode::kWarmup;
       p.fwd.main_branch = false;
       p.fwd.lse = nullptr;
     }),
     kInvalid, "fwd.lse", "null"},
    {"backward_fwd_kl_inside_dout", on_backward([](BackwardParams& p) {
       p.fwd.kl = static_cast<float*>(p.dout.ptr);
     }),
     kInvalid, "fwd.kl", "dout"},

    // ---- sparse mode: what the schedule's tiles and 32-bit indices cannot hold ----
    {"schedule_heads_per_proxy_over_128", on_schedule([](ScheduleParams&) {}, kManyHeadsPerProxy),
     kUnsupported, "shape", "H/Hp must be ≤ 128"},
    {"forward_heads_per_proxy_over_128", on_forward([](ForwardParams&) {}, kManyHeadsPerProxy),
     kUnsupported, "shape", "H/Hp must be ≤ 128"},
    {"backward_heads_per_proxy_over_128", on_backward([](BackwardParams&) {}, kManyHeadsPerProxy),
     kUnsupported, "fwd.shape", "H/Hp must be ≤ 128"},
    {"schedule_seqlen_2_pow_26",
     on_schedule([](ScheduleParams& p) { p.shape.seqlen = int64_t(1) << 26; }), kUnsupported,
     "shape", "S < 2^26"},
    // ---- the other kernels' limits, each stage's function (kernels/*/config.h) ----
    {"select_seqlen_over_8m",
     on_select([](SelectParams& p) {
       p.shape.seqlen = (int64_t(1) << 23) + 1;
       // validate() never dereferences: an output address far from the (now longer) inputs.
       p.block_idx = reinterpret_cast<int32_t*>(uintptr_t(1) << 44);
     }),
     kUnsupported, "shape.seqlen", "16 bits"},
    {"sparse_backward_heads_per_proxy_32", on_backward([](BackwardParams& p) {
       p.fwd.shape.num_proxy_heads = 2;  // H = 64: M = 32
       p.fwd.shape.num_kv_heads = 2;
     }),
     kUnsupported, "fwd.shape", "H/Hp ≤ 16"},
    {"warmup_forward_heads_per_proxy_over_128", on_forward([](ForwardParams& p) {
       p.mode = Mode::kWarmup;
     }, kManyHeadsPerProxy),
     kUnsupported, "shape", "H/Hp ≤ 128"},
    {"warmup_backward_heads_per_proxy_over_64", on_backward([](BackwardParams& p) {
       p.fwd.mode = Mode::kWarmup;
     }, kManyHeadsPerProxy),
     kUnsupported, "fwd.shape", "H/Hp ≤ 64"},
    {"kl_only_backward_deterministic", on_backward([](BackwardParams& p) {
       p.fwd.mode = Mode::kWarmup;
       p.fwd.main_branch = false;
       p.deterministic = true;
     }),
     kUnsupported, "deterministic", "atomics"},
    {"schedule_entries_2_pow_31", on_schedule([](ScheduleParams& p) {
       p.shape.seqlen = int64_t(1) << 25;  // B·Hp·S·K = 2·4·2^25·16 = 2^32 entries
     }),
     kUnsupported, "shape", "B·Hp·S·K < 2^31"},
};

void PrintTo(const BadCase& bad, std::ostream* os) { *os << bad.name; }

class BadInput : public testing::TestWithParam<BadCase> {};

TEST_P(BadInput, IsRefusedNamingTheArgument) {
  const BadCase& bad = GetParam();
  const Status status = bad.run();
  EXPECT_EQ(status.code, bad.code) << status.message;
  const std::string prefix = std::string(bad.argument) + ":";
  EXPECT_EQ(status.message.rfind(prefix, 0), 0u)
      << "expected the message to start with \"" << prefix << "\", got: " << status.message;
  EXPECT_NE(status.message.find(bad.detail), std::string::npos)
      << "expected \"" << bad.detail << "\" in: " << status.message;
}

INSTANTIATE_TEST_SUITE_P(Validation, BadInput, testing::ValuesIn(kBadCases),
                         [](const testing::TestParamInfo<BadCase>& case_info) {
                           return std::string(case_info.param.name);
                         });

// ---------------------------------------------------------------------------------------------
// Nothing is written on error: the public ops refuse bad params before they look for a device
// ---------------------------------------------------------------------------------------------

TEST(NothingWritten, SelectWithBadTopK) {
  Problem p(kPaper);
  SelectParams params = p.select_params();
  params.shape.top_k = 0;
  const Status status = select(params, nullptr);
  EXPECT_EQ(status.code, StatusCode::kInvalidArgument) << status.message;
  EXPECT_TRUE(p.untouched());
}

TEST(NothingWritten, ForwardWithOutAliasingQ) {
  Problem p(kPaper);
  ForwardParams params = p.forward_params();
  params.out = params.q;
  const Status status = forward(params, nullptr);
  EXPECT_EQ(status.code, StatusCode::kInvalidArgument) << status.message;
  EXPECT_TRUE(p.untouched());
}

TEST(NothingWritten, BackwardWithMisalignedDq) {
  Problem p(kPaper);
  BackwardParams params = p.backward_params();
  params.dq.ptr = offset_bytes(params.dq.ptr, 2);
  const Status status = backward(params, nullptr);
  EXPECT_EQ(status.code, StatusCode::kInvalidArgument) << status.message;
  EXPECT_TRUE(p.untouched());
}

TEST(NothingWritten, SparseForwardWithTooManyHeadsPerProxy) {
  Problem p(kManyHeadsPerProxy);
  const Status status = forward(p.forward_params(), nullptr);
  EXPECT_EQ(status.code, StatusCode::kUnsupported) << status.message;
  EXPECT_TRUE(p.untouched());
}

TEST(NothingWritten, ScheduleWithNullBlockIdx) {
  Problem p(kPaper);
  ScheduleParams params = p.schedule_params();
  params.block_idx = nullptr;
  const Status status = schedule(params, nullptr);
  EXPECT_EQ(status.code, StatusCode::kInvalidArgument) << status.message;
  EXPECT_TRUE(p.untouched());
}

}  // namespace
}  // namespace flashmsa
