// Finite-difference checks of the reference backward (SPEC.md §3-§4) in fp64: for every
// differentiable input and a set of head layouts, modes and K values, central differences of
// reference::loss() must match reference::backward().
//
// q, k, v are perturbed with the KL weight at 0 in loss() (the teacher is detached, so the KL sends
// them no gradient) while backward() still runs with ḡ != 0, which also checks that the KL path
// leaves dq, dk, dv alone. q_proxy and k_proxy only reach the loss through the KL.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>

#include "reference/reference.h"
#include "shapes.h"

namespace flashmsa::reference {
namespace {

struct GradCase {
  const char* name;
  ProblemShape shape;
  Mode mode;
  double softmax_scale = 0.0;
  double proxy_scale = 0.0;
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

enum class Tensor { kQ, kK, kV, kQProxy, kKProxy };

const char* tensor_name(Tensor t) {
  switch (t) {
    case Tensor::kQ: return "q";
    case Tensor::kK: return "k";
    case Tensor::kV: return "v";
    case Tensor::kQProxy: return "q_proxy";
    case Tensor::kKProxy: return "k_proxy";
  }
  return "?";
}

std::vector<double>& input_of(Inputs& in, Tensor t) {
  switch (t) {
    case Tensor::kQ: return in.q;
    case Tensor::kK: return in.k;
    case Tensor::kV: return in.v;
    case Tensor::kQProxy: return in.q_proxy;
    case Tensor::kKProxy: return in.k_proxy;
  }
  return in.q;
}

const std::vector<double>& gradient_of(const Gradients& g, Tensor t) {
  switch (t) {
    case Tensor::kQ: return g.dq;
    case Tensor::kK: return g.dk;
    case Tensor::kV: return g.dv;
    case Tensor::kQProxy: return g.dq_proxy;
    case Tensor::kKProxy: return g.dk_proxy;
  }
  return g.dq;
}

std::vector<double> gaussian_vector(size_t n, uint64_t seed) {
  std::mt19937_64 engine(seed);
  std::normal_distribution<double> normal;
  std::vector<double> x(n);
  for (double& e : x) e = normal(engine);
  return x;
}

// The coordinates to perturb: the entries with the largest analytic gradient (so the check is
// never about zeros only) plus random ones (which also hit entries whose gradient must be 0).
std::vector<size_t> coordinates_to_check(const std::vector<double>& grad, uint64_t seed) {
  constexpr size_t kLargest = 3;
  constexpr size_t kRandom = 6;
  std::vector<size_t> order(grad.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::partial_sort(order.begin(), order.begin() + kLargest, order.end(),
                    [&](size_t a, size_t b) { return std::fabs(grad[a]) > std::fabs(grad[b]); });
  std::vector<size_t> picked(order.begin(), order.begin() + kLargest);
  std::mt19937_64 engine(seed);
  std::uniform_int_distribution<size_t> any(0, grad.size() - 1);
  for (size_t r = 0; r < kRandom; ++r) picked.push_back(any(engine));
  return picked;
}

class FiniteDifference : public ::testing::TestWithParam<std::tuple<GradCase, Tensor>> {};

TEST_P(FiniteDifference, MatchesBackward) {
  const GradCase& c = std::get<0>(GetParam());
  const Tensor tensor = std::get<1>(GetParam());
  const bool proxy = tensor == Tensor::kQProxy || tensor == Tensor::kKProxy;

  Inputs in = random_inputs(c.shape, /*seed=*/11, DType::kBF16);
  in.softmax_scale = c.softmax_scale;
  in.proxy_scale = c.proxy_scale;
  const std::vector<int32_t> block_idx =
      c.mode == Mode::kSparse ? select(in, Precision::kFP64) : std::vector<int32_t>{};
  const std::vector<double> dout = gaussian_vector(in.q.size(), /*seed=*/12);
  constexpr double kKlGrad = 0.75;

  const Gradients grads = backward(in, block_idx, dout, kKlGrad, c.mode, Precision::kFP64);
  const std::vector<double>& grad = gradient_of(grads, tensor);
  double max_abs = 0.0;
  for (double g : grad) max_abs = std::max(max_abs, std::fabs(g));
  ASSERT_GT(max_abs, 0.0) << "the gradient of " << tensor_name(tensor) << " vanishes entirely";

  // The proxies reach the loss only through the KL, so their differences leave out·dout aside: it
  // is constant in them and would only add rounding noise to a small difference.
  const std::vector<double> loss_dout = proxy ? std::vector<double>(dout.size(), 0.0) : dout;
  const double loss_kl_grad = proxy ? kKlGrad : 0.0;
  std::vector<double>& x = input_of(in, tensor);
  constexpr double kStep = 1e-4;
  for (size_t e : coordinates_to_check(grad, /*seed=*/13)) {
    const double saved = x[e];
    x[e] = saved + kStep;
    const double up = loss(in, block_idx, loss_dout, loss_kl_grad, c.mode);
    x[e] = saved - kStep;
    const double down = loss(in, block_idx, loss_dout, loss_kl_grad, c.mode);
    x[e] = saved;
    const double numeric = (up - down) / (2.0 * kStep);
    EXPECT_NEAR(numeric, grad[e], 1e-5 * max_abs)
        << tensor_name(tensor) << "[" << e << "], largest |gradient| " << max_abs;
  }
}

const GradCase kCases[] = {
    // Paper layout scaled down (Hp = Hkv, Hpk = 1); S = 300 has a partial last block and rows of
    // block 0 see fewer than K blocks.
    {"paper_K2_S300", testing::small_shape(1, 300, 8, 2, 2, 1, 2), Mode::kSparse},
    // Group-specialized: Hp > Hkv.
    {"specialized_K2_S500", testing::small_shape(1, 500, 8, 2, 4, 1, 2), Mode::kSparse},
    // Seed defaults (H=16, Hkv=2, Hp=4, Hpk=1) with K = 1: only the local block.
    {"seed_K1_S260", testing::small_shape(1, 260, 16, 2, 4, 1, 1), Mode::kSparse},
    // Odd group sizes (M = G = 3), one proxy key head per proxy head, K >= NB, two batches.
    {"odd_M3_K3_B2", testing::small_shape(2, 200, 6, 2, 2, 2, 3), Mode::kSparse},
    // R = 2 proxy heads per proxy key head, Di != D, explicit scales.
    {"proxy_R2_Di8_scaled", testing::small_shape(1, 400, 8, 2, 4, 2, 3, 16, 8), Mode::kSparse, 0.3, 0.4},
    // K larger than the number of blocks: every row sees its whole causal prefix.
    {"K8_exceeds_blocks", testing::small_shape(1, 500, 4, 1, 1, 1, 8), Mode::kSparse},
    {"warmup_paper_S300", testing::small_shape(1, 300, 8, 2, 2, 1, 2), Mode::kWarmup},
    {"warmup_M2_B2", testing::small_shape(2, 150, 6, 3, 3, 1, 1), Mode::kWarmup},
};

std::string case_name(const ::testing::TestParamInfo<std::tuple<GradCase, Tensor>>& info) {
  return std::string(std::get<0>(info.param).name) + "_" + tensor_name(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Reference, FiniteDifference,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::Values(Tensor::kQ, Tensor::kK, Tensor::kV,
                                                              Tensor::kQProxy, Tensor::kKProxy)),
                         case_name);

}  // namespace
}  // namespace flashmsa::reference
