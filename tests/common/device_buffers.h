// Host/device helpers shared by the GPU tests and the benchmarks: RAII device buffers, uploads of
// reference inputs in the kernel dtype, poisoning of outputs, and FA3's error rule.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "flashmsa/params.h"

#define FLASHMSA_CUDA_CHECK(expr)                                                         \
  do {                                                                                    \
    cudaError_t error_ = (expr);                                                          \
    if (error_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,                  \
                   cudaGetErrorString(error_));                                           \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

namespace flashmsa::testing {

// A device allocation owned by the host object.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ > 0) FLASHMSA_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), count_ * sizeof(T)));
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(count_, other.count_);
    return *this;
  }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  // Fills every byte with `byte` (0xFF: NaN for bf16/fp16/fp32, -1 for int32).
  void poison(unsigned char byte = 0xFF) const {
    if (ptr_ != nullptr) FLASHMSA_CUDA_CHECK(cudaMemset(ptr_, byte, bytes()));
  }
  void upload(const std::vector<T>& host) const {
    FLASHMSA_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    FLASHMSA_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// 16-bit storage of the kernel dtype; values are converted with round-to-nearest-even.
inline uint16_t to_half_bits(double value, DType dtype) {
  if (dtype == DType::kBF16) {
    const __nv_bfloat16_raw raw = __float2bfloat16_rn(static_cast<float>(value));
    return raw.x;
  }
  const __half_raw raw = __float2half_rn(static_cast<float>(value));
  return raw.x;
}

inline double from_half_bits(uint16_t bits, DType dtype) {
  if (dtype == DType::kBF16) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return static_cast<double>(__bfloat162float(__nv_bfloat16(raw)));
  }
  __half_raw raw;
  raw.x = bits;
  return static_cast<double>(__half2float(__half(raw)));
}

inline DeviceBuffer<uint16_t> upload_half(const std::vector<double>& host, DType dtype) {
  std::vector<uint16_t> bits(host.size());
  for (size_t i = 0; i < host.size(); ++i) bits[i] = to_half_bits(host[i], dtype);
  DeviceBuffer<uint16_t> buffer(bits.size());
  buffer.upload(bits);
  return buffer;
}

inline std::vector<double> download_half(const DeviceBuffer<uint16_t>& buffer, DType dtype) {
  std::vector<uint16_t> bits = buffer.download();
  std::vector<double> host(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) host[i] = from_half_bits(bits[i], dtype);
  return host;
}

inline std::vector<double> download_float(const DeviceBuffer<float>& buffer) {
  std::vector<float> values = buffer.download();
  return std::vector<double>(values.begin(), values.end());
}

// FA3's rule on the entries where `mask` is true (all when empty):
//   max |kernel - fp64| <= 2 * max |same computation in the input dtype - fp64| + atol.
// NaN anywhere in the kernel's output fails.
struct ErrorReport {
  bool ok = true;
  double kernel_error = 0.0;  // max |kernel - fp64|
  double dtype_error = 0.0;   // max |dtype reference - fp64|
  double bound = 0.0;
  int64_t nan_count = 0;
  int64_t worst_index = -1;
  std::string describe(const std::string& name) const {
    char line[256];
    std::snprintf(line, sizeof(line),
                  "%s: kernel err %.3e, dtype-reference err %.3e, bound %.3e, NaN %lld, worst at %lld",
                  name.c_str(), kernel_error, dtype_error, bound, static_cast<long long>(nan_count),
                  static_cast<long long>(worst_index));
    return line;
  }
};

inline ErrorReport fa3_rule(const std::vector<double>& kernel, const std::vector<double>& reference,
                            const std::vector<double>& dtype_reference, double atol,
                            const std::vector<bool>& mask = {}) {
  ErrorReport report;
  for (size_t i = 0; i < kernel.size(); ++i) {
    if (!mask.empty() && !mask[i]) continue;
    if (std::isnan(reference[i])) continue;  // outside a reference row subset
    if (std::isnan(kernel[i])) {
      ++report.nan_count;
      continue;
    }
    const double error = std::fabs(kernel[i] - reference[i]);
    if (error > report.kernel_error) {
      report.kernel_error = error;
      report.worst_index = static_cast<int64_t>(i);
    }
    report.dtype_error = std::fmax(report.dtype_error, std::fabs(dtype_reference[i] - reference[i]));
  }
  report.bound = 2.0 * report.dtype_error + atol;
  report.ok = report.nan_count == 0 && report.kernel_error <= report.bound;
  return report;
}

}  // namespace flashmsa::testing
