// Precision emulation of the reference: bf16 / fp16 / fp32 rounding of known values, agreement with
// CUDA's host-side conversions, fp32-accumulating inner products, random inputs, and the size of
// the error that the emulated forward and backward make against fp64.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "reference/reference.h"
#include "shapes.h"

namespace flashmsa::reference {
namespace {

// One batch, one proxy key head.
ProblemShape make_shape(int64_t seqlen, int heads, int kv_heads, int proxy_heads, int top_k,
                        int head_dim) {
  return testing::small_shape(1, seqlen, heads, kv_heads, proxy_heads, 1, top_k, head_dim);
}

// max |a - b| / max |b| over the entries both define.
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0.0;
  double scale = 0.0;
  for (size_t e = 0; e < a.size(); ++e) {
    diff = std::max(diff, std::fabs(a[e] - b[e]));
    scale = std::max(scale, std::fabs(b[e]));
  }
  return diff / scale;
}

TEST(ReferencePrecision, Bf16RoundsHalfToEven) {
  const Precision bf16 = Precision::kBF16;
  // 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7 (odd).
  EXPECT_EQ(round_to(1.0 + 0x1p-8, bf16), 1.0);
  // 1 + 3·2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(round_to(1.0 + 3 * 0x1p-8, bf16), 1.0 + 0x1p-6);
  // Just above the halfway point rounds up.
  EXPECT_EQ(round_to(1.0 + 0x1p-8 + 0x1p-30, bf16), 1.0 + 0x1p-7);
  EXPECT_EQ(round_to(-(1.0 + 0x1p-8 + 0x1p-30), bf16), -(1.0 + 0x1p-7));
  // A carry out of the fraction moves to the next binade.
  EXPECT_EQ(round_to(2.0 - 0x1p-9, bf16), 2.0);
}

TEST(ReferencePrecision, Bf16KeepsRepresentableValuesAndSpecials) {
  for (double x : {0.0, -0.0, 1.0, 3.0, -0.15625, 1.0 + 0x1p-7, 0x1p-126, 0x1p-133, 0x1.fep127}) {
    EXPECT_EQ(round_to(x, Precision::kBF16), x) << x;
  }
  EXPECT_TRUE(std::isnan(round_to(NAN, Precision::kBF16)));
  EXPECT_EQ(round_to(INFINITY, Precision::kBF16), INFINITY);
  EXPECT_EQ(round_to(-INFINITY, Precision::kFP16), -INFINITY);
}

TEST(ReferencePrecision, Bf16OverflowsToInfinity) {
  const double max_bf16 = 0x1.fep127;
  EXPECT_EQ(round_to(0x1.fdp127 + 0x1p110, Precision::kBF16), max_bf16);  // below the midpoint
  EXPECT_EQ(round_to(0x1.ffp127, Precision::kBF16), INFINITY);  // midpoint: to even = 2^128
  EXPECT_EQ(round_to(1e39, Precision::kBF16), INFINITY);
  EXPECT_EQ(round_to(-1e39, Precision::kBF16), -INFINITY);
}

TEST(ReferencePrecision, Fp16MaxAndOverflow) {
  const Precision fp16 = Precision::kFP16;
  EXPECT_EQ(round_to(65504.0, fp16), 65504.0);
  EXPECT_EQ(round_to(65519.0, fp16), 65504.0);
  EXPECT_EQ(round_to(65520.0, fp16), INFINITY);  // midpoint between 65504 and 2^16: to even = inf
  EXPECT_EQ(round_to(-70000.0, fp16), -INFINITY);
  EXPECT_EQ(round_to(1.0 + 0x1p-11, fp16), 1.0);  // halfway, to even
  EXPECT_EQ(round_to(1.0 + 0x1p-11 + 0x1p-20, fp16), 1.0 + 0x1p-10);
}

TEST(ReferencePrecision, Fp16Subnormals) {
  const Precision fp16 = Precision::kFP16;
  const double quantum = 0x1p-24;  // the smallest fp16 subnormal
  EXPECT_EQ(round_to(quantum, fp16), quantum);
  EXPECT_EQ(round_to(0.5 * quantum, fp16), 0.0);  // halfway to 0 (even)
  EXPECT_EQ(round_to(0.75 * quantum, fp16), quantum);
  EXPECT_EQ(round_to(1.5 * quantum, fp16), 2.0 * quantum);  // halfway between 1 and 2 quanta
  EXPECT_EQ(round_to(2.5 * quantum, fp16), 2.0 * quantum);  // halfway between 2 and 3 quanta
  EXPECT_EQ(round_to(-0.75 * quantum, fp16), -quantum);
  EXPECT_EQ(round_to(0x1p-15 + 0.4 * quantum, fp16), 0x1p-15);  // inside the subnormal range
  EXPECT_EQ(round_to(0x1p-14 - 0.5 * quantum, fp16), 0x1p-14);  // rounds up to the smallest normal
  EXPECT_EQ(round_to(1e-10, fp16), 0.0);
}

TEST(ReferencePrecision, Fp32IsFloatRounding) {
  EXPECT_EQ(round_to(1.0 + 0x1p-30, Precision::kFP32), 1.0);
  EXPECT_EQ(round_to(1.0 + 0x1p-23, Precision::kFP32), 1.0 + 0x1p-23);
  EXPECT_EQ(round_to(1.0 + 0x1p-30, Precision::kFP64), 1.0 + 0x1p-30);
  EXPECT_EQ(accumulate_round(1.0 + 0x1p-30, Precision::kBF16), 1.0);
  EXPECT_EQ(accumulate_round(1.0 + 0x1p-30, Precision::kFP64), 1.0 + 0x1p-30);
  EXPECT_EQ(precision_of(DType::kBF16), Precision::kBF16);
  EXPECT_EQ(precision_of(DType::kFP16), Precision::kFP16);
}

// CUDA's host conversions are an independent implementation of the same IEEE rounding.
TEST(ReferencePrecision, AgreesWithCudaHostConversions) {
  std::mt19937_64 engine(5);
  std::uniform_real_distribution<double> mantissa(-2.0, 2.0);
  std::uniform_int_distribution<int> exponent(-30, 20);
  for (int n = 0; n < 100000; ++n) {
    double x = std::ldexp(mantissa(engine), exponent(engine));
    // Every fourth value is an exact bf16 / fp16 midpoint, where ties-to-even decides.
    if (n % 4 == 0) x = round_to(x, Precision::kBF16) + std::ldexp(1.0, std::ilogb(x) - 8);
    if (n % 4 == 1) x = round_to(x, Precision::kFP16) + std::ldexp(1.0, std::ilogb(x) - 11);
    const double bf16 = static_cast<double>(__bfloat162float(__double2bfloat16(x)));
    const double fp16 = static_cast<double>(__half2float(__double2half(x)));
    ASSERT_EQ(round_to(x, Precision::kBF16), bf16) << std::hexfloat << x;
    ASSERT_EQ(round_to(x, Precision::kFP16), fp16) << std::hexfloat << x;
  }
}

TEST(ReferencePrecision, DotAccumulatesInFp32AndRoundsOperands) {
  const double a[2] = {1.0, 0x1p-30};
  const double ones[2] = {1.0, 1.0};
  EXPECT_EQ(dot(a, ones, 2, Precision::kFP64), 1.0 + 0x1p-30);
  EXPECT_EQ(dot(a, ones, 2, Precision::kFP32), 1.0);
  const double b[1] = {1.0 + 0x1p-10};
  EXPECT_EQ(dot(b, ones, 1, Precision::kBF16), 1.0);  // the operand is rounded to bf16 first
  EXPECT_EQ(dot(b, ones, 1, Precision::kFP16), 1.0 + 0x1p-10);

  double y[2] = {1.0, 1.0};
  axpy(0x1p-30, ones, y, 2, Precision::kFP32);
  EXPECT_EQ(y[0], 1.0);
  axpy(0x1p-30, ones, y, 2, Precision::kFP64);
  EXPECT_EQ(y[1], 1.0 + 0x1p-30);
}

TEST(ReferencePrecision, RandomInputsAreDeterministicStandardNormalsInTheDtype) {
  const ProblemShape shape = make_shape(512, 4, 2, 2, 2, 32);
  const Inputs a = random_inputs(shape, 7, DType::kBF16);
  const Inputs b = random_inputs(shape, 7, DType::kBF16);
  const Inputs c = random_inputs(shape, 8, DType::kBF16);
  const Inputs h = random_inputs(shape, 7, DType::kFP16);
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.k_proxy, b.k_proxy);
  EXPECT_NE(a.q, c.q);
  EXPECT_NE(a.q, h.q);  // fp16 keeps more mantissa bits
  EXPECT_EQ(a.q.size(), static_cast<size_t>(512 * 4 * 32));
  EXPECT_EQ(a.k.size(), static_cast<size_t>(512 * 2 * 32));
  EXPECT_NO_THROW(validate(a));

  double sum = 0.0;
  double sum_sq = 0.0;
  for (double x : a.q) {
    ASSERT_EQ(round_to(x, Precision::kBF16), x);
    sum += x;
    sum_sq += x * x;
  }
  for (double x : h.v) ASSERT_EQ(round_to(x, Precision::kFP16), x);
  const double n = static_cast<double>(a.q.size());
  EXPECT_NEAR(sum / n, 0.0, 0.02);
  EXPECT_NEAR(sum_sq / n, 1.0, 0.03);
}

// The emulated forward must be as inaccurate as a 16-bit kernel (P and O rounded to 16 bits), not
// more, while LSE (kept in fp32) and the fp32 emulation stay close to fp64.
class EmulatedForwardError : public ::testing::TestWithParam<Mode> {};

TEST_P(EmulatedForwardError, MatchesTheDtype) {
  const ProblemShape shape = make_shape(384, 4, 2, 2, 2, 64);
  const Inputs in = random_inputs(shape, 21, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  const ForwardOutputs exact = forward(in, block_idx, GetParam(), Precision::kFP64);
  const ForwardOutputs fp32 = forward(in, block_idx, GetParam(), Precision::kFP32);
  const ForwardOutputs bf16 = forward(in, block_idx, GetParam(), Precision::kBF16);
  const ForwardOutputs fp16 = forward(in, block_idx, GetParam(), Precision::kFP16);

  EXPECT_LT(relative_error(fp32.out, exact.out), 1e-5);
  const double bf16_error = relative_error(bf16.out, exact.out);
  EXPECT_GT(bf16_error, 1e-4);
  EXPECT_LT(bf16_error, 1e-2);
  const double fp16_error = relative_error(fp16.out, exact.out);
  EXPECT_GT(fp16_error, 1e-5);
  EXPECT_LT(fp16_error, bf16_error);  // 3 more mantissa bits
  EXPECT_LT(relative_error(bf16.lse, exact.lse), 1e-5);
  EXPECT_LT(relative_error(bf16.proxy_lse, exact.proxy_lse), 1e-5);
  EXPECT_NEAR(bf16.kl, exact.kl, 1e-3 * std::fabs(exact.kl));
  for (double x : bf16.out) ASSERT_EQ(round_to(x, Precision::kBF16), x);  // O in the dtype
}

TEST_P(EmulatedForwardError, BackwardMatchesTheDtype) {
  const ProblemShape shape = make_shape(300, 4, 2, 2, 2, 32);
  const Inputs in = random_inputs(shape, 22, DType::kBF16);
  const std::vector<int32_t> block_idx = select(in, Precision::kFP64);
  std::vector<double> dout = random_inputs(shape, 23, DType::kBF16).q;
  const Gradients exact = backward(in, block_idx, dout, 1.0, GetParam(), Precision::kFP64);
  const Gradients fp32 = backward(in, block_idx, dout, 1.0, GetParam(), Precision::kFP32);
  const Gradients bf16 = backward(in, block_idx, dout, 1.0, GetParam(), Precision::kBF16);
  const std::vector<double> Gradients::*tensors[] = {&Gradients::dq, &Gradients::dk, &Gradients::dv,
                                                     &Gradients::dq_proxy, &Gradients::dk_proxy};
  for (auto tensor : tensors) {
    EXPECT_LT(relative_error(fp32.*tensor, exact.*tensor), 1e-5);
    const double error = relative_error(bf16.*tensor, exact.*tensor);
    EXPECT_GT(error, 1e-4);
    EXPECT_LT(error, 3e-2);
    for (double x : bf16.*tensor) ASSERT_EQ(round_to(x, Precision::kBF16), x);
  }
}

INSTANTIATE_TEST_SUITE_P(Reference, EmulatedForwardError,
                         ::testing::Values(Mode::kSparse, Mode::kWarmup),
                         [](const ::testing::TestParamInfo<Mode>& info) {
                           return info.param == Mode::kSparse ? "sparse" : "warmup";
                         });

}  // namespace
}  // namespace flashmsa::reference
