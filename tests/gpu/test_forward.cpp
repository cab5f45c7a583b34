// GPU sparse forward (SPEC.md §2 and the proxy LSE of §3) against reference::forward, with FA3's
// rule |kernel − fp64| ≤ 2·|reference in the input dtype − fp64| + atol on O, LSE and proxy_lse.
//
// Every case draws fresh N(0, 1) inputs, poisons O, LSE and proxy_lse with NaN, runs schedule +
// forward, and checks (a) the rule on the reference rows (all rows for small S, a sample of first,
// last and random rows otherwise) and (b) that no output element anywhere is left unwritten.
// atol: O 1e-5 (the bf16/fp16 bound dominates); LSE and proxy_lse 1e-4 (fp32 values of size ≈ 10
// built from exp2/log2 and a two-level merge; a dropped key moves an LSE by ≈ 1/|T| ≥ 1.5e-3).
// The KL value is not computed by the forward (docs/design.md "Forward"): params.kl must stay as
// the caller left it.
//
// Cases: the named ones below, then kRandomCases random configurations (random_cases()).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/patterns.h"
#include "gpu/forward_cases.h"
#include "gpu/random_draws.h"

namespace flashmsa {
namespace {

// kHot and kTileShared are the patterns of common/patterns.h (SPEC.md "Benchmark configurations").
enum class Selection { kRandom, kReferenceSelect, kDense, kHot, kTileShared };

struct ForwardCase {
  std::string name;
  int num_heads, num_kv_heads, num_proxy_heads, num_proxy_kv_heads;
  int64_t batch, seqlen;
  int top_k;
  DType dtype;
  bool bhsd;
  Selection selection;
  int sampled_rows;  // 0: every row
  double v_scale = 1.0;  // V times this power of two (exact in the dtype): partial outputs near the dtype's range
};

void PrintTo(const ForwardCase& c, std::ostream* os) { *os << c.name; }

reference::QueryRows sample_rows(const ForwardCase& c, uint64_t seed) {
  reference::QueryRows rows;
  if (c.sampled_rows == 0) return rows;
  std::mt19937_64 rng(seed);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i : {int64_t(0), int64_t(1), int64_t(127), int64_t(128), c.seqlen - 1}) rows.push_back({b, i});
    for (int n = 0; n < c.sampled_rows; ++n) rows.push_back({b, int64_t(rng() % c.seqlen)});
  }
  return rows;
}

class ForwardTest : public ::testing::TestWithParam<ForwardCase> {};

TEST_P(ForwardTest, MatchesReference) {
  FLASHMSA_REQUIRE_HOPPER();
  const ForwardCase& c = GetParam();
  const ProblemShape shape = cases::problem_shape(c.batch, c.seqlen, c.num_heads, c.num_kv_heads,
                                                  c.num_proxy_heads, c.num_proxy_kv_heads, c.top_k);
  const uint64_t seed = testing::test_seed(c.name);
  FLASHMSA_SEED_TRACE(seed);
  reference::Inputs inputs = reference::random_inputs(shape, seed, c.dtype);
  for (double& value : inputs.v) value *= c.v_scale;
  const reference::QueryRows rows = sample_rows(c, seed);

  std::vector<int32_t> block_idx;
  switch (c.selection) {
    case Selection::kReferenceSelect:
      block_idx = reference::select(inputs, reference::Precision::kFP64);
      break;
    case Selection::kHot:
      block_idx = patterns::make_selection(shape, patterns::Pattern::kHot, seed);
      break;
    case Selection::kTileShared:
      block_idx = patterns::make_selection(shape, patterns::Pattern::kTileShared, seed);
      break;
    case Selection::kRandom:
    case Selection::kDense:
      block_idx = forward_testing::random_selection(shape, seed);
      break;
  }

  using forward_testing::upload_tensor;
  auto q = upload_tensor(inputs.q, shape, shape.num_heads, shape.head_dim, c.dtype, c.bhsd);
  auto k = upload_tensor(inputs.k, shape, shape.num_kv_heads, shape.head_dim, c.dtype, c.bhsd);
  auto v = upload_tensor(inputs.v, shape, shape.num_kv_heads, shape.head_dim, c.dtype, c.bhsd);
  auto q_proxy = upload_tensor(inputs.q_proxy, shape, shape.num_proxy_heads, shape.proxy_head_dim, c.dtype, c.bhsd);
  auto k_proxy =
      upload_tensor(inputs.k_proxy, shape, shape.num_proxy_kv_heads, shape.proxy_head_dim, c.dtype, c.bhsd);
  auto out = upload_tensor(std::vector<double>(inputs.q.size(), 0.0), shape, shape.num_heads, shape.head_dim,
                           c.dtype, c.bhsd);
  out.buffer.poison();
  testing::DeviceBuffer<int32_t> device_idx(block_idx.size());
  device_idx.upload(block_idx);
  testing::DeviceBuffer<float> lse(shape.batch * shape.num_heads * shape.seqlen);
  testing::DeviceBuffer<float> proxy_lse(shape.batch * shape.num_proxy_heads * shape.seqlen);
  testing::DeviceBuffer<float> kl(1);
  lse.poison();
  proxy_lse.poison();
  kl.upload({123.f});
  testing::DeviceBuffer<char> schedule_workspace(schedule_workspace_size(shape));
  testing::DeviceBuffer<char> forward_workspace(forward_workspace_size(shape, Mode::kSparse));
  schedule_workspace.poison();
  forward_workspace.poison();

  ScheduleParams schedule_params;
  schedule_params.shape = shape;
  schedule_params.block_idx = device_idx.get();
  schedule_params.workspace = schedule_workspace.get();
  const Status scheduled = schedule(schedule_params, nullptr);
  ASSERT_TRUE(scheduled.ok()) << scheduled.message;

  ForwardParams params;
  params.shape = shape;
  params.dtype = c.dtype;
  params.q = q.ref;
  params.k = k.ref;
  params.v = v.ref;
  params.q_proxy = q_proxy.ref;
  params.k_proxy = k_proxy.ref;
  params.block_idx = device_idx.get();
  params.schedule = schedule_workspace.get();
  params.out = out.ref;
  params.lse = lse.get();
  params.proxy_lse = proxy_lse.get();
  params.kl = kl.get();
  params.workspace = forward_workspace.get();
  const Status status = forward(params, nullptr);
  ASSERT_TRUE(status.ok()) << status.message;
  FLASHMSA_CUDA_CHECK(cudaDeviceSynchronize());

  const std::vector<double> kernel_out =
      forward_testing::download_tensor(out, shape, shape.num_heads, shape.head_dim, c.dtype, c.bhsd);
  const std::vector<double> kernel_lse = testing::download_float(lse);
  const std::vector<double> kernel_proxy_lse = testing::download_float(proxy_lse);
  EXPECT_EQ(kl.download()[0], 123.f) << "the forward must leave params.kl untouched";
  auto count_nan = [](const std::vector<double>& values) {
    int64_t n = 0;
    for (double x : values) n += std::isnan(x) ? 1 : 0;
    return n;
  };
  EXPECT_EQ(count_nan(kernel_out), 0) << "O has unwritten (NaN) elements";
  EXPECT_EQ(count_nan(kernel_lse), 0) << "LSE has unwritten (NaN) elements";
  EXPECT_EQ(count_nan(kernel_proxy_lse), 0) << "proxy_lse has unwritten (NaN) elements";

  // Dense (K ≥ NB) is checked against the warmup reference: dense causal attention.
  const Mode reference_mode = c.selection == Selection::kDense ? Mode::kWarmup : Mode::kSparse;
  const reference::ForwardOutputs exact =
      reference::forward(inputs, block_idx, reference_mode, reference::Precision::kFP64, rows);
  const reference::ForwardOutputs rounded =
      reference::forward(inputs, block_idx, reference_mode, reference::precision_of(c.dtype), rows);
  const testing::ErrorReport out_report = testing::fa3_rule(kernel_out, exact.out, rounded.out, 1e-5);
  const testing::ErrorReport lse_report = testing::fa3_rule(kernel_lse, exact.lse, rounded.lse, 1e-4);
  const testing::ErrorReport proxy_report =
      testing::fa3_rule(kernel_proxy_lse, exact.proxy_lse, rounded.proxy_lse, 1e-4);
  EXPECT_TRUE(out_report.ok) << out_report.describe("O");
  EXPECT_TRUE(lse_report.ok) << lse_report.describe("LSE");
  EXPECT_TRUE(proxy_report.ok) << proxy_report.describe("proxy_lse");
  std::printf("  %s | %s | %s\n", out_report.describe("O").c_str(), lse_report.describe("LSE").c_str(),
              proxy_report.describe("proxy_lse").c_str());
}

std::string case_name(const ::testing::TestParamInfo<ForwardCase>& info) { return info.param.name; }

constexpr DType kBF16 = DType::kBF16;
constexpr DType kFP16 = DType::kFP16;
constexpr Selection kRandom = Selection::kRandom;

INSTANTIATE_TEST_SUITE_P(
    Configs, ForwardTest,
    ::testing::Values(
        // Named configurations (paper: M = G = 16, 8 tokens per tile; specialized: M = 4, 32 tokens).
        ForwardCase{"paper_s2125_k16_bf16_bshd", 64, 4, 4, 1, 1, 2048 + 77, 16, kBF16, false, kRandom, 24},
        ForwardCase{"paper_s2100_k16_fp16_bhsd", 64, 4, 4, 1, 1, 2100, 16, kFP16, true, kRandom, 24},
        ForwardCase{"paper_s16385_k16_bf16_2chunks", 64, 4, 4, 1, 1, 16384 + 1, 16, kBF16, false, kRandom, 12},
        ForwardCase{"paper_s9000_k64_bf16_3chunks", 64, 4, 4, 1, 1, 9000, 64, kBF16, true, kRandom, 8},
        ForwardCase{"paper_b2_s16385_k16_fp16_3chunks", 64, 4, 4, 1, 2, 16384 + 1, 16, kFP16, false, kRandom, 8},
        ForwardCase{"specialized_s4101_k16_bf16", 64, 4, 16, 1, 1, 4096 + 5, 16, kBF16, false, kRandom, 16},
        ForwardCase{"specialized_s3000_k2_fp16_bhsd", 64, 4, 16, 1, 1, 3000, 2, kFP16, true, kRandom, 16},
        ForwardCase{"seed_b2_s3000_k16_bf16", 16, 2, 4, 1, 2, 3000, 16, kBF16, false, kRandom, 32},
        ForwardCase{"seed_s1000_k1_fp16", 16, 2, 4, 1, 1, 1000, 1, kFP16, false, kRandom, 0},
        // V near the dtype's range (|v| up to ≈ 10⁴ in fp16, ≈ 10³⁴ in bf16): partial outputs are
        // averages of V and stay in range; in fp16 a block's Σ p·v (up to 128 · max |v|) would not.
        ForwardCase{"paper_s2100_k16_fp16_large_v", 64, 4, 4, 1, 1, 2100, 16, kFP16, false, kRandom, 24, 2048.0},
        ForwardCase{"seed_s1500_k16_bf16_large_v", 16, 2, 4, 1, 1, 1500, 16, kBF16, true, kRandom, 32, 0x1p113},
        ForwardCase{"seed_s777_k64_bf16_bhsd", 16, 2, 4, 1, 1, 777, 64, kBF16, true, kRandom, 32},
        // Odd head maps: M = 4 with G = 12 and R = 3; M = 12 (10 tokens, 120 rows per tile); M = 1.
        ForwardCase{"odd_h48_hkv4_hp12_hpk4_s1000_k16", 48, 4, 12, 4, 1, 1000, 16, kBF16, false, kRandom, 32},
        ForwardCase{"m12_h48_hkv4_hp4_s1500_k2", 48, 4, 4, 2, 2, 1500, 2, kFP16, true, kRandom, 32},
        ForwardCase{"m1_h8_hkv2_hp8_s700_k16", 8, 2, 8, 2, 1, 700, 16, kBF16, false, kRandom, 64},
        // A proxy-key head per proxy head (R = 1) with four proxy heads per KV group: consecutive
        // lists share K and V but not the proxy keys, so each loads its own.
        ForwardCase{"own_proxy_keys_h16_hkv2_hp8_hpk8_s1200_k16", 16, 2, 8, 8, 1, 1200, 16, kBF16, false, kRandom, 32},
        // Selections from the reference index branch.
        ForwardCase{"seed_select_s1100_k16", 16, 2, 4, 1, 1, 1100, 16, kBF16, false, Selection::kReferenceSelect, 32},
        ForwardCase{"small_select_s900_k2_fp16", 8, 2, 2, 1, 1, 900, 2, kFP16, true, Selection::kReferenceSelect, 32},
        // K ≥ NB: dense causal attention.
        ForwardCase{"dense_seed_s1500_k16", 16, 2, 4, 1, 1, 1500, 16, kBF16, false, Selection::kDense, 32},
        ForwardCase{"dense_paper_s1000_k64_fp16", 64, 4, 4, 1, 1, 1000, 64, kFP16, true, Selection::kDense, 32}),
    case_name);

// ---------------------------------------------------------------------------------------------
// Random configurations, drawn from a fixed seed so that the list and the names are stable: head
// maps with H ≤ 16, K ∈ {1, 2, 3, 5, 8, 16, 64}, S ∈ [1, 1100] (lengths at block boundaries drawn
// more often), B ∈ {1, 2}, both dtypes, both layouts and every selection kind.
//
// Host cost, measured on one x86 core (Release build): reference::random_inputs about
// kInputNsPerValue per value of B·S·(H + 2·Hkv + Hp + Hpk)·D, the fp64 plus the input-dtype
// reference forward about kReferenceNsPerUnit per unit of B·rows·|T|·(2H + Hp)·D, and
// reference::select about kSelectNsPerUnit per unit of B·Hp·S²/2·Di. Rows are sampled when checking
// all of them would take longer than kCaseBudgetSeconds; a draw whose sampled check still would is
// drawn again.
// ---------------------------------------------------------------------------------------------
constexpr int kRandomCases = 100;
constexpr double kCaseBudgetSeconds = 0.4;
constexpr double kReferenceNsPerUnit = 6.1;
constexpr double kSelectNsPerUnit = 0.25;

using random_draws::draw_seqlen;
using random_draws::kInputNsPerValue;
using random_draws::case_prefix;
using random_draws::draw_heads;

const char* selection_name(Selection selection) {
  switch (selection) {
    case Selection::kRandom:
      return "random";
    case Selection::kReferenceSelect:
      return "select";
    case Selection::kDense:
      return "dense";
    case Selection::kHot:
      return "hot";
    case Selection::kTileShared:
      return "tile_shared";
  }
  return "?";
}

// Estimated host seconds of one case on one core.
double reference_seconds(const ForwardCase& c) {
  const double per_token = (2.0 * c.num_heads + c.num_proxy_heads) * 128;
  auto tokens = [&](int64_t i) { return double(std::min<int64_t>(i + 1, kBlockSize * int64_t(c.top_k))); };
  double units = 0.0;
  if (c.sampled_rows == 0) {
    for (int64_t i = 0; i < c.seqlen; ++i) units += tokens(i);
  } else {
    units = (5 + c.sampled_rows) * tokens(c.seqlen - 1);
  }
  units *= double(c.batch) * per_token;
  const double select_units = c.selection == Selection::kReferenceSelect
                                  ? double(c.batch) * c.num_proxy_heads * double(c.seqlen) * c.seqlen / 2 * 128
                                  : 0.0;
  const double input_values = double(c.batch) * c.seqlen * 128 *
                              (c.num_heads + 2 * c.num_kv_heads + c.num_proxy_heads + c.num_proxy_kv_heads);
  return (input_values * kInputNsPerValue + units * kReferenceNsPerUnit + select_units * kSelectNsPerUnit) * 1e-9;
}

std::vector<ForwardCase> random_cases() {
  constexpr int kTopKs[] = {1, 2, 3, 5, 8, 16, 64};
  constexpr Selection kSelections[] = {kRandom, kRandom, kRandom, Selection::kReferenceSelect,
                                       Selection::kReferenceSelect, Selection::kHot,
                                       Selection::kTileShared, Selection::kDense};
  std::mt19937_64 rng(0x5eed'f0f0);
  std::vector<ForwardCase> list;
  while (list.size() < kRandomCases) {
    ForwardCase c;
    draw_heads(rng, c);
    c.batch = 1 + int64_t(rng() % 2);
    c.seqlen = draw_seqlen(rng);
    c.top_k = kTopKs[rng() % std::size(kTopKs)];
    c.dtype = rng() % 2 == 0 ? kBF16 : kFP16;
    c.bhsd = rng() % 2 == 0;
    c.selection = kSelections[rng() % std::size(kSelections)];
    c.sampled_rows = 0;
    if (c.selection == Selection::kDense) {  // the smallest K of the list with K ≥ NB (NB ≤ 9)
      const int64_t num_blocks = (c.seqlen + kBlockSize - 1) / kBlockSize;
      c.top_k = *std::find_if(std::begin(kTopKs), std::end(kTopKs), [&](int k) { return k >= num_blocks; });
    }
    // sample_rows() always checks rows 127 and 128, so only S > 128 can be sampled.
    for (int sampled : {32, 16, 8}) {
      if (reference_seconds(c) <= kCaseBudgetSeconds || c.seqlen <= kBlockSize) break;
      c.sampled_rows = sampled;
    }
    if (reference_seconds(c) > kCaseBudgetSeconds) continue;
    c.name = case_prefix(list.size(), c) + "_k" + std::to_string(c.top_k) +
             (c.dtype == kBF16 ? "_bf16_" : "_fp16_") + (c.bhsd ? "bhsd_" : "bshd_") + selection_name(c.selection);
    list.push_back(c);
  }
  return list;
}

INSTANTIATE_TEST_SUITE_P(Random, ForwardTest, ::testing::ValuesIn(random_cases()), case_name);

}  // namespace
}  // namespace flashmsa
