// Precision emulation of the reference: rounding to bf16 / fp16 / fp32 and the fp32-accumulating
// inner products that stand in for a kernel's tensor-core matmuls.
//
// The ops in select.cpp and attention.cpp call only these functions for arithmetic that a kernel
// does in reduced precision, so Precision::kFP64 is plain double arithmetic and the other
// precisions differ from it exactly where a kernel would.
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "reference/reference.h"

namespace flashmsa::reference {
namespace {

// A binary floating-point format: `fraction_bits` stored mantissa bits, the smallest normal number,
// the spacing of its subnormals and its largest finite number.
struct Format {
  int fraction_bits;
  double smallest_normal;
  double subnormal_quantum;
  double max_finite;
};
constexpr Format kBF16Format{7, 0x1p-126, 0x1p-133, 0x1.fep127};
constexpr Format kFP16Format{10, 0x1p-14, 0x1p-24, 0x1.ffcp15};  // max 65504

uint64_t bits_of(double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

double from_bits(uint64_t bits) {
  double x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// Round to nearest, ties to even, directly from double (no detour through float, which could round
// twice).
double round_to_format(double x, Format format) {
  if (!std::isfinite(x) || x == 0.0) return x;

  if (std::fabs(x) < format.smallest_normal) {
    // Subnormal range: values are multiples of a fixed quantum. x / quantum is exact (a
    // power-of-two scaling inside double's range) and nearbyint rounds half to even in the default
    // mode.
    return std::nearbyint(x / format.subnormal_quantum) * format.subnormal_quantum;
  }

  // Normal range: drop the low fraction bits of the double. Adding (half - 1 + lowest kept bit)
  // rounds half to even; a carry out of the fraction correctly bumps the exponent.
  const int dropped = 52 - format.fraction_bits;
  const uint64_t kept_lsb = (bits_of(x) >> dropped) & 1u;
  const uint64_t half_minus_one = (uint64_t{1} << (dropped - 1)) - 1;
  const uint64_t mask = ~((uint64_t{1} << dropped) - 1);
  const double rounded = from_bits((bits_of(x) + half_minus_one + kept_lsb) & mask);

  if (std::fabs(rounded) > format.max_finite) return std::copysign(INFINITY, x);
  return rounded;
}

}  // namespace

double round_to(double x, Precision precision) {
  switch (precision) {
    case Precision::kFP64: return x;
    case Precision::kFP32: return static_cast<double>(static_cast<float>(x));
    case Precision::kBF16: return round_to_format(x, kBF16Format);
    case Precision::kFP16: return round_to_format(x, kFP16Format);
  }
  throw std::invalid_argument("round_to: unknown precision");
}

Precision precision_of(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return Precision::kBF16;
    case DType::kFP16: return Precision::kFP16;
  }
  throw std::invalid_argument("precision_of: unknown dtype");
}

double accumulate_round(double x, Precision precision) {
  return precision == Precision::kFP64 ? x : static_cast<double>(static_cast<float>(x));
}

double dot(const double* a, const double* b, int n, Precision precision) {
  if (precision == Precision::kFP64) {
    // NOTES: four partial sums let the CPU overlap the additions (the reference spends most of its
    // time here); in fp64 the summation order is immaterial at the accuracy the tests ask for.
    double partial[4] = {0.0, 0.0, 0.0, 0.0};
    int d = 0;
    for (; d + 4 <= n; d += 4) {
      for (int lane = 0; lane < 4; ++lane) partial[lane] += a[d + lane] * b[d + lane];
    }
    for (; d < n; ++d) partial[0] += a[d] * b[d];
    return (partial[0] + partial[1]) + (partial[2] + partial[3]);
  }
  float sum = 0.f;
  for (int d = 0; d < n; ++d) {
    sum += static_cast<float>(round_to(a[d], precision)) *
           static_cast<float>(round_to(b[d], precision));
  }
  return sum;
}

void axpy(double alpha, const double* x, double* y, int n, Precision precision) {
  if (precision == Precision::kFP64) {
    for (int d = 0; d < n; ++d) y[d] += alpha * x[d];
    return;
  }
  const float a = static_cast<float>(round_to(alpha, precision));
  for (int d = 0; d < n; ++d) {
    const float product = a * static_cast<float>(round_to(x[d], precision));
    y[d] = static_cast<float>(static_cast<float>(y[d]) + product);
  }
}

}  // namespace flashmsa::reference
