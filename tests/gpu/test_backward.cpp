// GPU tests of the sparse backward (SPEC.md §3-§4): dq, dk, dv, dq_proxy, dk_proxy and the KL value
// against the fp64 reference with FA3's rule |kernel − fp64| ≤ 2·|reference in the input dtype −
// fp64| + atol, on fresh random inputs, with every output poisoned before the call.
//
// The saved forward tensors (out, lse, proxy_lse) come from the fp64 reference forward, rounded to
// their storage formats: the backward's contract needs only correct saved tensors.
// atol: 1e-4 of the largest |fp64| entry of each tensor (the dtype bound dominates) plus 1e-5 of the
// size of the summed terms (expect_rule); the KL value 1e-5 relative plus 1e-6 (fp32 sums of
// t·(log t − log π) terms that cancel). The reference runs on all host cores, split by query rows and key blocks.
//
// Cases: the named ones of correctness_cases(), kRandomCases random configurations (random_cases())
// and the deterministic-mode checks.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/patterns.h"
#include "gpu/gpu_test.h"
#include "gpu/host_tensors.h"
#include "gpu/random_draws.h"
#include "kernels/schedule/config.h"

namespace flashmsa {
namespace {

using host_tensors::DeviceTensor;
using host_tensors::download_tensor;
using host_tensors::host_threads;
using host_tensors::max_abs;
using host_tensors::merge;
using host_tensors::output_tensor;
using host_tensors::parallel_for;
using host_tensors::upload_floats;
using host_tensors::upload_tensor;
using patterns::Pattern;
using reference::Precision;
using testing::DeviceBuffer;

struct BackwardCase {
  std::string name;
  int64_t batch;
  int64_t seqlen;
  int num_heads;
  int num_kv_heads;
  int num_proxy_heads;
  int num_proxy_kv_heads;
  int top_k;
  DType dtype = DType::kBF16;
  Pattern pattern = Pattern::kRandom;
  bool bhsd = false;           // inputs and gradients in the [b, h, s, d] layout
  bool with_kl_grad = true;    // kl_grad non-null (else dq_proxy, dk_proxy must be zero)
  bool with_kl_value = true;   // fwd.kl non-null
  int sample = 0;              // 0: every row and block; else rows/blocks checked per batch
  int64_t first_checked_row = 0;  // > 0: `sample` rows from here on and the last block only
  double dout_scale = 1.0;     // dO times this power of two (gradient scales far from 1)
  double kv_scale = 1.0;       // K and V times this power of two
};

void PrintTo(const BackwardCase& c, std::ostream* os) { *os << c.name; }

ProblemShape shape_of(const BackwardCase& c) {
  return cases::problem_shape(c.batch, c.seqlen, c.num_heads, c.num_kv_heads, c.num_proxy_heads,
                              c.num_proxy_kv_heads, c.top_k);
}

// The reference forward over all rows, split across threads.
reference::ForwardOutputs parallel_forward(const reference::Inputs& in, const std::vector<int32_t>& block_idx,
                                           Precision precision) {
  const ProblemShape& s = in.shape;
  const int parts = host_threads();
  std::vector<reference::ForwardOutputs> outputs(parts);
  parallel_for(parts, [&](int part, int count) {
    reference::QueryRows rows;
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t i = part; i < s.seqlen; i += count) rows.push_back({b, i});
    }
    if (!rows.empty()) outputs[part] = reference::forward(in, block_idx, Mode::kSparse, precision, rows);
  });
  reference::ForwardOutputs all;
  for (const auto& out : outputs) {
    merge(all.out, out.out);
    merge(all.lse, out.lse);
    merge(all.proxy_lse, out.proxy_lse);
    merge(all.kl_rows, out.kl_rows);
  }
  double sum = 0.0;
  for (double kl_row : all.kl_rows) sum += kl_row;
  all.kl = sum / double(all.kl_rows.size());
  return all;
}

// The reference backward on `rows` and `blocks` (never empty here), split across threads.
reference::Gradients parallel_backward(const reference::Inputs& in, const std::vector<int32_t>& block_idx,
                                       const std::vector<double>& dout, double kl_grad, Precision precision,
                                       const reference::QueryRows& rows, const reference::KeyBlocks& blocks,
                                       const reference::ForwardOutputs& saved) {
  const int parts = std::min<int>(host_threads(), int(std::max(rows.size(), blocks.size())));
  std::vector<reference::Gradients> grads(parts);
  parallel_for(parts, [&](int part, int count) {
    reference::QueryRows my_rows;
    reference::KeyBlocks my_blocks;
    for (size_t e = part; e < rows.size(); e += count) my_rows.push_back(rows[e]);
    for (size_t e = part; e < blocks.size(); e += count) my_blocks.push_back(blocks[e]);
    // An empty subset means "all" to the reference: give it one item of the other side's list.
    if (my_rows.empty()) my_rows.push_back(rows.front());
    if (my_blocks.empty()) my_blocks.push_back(blocks.back());
    grads[part] =
        reference::backward(in, block_idx, dout, kl_grad, Mode::kSparse, precision, my_rows, my_blocks, &saved);
  });
  reference::Gradients all;
  for (const auto& g : grads) {
    merge(all.dq, g.dq);
    merge(all.dk, g.dk);
    merge(all.dv, g.dv);
    merge(all.dq_proxy, g.dq_proxy);
    merge(all.dk_proxy, g.dk_proxy);
  }
  return all;
}

// Rows / blocks to check: all, or per batch the first, last and `sample` random ones.
void checked_subsets(const BackwardCase& c, const ProblemShape& s, uint64_t seed, reference::QueryRows* rows,
                     reference::KeyBlocks* blocks) {
  std::mt19937_64 rng(seed);
  for (int64_t b = 0; b < s.batch; ++b) {
    if (c.sample == 0) {
      for (int64_t i = 0; i < s.seqlen; ++i) rows->push_back({b, i});
      for (int64_t block = 0; block < s.num_blocks(); ++block) blocks->push_back({b, block});
      continue;
    }
    if (c.first_checked_row > 0) {
      // Only rows past the first K blocks: every checked row sums K slots of about the same size, so
      // the atol (set by the largest checked |dq|) gives no room and the 2x term decides.
      std::vector<int64_t> picked = {s.seqlen - 1};
      for (int e = 0; e < c.sample; ++e) {
        picked.push_back(c.first_checked_row + int64_t(rng() % uint64_t(s.seqlen - c.first_checked_row)));
      }
      std::sort(picked.begin(), picked.end());
      picked.erase(std::unique(picked.begin(), picked.end()), picked.end());
      for (int64_t i : picked) rows->push_back({b, i});
      blocks->push_back({b, s.num_blocks() - 1});
      continue;
    }
    std::vector<int64_t> picked_rows = {0, 1, s.seqlen - 1};
    for (int e = 0; e < c.sample; ++e) picked_rows.push_back(int64_t(rng() % uint64_t(s.seqlen)));
    std::vector<int64_t> picked_blocks = {0, s.num_blocks() - 1};
    for (int e = 0; e < c.sample / 4 + 1; ++e) picked_blocks.push_back(int64_t(rng() % uint64_t(s.num_blocks())));
    std::sort(picked_rows.begin(), picked_rows.end());
    picked_rows.erase(std::unique(picked_rows.begin(), picked_rows.end()), picked_rows.end());
    std::sort(picked_blocks.begin(), picked_blocks.end());
    picked_blocks.erase(std::unique(picked_blocks.begin(), picked_blocks.end()), picked_blocks.end());
    for (int64_t i : picked_rows) rows->push_back({b, i});
    for (int64_t block : picked_blocks) blocks->push_back({b, block});
  }
}

std::vector<double> random_dout(const ProblemShape& s, uint64_t seed, DType dtype) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> dout(size_t(s.batch * s.seqlen * s.num_heads * s.head_dim));
  for (double& x : dout) x = testing::from_half_bits(testing::to_half_bits(normal(rng), dtype), dtype);
  return dout;
}

// The host problem of one case: inputs, selection, upstream gradients and saved forward tensors.
struct HostProblem {
  reference::Inputs in;
  std::vector<int32_t> block_idx;
  std::vector<double> dout;
  double kl_grad = 0.0;
  reference::ForwardOutputs saved;  // fp64 forward: out, lse, proxy_lse, kl
};

HostProblem make_host_problem(const BackwardCase& c, uint64_t seed) {
  HostProblem host;
  const ProblemShape s = shape_of(c);
  host.in = reference::random_inputs(s, seed, c.dtype);
  host.block_idx = patterns::make_selection(s, c.pattern, seed ^ 0x5eed);
  // Powers of two, so the scaled values are still exact in the input dtype.
  for (std::vector<double>* values : {&host.in.k, &host.in.v}) {
    for (double& x : *values) x *= c.kv_scale;
  }
  host.dout = random_dout(s, seed ^ 0xd0, c.dtype);
  for (double& x : host.dout) x *= c.dout_scale;
  host.kl_grad = c.with_kl_grad ? 0.75 + double(seed % 7) * 0.125 : 0.0;
  host.saved = parallel_forward(host.in, host.block_idx, Precision::kFP64);
  return host;
}

// Device buffers of one backward call; outputs poisoned.
struct DeviceProblem {
  DeviceTensor q, k, v, q_proxy, k_proxy, out, dout;
  DeviceTensor dq, dk, dv, dq_proxy, dk_proxy;
  DeviceBuffer<int32_t> block_idx;
  DeviceBuffer<float> lse, proxy_lse, kl, kl_grad;
  DeviceBuffer<char> schedule, workspace;
  BackwardParams params;
};

void make_device_problem(const BackwardCase& c, const HostProblem& host, bool deterministic, DeviceProblem& d) {
  const ProblemShape s = shape_of(c);
  const DType t = c.dtype;
  d.q = upload_tensor(host.in.q, s, s.num_heads, 128, t, c.bhsd);
  d.k = upload_tensor(host.in.k, s, s.num_kv_heads, 128, t, c.bhsd);
  d.v = upload_tensor(host.in.v, s, s.num_kv_heads, 128, t, c.bhsd);
  d.q_proxy = upload_tensor(host.in.q_proxy, s, s.num_proxy_heads, 128, t, c.bhsd);
  d.k_proxy = upload_tensor(host.in.k_proxy, s, s.num_proxy_kv_heads, 128, t, c.bhsd);
  d.out = upload_tensor(host.saved.out, s, s.num_heads, 128, t, c.bhsd);
  d.dout = upload_tensor(host.dout, s, s.num_heads, 128, t, c.bhsd);
  d.dq = output_tensor(s, s.num_heads, 128, c.bhsd);
  d.dk = output_tensor(s, s.num_kv_heads, 128, c.bhsd);
  d.dv = output_tensor(s, s.num_kv_heads, 128, c.bhsd);
  d.dq_proxy = output_tensor(s, s.num_proxy_heads, 128, c.bhsd);
  d.dk_proxy = output_tensor(s, s.num_proxy_kv_heads, 128, c.bhsd);
  d.block_idx = DeviceBuffer<int32_t>(host.block_idx.size());
  d.block_idx.upload(host.block_idx);
  d.lse = upload_floats(host.saved.lse);
  d.proxy_lse = upload_floats(host.saved.proxy_lse);
  d.kl = DeviceBuffer<float>(1);
  d.kl.poison();
  d.kl_grad = upload_floats({host.kl_grad});
  d.schedule = DeviceBuffer<char>(std::max<size_t>(256, schedule_workspace_size(s)));
  d.workspace =
      DeviceBuffer<char>(std::max<size_t>(256, backward_workspace_size(s, Mode::kSparse, deterministic, c.dtype)));
  d.workspace.poison();
  // The forward's schedule of block_idx, which the backward walks (params.h: fwd.schedule).
  ScheduleParams schedule_params;
  schedule_params.shape = s;
  schedule_params.block_idx = d.block_idx.get();
  schedule_params.workspace = d.schedule.get();
  const Status scheduled = schedule(schedule_params, nullptr);
  EXPECT_TRUE(scheduled.ok()) << scheduled.message;

  BackwardParams& p = d.params;
  p.fwd.shape = s;
  p.fwd.dtype = t;
  p.fwd.mode = Mode::kSparse;
  p.fwd.q = d.q.ref;
  p.fwd.k = d.k.ref;
  p.fwd.v = d.v.ref;
  p.fwd.q_proxy = d.q_proxy.ref;
  p.fwd.k_proxy = d.k_proxy.ref;
  p.fwd.block_idx = d.block_idx.get();
  p.fwd.schedule = d.schedule.get();
  p.fwd.out = d.out.ref;
  p.fwd.lse = d.lse.get();
  p.fwd.proxy_lse = d.proxy_lse.get();
  p.fwd.kl = c.with_kl_value ? d.kl.get() : nullptr;
  p.dout = d.dout.ref;
  p.kl_grad = c.with_kl_grad ? d.kl_grad.get() : nullptr;
  p.deterministic = deterministic;
  p.dq = d.dq.ref;
  p.dk = d.dk.ref;
  p.dv = d.dv.ref;
  p.dq_proxy = d.dq_proxy.ref;
  p.dk_proxy = d.dk_proxy.ref;
  p.workspace = d.workspace.get();
}

struct KernelGradients {
  std::vector<double> dq, dk, dv, dq_proxy, dk_proxy;
  double kl = 0.0;
};

KernelGradients download_gradients(const BackwardCase& c, const DeviceProblem& d) {
  const ProblemShape s = shape_of(c);
  KernelGradients g;
  g.dq = download_tensor(d.dq, s, s.num_heads, 128, c.dtype, c.bhsd);
  g.dk = download_tensor(d.dk, s, s.num_kv_heads, 128, c.dtype, c.bhsd);
  g.dv = download_tensor(d.dv, s, s.num_kv_heads, 128, c.dtype, c.bhsd);
  g.dq_proxy = download_tensor(d.dq_proxy, s, s.num_proxy_heads, 128, c.dtype, c.bhsd);
  g.dk_proxy = download_tensor(d.dk_proxy, s, s.num_proxy_kv_heads, 128, c.dtype, c.bhsd);
  g.kl = double(d.kl.download()[0]);
  return g;
}

// `floor`: the fp32 rounding of the kernel's sums where the exact result cancels to (near) zero
// (S = 1: P = 1 gives dq = dk = 0 and π = t, so dq_proxy = dk_proxy = 0), at 1e-5 of the size of
// the summed terms; the rounded reference is exact there, so the 2x term gives no room.
void expect_rule(const char* name, const std::vector<double>& kernel, const std::vector<double>& exact,
                 const std::vector<double>& rounded, double floor) {
  const testing::ErrorReport report = testing::fa3_rule(kernel, exact, rounded, 1e-4 * max_abs(exact) + floor);
  EXPECT_TRUE(report.ok) << report.describe(name);
}

// The five gradients under expect_rule. Term sizes for the floors: dO·V products for the main
// gradients (|dv| is their scale and never cancels); ḡσp/(B·Hp·S)·|proxy inputs| for the proxy
// gradients (|π − t| ≤ 1). Without kl_grad the proxy gradients are checked by the caller.
void expect_gradients(const KernelGradients& g, const reference::Gradients& exact, const reference::Gradients& rounded,
                      const HostProblem& host, double kl_grad) {
  const ProblemShape& s = host.in.shape;
  const double main_floor = 1e-5 * max_abs(exact.dv);
  expect_rule("dq", g.dq, exact.dq, rounded.dq, main_floor);
  expect_rule("dk", g.dk, exact.dk, rounded.dk, main_floor);
  expect_rule("dv", g.dv, exact.dv, rounded.dv, main_floor);
  if (kl_grad == 0.0) return;
  const double proxy_floor = 1e-5 * kl_grad / std::sqrt(double(s.proxy_head_dim)) /
                             double(s.batch * s.num_proxy_heads * s.seqlen) *
                             std::max(max_abs(host.in.k_proxy), max_abs(host.in.q_proxy));
  expect_rule("dq_proxy", g.dq_proxy, exact.dq_proxy, rounded.dq_proxy, proxy_floor);
  expect_rule("dk_proxy", g.dk_proxy, exact.dk_proxy, rounded.dk_proxy, proxy_floor);
}

// Runs the backward once, directly on the legacy stream or captured into a CUDA graph on a
// non-blocking stream and replayed (the outputs stay poisoned until the replay).
void run_backward(const BackwardParams& params, bool via_graph) {
  const Status status = via_graph ? testing::run_as_graph([&](cudaStream_t stream) { return backward(params, stream); })
                                  : backward(params, nullptr);
  ASSERT_TRUE(status.ok()) << status.message;
  FLASHMSA_CUDA_CHECK(cudaDeviceSynchronize());
}

void check_case(const BackwardCase& c, uint64_t seed, bool via_graph = false) {
  const ProblemShape s = shape_of(c);
  const HostProblem host = make_host_problem(c, seed);
  DeviceProblem d;
  make_device_problem(c, host, /*deterministic=*/false, d);
  run_backward(d.params, via_graph);
  if (::testing::Test::HasFatalFailure()) return;
  const KernelGradients g = download_gradients(c, d);

  reference::QueryRows rows;
  reference::KeyBlocks blocks;
  checked_subsets(c, s, seed, &rows, &blocks);
  const double kl_grad = c.with_kl_grad ? host.kl_grad : 0.0;
  const Precision rounded_precision = reference::precision_of(c.dtype);
  auto exact_future = std::async(std::launch::async, [&] {
    return parallel_backward(host.in, host.block_idx, host.dout, kl_grad, Precision::kFP64, rows, blocks, host.saved);
  });
  const reference::Gradients rounded =
      parallel_backward(host.in, host.block_idx, host.dout, kl_grad, rounded_precision, rows, blocks, host.saved);
  const reference::Gradients exact = exact_future.get();

  expect_gradients(g, exact, rounded, host, kl_grad);
  if (!c.with_kl_grad) {
    EXPECT_EQ(max_abs(g.dq_proxy), 0.0) << "dq_proxy must be zero without kl_grad";
    EXPECT_EQ(max_abs(g.dk_proxy), 0.0) << "dk_proxy must be zero without kl_grad";
    EXPECT_EQ(testing::fa3_rule(g.dq_proxy, g.dq_proxy, g.dq_proxy, 0.0).nan_count, 0);
    EXPECT_EQ(testing::fa3_rule(g.dk_proxy, g.dk_proxy, g.dk_proxy, 0.0).nan_count, 0);
  }
  if (c.with_kl_value) {
    const reference::ForwardOutputs rounded_forward = parallel_forward(host.in, host.block_idx, rounded_precision);
    const testing::ErrorReport report =
        testing::fa3_rule({g.kl}, {host.saved.kl}, {rounded_forward.kl}, 1e-5 * std::fabs(host.saved.kl) + 1e-6);
    EXPECT_TRUE(report.ok) << report.describe("kl") << " (kernel " << g.kl << ", fp64 " << host.saved.kl << ")";
  }
}

// ---------------------------------------------------------------------------------------------
// Cases: named configurations scaled down, odd head maps, patterns, both dtypes, K edge cases.
// ---------------------------------------------------------------------------------------------
std::vector<BackwardCase> correctness_cases() {
  std::vector<BackwardCase> list;
  //            name                  B  S     H   Hkv Hp  Hpk K
  list.push_back({"paper_like_bf16", 1, 384, 16, 1, 1, 1, 2});
  list.push_back({"paper_like_fp16", 1, 300, 16, 1, 1, 1, 2, DType::kFP16});
  list.push_back({"specialized_like", 1, 300, 16, 1, 4, 1, 2});
  list.push_back({"seed_like_bhsd", 2, 256, 8, 2, 2, 1, 2, DType::kBF16, Pattern::kRandom, true});
  list.push_back({"odd_h12_hkv4_hp12", 1, 300, 12, 4, 12, 4, 2});
  list.push_back({"odd_h12_hkv2_hp4_m3", 1, 260, 12, 2, 4, 2, 2, DType::kFP16});
  list.push_back({"hpk_split_group", 1, 270, 8, 2, 8, 4, 2});
  list.push_back({"own_proxy_keys_m2", 1, 300, 16, 2, 8, 8, 2});  // R = 1: lists of a unit differ in k̃
  list.push_back({"k1_local_only", 2, 333, 8, 2, 2, 1, 1});
  list.push_back({"k_ge_nb_dense", 1, 350, 4, 1, 2, 1, 5});
  list.push_back({"hot", 1, 520, 8, 1, 1, 1, 3, DType::kBF16, Pattern::kHot});
  list.push_back({"tile_shared", 1, 400, 8, 2, 2, 1, 3, DType::kBF16, Pattern::kTileShared});
  list.push_back({"early_rows_short", 1, 100, 8, 2, 4, 2, 4});
  list.push_back({"no_kl_grad", 1, 256, 8, 2, 2, 1, 2, DType::kBF16, Pattern::kRandom, false, false});
  list.push_back({"no_kl_at_all", 1, 256, 8, 2, 2, 1, 2, DType::kFP16, Pattern::kRandom, false, false, false});
  BackwardCase sampled{"sampled_rows_2k", 1, 2048, 4, 1, 1, 1, 4};
  sampled.sample = 6;
  sampled.with_kl_value = false;
  list.push_back(sampled);
  // Rows that each see K = 16 full slots at one scale (the long-sequence regime), checked alone:
  // a rounding of dQ per slot or per partial sum shows here, where shorter rows' larger dq would
  // hide it under the atol.
  BackwardCase full_k{"full_k_rows_bf16", 1, 2560, 16, 1, 1, 1, 16};
  full_k.sample = 32;
  full_k.first_checked_row = 16 * kBlockSize;
  full_k.with_kl_value = false;
  list.push_back(full_k);
  // Two query chunks (64 heads × K = 64 make 4096-row chunks; 41 × 100 rows, the boundary inside
  // batch 40): the backward runs its tile and proxy-gradient kernels chunk by chunk.
  list.push_back({"two_chunks_h64_k64", 41, 100, 64, 4, 4, 1, 64});
  // Gradient scales far from 1, which the scaled fp16 dQ sums of bf16 inputs must follow: dO at
  // 2^-40 (below fp16's whole range), and K, V at 8 with dO at 2^24 (dQ far above fp16's maximum).
  list.push_back({"tiny_dout_bf16", 1, 640, 16, 2, 2, 1, 4});
  list.back().dout_scale = std::ldexp(1.0, -40);
  list.push_back({"large_kv_dout_bf16", 1, 640, 16, 2, 2, 1, 4});
  list.back().kv_scale = 8.0;
  list.back().dout_scale = std::ldexp(1.0, 24);
  return list;
}

// ---------------------------------------------------------------------------------------------
// Random configurations, drawn from a fixed seed so that the list and the names are stable: head
// maps with H ≤ 16 (so M = H/Hp ≤ 16, the backward's limit), K ∈ {1, 2, 3, 5, 8, 16, 64},
// S ∈ [1, 1100] (lengths at block boundaries drawn more often), B ∈ {1, 2}, both dtypes, both
// layouts, every pattern, with and without kl_grad and the KL value.
//
// Rows and blocks are sampled when checking all of them would take longer than the case's budget
// (host costs of the reference: random_draws.h); a draw whose sampled check still would is drawn
// again. Every kLongCaseEvery-th case is long (S ≥ 640, up to 9 blocks): even with one head and
// K = 1 its check takes about 1 s, so it gets kLongCaseBudgetSeconds; the others get
// kCaseBudgetSeconds.
// ---------------------------------------------------------------------------------------------
constexpr int kRandomCases = 100;
constexpr int kLongCaseEvery = 10;
constexpr double kCaseBudgetSeconds = 0.5;
constexpr double kLongCaseBudgetSeconds = 2.0;

using random_draws::case_prefix;
using random_draws::draw_heads;
using random_draws::draw_seqlen;
using random_draws::kBackwardNsPerUnit;
using random_draws::kForwardNsPerUnit;
using random_draws::kInputNsPerValue;
using random_draws::kRoundedForwardNsPerUnit;

// Estimated host seconds of one case on one core (the test spreads most of it over host threads).
double reference_seconds(const BackwardCase& c) {
  const ProblemShape s = shape_of(c);
  const double per_token = (2.0 * s.num_heads + s.num_proxy_heads) * s.head_dim;
  auto row_units = [&](int64_t i) {
    return double(std::min<int64_t>(i + 1, kBlockSize * int64_t(s.top_k))) * per_token;
  };
  double all_rows = 0.0;
  for (int64_t i = 0; i < s.seqlen; ++i) all_rows += row_units(i);
  all_rows *= double(s.batch);
  double checked = all_rows;
  if (c.sample > 0) {
    // A checked key block re-evaluates every row that selected it: all rows for block 0 of `hot`,
    // about K/NB of them otherwise.
    const double selecting = c.pattern == Pattern::kHot ? 1.0 : std::min(1.0, double(s.top_k) / s.num_blocks());
    const double blocks_checked = c.sample / 4 + 3;
    checked = double(s.batch) * (3 + c.sample) * row_units(s.seqlen - 1) +
              std::min(1.0, blocks_checked * selecting) * all_rows;
  }
  const double input_values = double(s.batch) * s.seqlen * s.head_dim *
                              (2 * s.num_heads + 2 * s.num_kv_heads + s.num_proxy_heads + s.num_proxy_kv_heads);
  return (input_values * kInputNsPerValue + all_rows * kForwardNsPerUnit +
          (c.with_kl_value ? all_rows * kRoundedForwardNsPerUnit : 0.0) + checked * kBackwardNsPerUnit) *
         1e-9;
}

std::vector<BackwardCase> random_cases() {
  constexpr int kTopKs[] = {1, 2, 3, 5, 8, 16, 64};
  constexpr Pattern kPatterns[] = {Pattern::kRandom, Pattern::kRandom, Pattern::kHot, Pattern::kTileShared};
  constexpr int kDrawsPerLength = 8;
  std::mt19937_64 rng(0x5eed'b0b0);
  std::vector<BackwardCase> list;
  while (list.size() < kRandomCases) {
    const bool long_case = list.size() % kLongCaseEvery == kLongCaseEvery - 1;
    const double budget = long_case ? kLongCaseBudgetSeconds : kCaseBudgetSeconds;
    BackwardCase c;
    c.batch = 1 + int64_t(rng() % 2);
    c.seqlen = long_case ? 640 + int64_t(rng() % 461) : draw_seqlen(rng);
    // The rest is drawn again for the same length until it fits, so long sequences stay in the list
    // (with fewer heads or blocks).
    for (int draw = 0; draw < kDrawsPerLength; ++draw) {
      draw_heads(rng, c);
      c.top_k = kTopKs[rng() % std::size(kTopKs)];
      c.dtype = rng() % 2 == 0 ? DType::kBF16 : DType::kFP16;
      c.pattern = kPatterns[rng() % std::size(kPatterns)];
      c.bhsd = rng() % 2 == 0;
      c.with_kl_grad = rng() % 8 != 0;
      c.with_kl_value = rng() % 4 != 0;
      c.sample = 0;
      for (int sample : {16, 8}) {
        if (reference_seconds(c) <= budget) break;
        c.sample = sample;
      }
      if (reference_seconds(c) <= budget) break;
    }
    if (reference_seconds(c) > budget) continue;
    c.name = case_prefix(list.size(), c) + "_k" + std::to_string(c.top_k) +
             (c.dtype == DType::kBF16 ? "_bf16_" : "_fp16_") + (c.bhsd ? "bhsd_" : "bshd_") +
             patterns::pattern_name(c.pattern) + (c.with_kl_grad ? "" : "_no_kl_grad") +
             (c.with_kl_value ? "" : "_no_kl_value") + (c.sample > 0 ? "_sampled" : "");
    list.push_back(c);
  }
  return list;
}

std::string case_name(const ::testing::TestParamInfo<BackwardCase>& info) { return info.param.name; }

class BackwardMatchesReference : public ::testing::TestWithParam<BackwardCase> {};

TEST_P(BackwardMatchesReference, AllGradientsAndKl) {
  FLASHMSA_REQUIRE_HOPPER();
  const BackwardCase& c = GetParam();
  const uint64_t seed = testing::test_seed(c.name);
  FLASHMSA_SEED_TRACE(seed);
  check_case(c, seed);
}

INSTANTIATE_TEST_SUITE_P(Cases, BackwardMatchesReference, ::testing::ValuesIn(correctness_cases()), case_name);

// The chunked case above really spans two query chunks (the chunk size is a function of the shape).
TEST(BackwardChunks, NamedCaseSpansTwoChunks) {
  int found = 0;
  for (const BackwardCase& c : correctness_cases()) {
    if (c.name == "two_chunks_h64_k64") {
      ++found;
      EXPECT_EQ(kernels::schedule::num_chunks(shape_of(c)), 2);
    }
  }
  EXPECT_EQ(found, 1) << "the two-chunk case is missing from correctness_cases()";
}
// The same case captured into a CUDA graph on a non-blocking stream and replayed: the per-chunk
// launches of the tile and proxy-gradient kernels, and the finish after them, as one graph.
TEST(BackwardChunks, TwoChunksReplayedFromAGraph) {
  FLASHMSA_REQUIRE_HOPPER();
  for (const BackwardCase& c : correctness_cases()) {
    if (c.name != "two_chunks_h64_k64") continue;
    const uint64_t seed = testing::test_seed(c.name + "_graph");
    FLASHMSA_SEED_TRACE(seed);
    check_case(c, seed, /*via_graph=*/true);
  }
}
INSTANTIATE_TEST_SUITE_P(Random, BackwardMatchesReference, ::testing::ValuesIn(random_cases()), case_name);

// ---------------------------------------------------------------------------------------------
// Deterministic mode: reruns are bitwise equal, and the result passes the same reference check.
// ---------------------------------------------------------------------------------------------
std::vector<uint16_t> all_bits(const DeviceProblem& d) {
  std::vector<uint16_t> bits;
  for (const DeviceTensor* t : {&d.dq, &d.dk, &d.dv, &d.dq_proxy, &d.dk_proxy}) {
    const std::vector<uint16_t> part = t->buffer.download();
    bits.insert(bits.end(), part.begin(), part.end());
  }
  uint32_t kl_bits;
  const float kl = d.kl.download()[0];
  std::memcpy(&kl_bits, &kl, 4);
  bits.push_back(uint16_t(kl_bits));
  bits.push_back(uint16_t(kl_bits >> 16));
  return bits;
}

void check_reruns_bitwise_equal(const BackwardCase& c, int reruns) {
  const uint64_t seed = testing::test_seed(c.name);
  FLASHMSA_SEED_TRACE(seed);
  const HostProblem host = make_host_problem(c, seed);
  DeviceProblem d;
  make_device_problem(c, host, /*deterministic=*/true, d);
  ASSERT_TRUE(backward(d.params, nullptr).ok());
  FLASHMSA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> first = all_bits(d);
  const KernelGradients g = download_gradients(c, d);
  EXPECT_EQ(testing::fa3_rule(g.dq, g.dq, g.dq, 0.0).nan_count, 0);
  for (int run = 0; run < reruns; ++run) {
    for (DeviceTensor* t : {&d.dq, &d.dk, &d.dv, &d.dq_proxy, &d.dk_proxy}) t->buffer.poison();
    ASSERT_TRUE(backward(d.params, nullptr).ok());
    FLASHMSA_CUDA_CHECK(cudaDeviceSynchronize());
    ASSERT_TRUE(all_bits(d) == first) << "rerun " << run << " differs";
  }
}

TEST(BackwardDeterministic, TwentyRerunsBitwiseEqual) {
  FLASHMSA_REQUIRE_HOPPER();
  check_reruns_bitwise_equal({"det_hot", 1, 1100, 16, 1, 2, 1, 4, DType::kBF16, Pattern::kHot}, 20);
}

TEST(BackwardDeterministic, HundredRerunsBitwiseEqual) {
  FLASHMSA_REQUIRE_HOPPER();
  check_reruns_bitwise_equal({"det_random", 2, 700, 8, 2, 4, 2, 3, DType::kFP16}, 100);
}

TEST(BackwardDeterministic, MatchesReference) {
  FLASHMSA_REQUIRE_HOPPER();
  const BackwardCase c{"det_check", 1, 300, 8, 2, 4, 1, 2};
  const ProblemShape s = shape_of(c);
  const HostProblem host = make_host_problem(c, 7);
  DeviceProblem d;
  make_device_problem(c, host, /*deterministic=*/true, d);
  ASSERT_TRUE(backward(d.params, nullptr).ok());
  FLASHMSA_CUDA_CHECK(cudaDeviceSynchronize());
  const KernelGradients g = download_gradients(c, d);
  reference::QueryRows rows;
  reference::KeyBlocks blocks;
  checked_subsets(c, s, 7, &rows, &blocks);
  const reference::Gradients exact =
      parallel_backward(host.in, host.block_idx, host.dout, host.kl_grad, Precision::kFP64, rows, blocks, host.saved);
  const reference::Gradients rounded =
      parallel_backward(host.in, host.block_idx, host.dout, host.kl_grad, Precision::kBF16, rows, blocks, host.saved);
  expect_gradients(g, exact, rounded, host, host.kl_grad);
}

}  // namespace
}  // namespace flashmsa
