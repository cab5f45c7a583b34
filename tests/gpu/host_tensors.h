// Host-side helpers of the GPU tests that check whole training steps: [b, s, heads, dim] tensors
// uploaded in either layout ([b, s, h, d] or the seed's [b, h, s, d]) and read back into the
// reference's contiguous order, and the host threads that run the fp64 reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <future>
#include <thread>
#include <vector>

#include "common/cases.h"
#include "common/device_buffers.h"
#include "reference/reference.h"

namespace flashmsa::host_tensors {

using testing::DeviceBuffer;

// Runs `task(part, parts)` for part = 0 … parts−1 on host threads.
inline void parallel_for(int parts, const std::function<void(int, int)>& task) {
  std::vector<std::future<void>> futures;
  for (int part = 0; part < parts; ++part) futures.push_back(std::async(std::launch::async, task, part, parts));
  for (auto& future : futures) future.get();
}

inline int host_threads() { return int(std::max(2u, std::min(16u, std::thread::hardware_concurrency()))); }

// Copies the non-NaN entries of `part` into `whole` (sized and NaN-filled on first use).
inline void merge(std::vector<double>& whole, const std::vector<double>& part) {
  if (whole.empty()) whole.assign(part.size(), std::nan(""));
  for (size_t e = 0; e < part.size(); ++e) {
    if (!std::isnan(part[e])) whole[e] = part[e];
  }
}

// A [b, s, heads, dim] tensor on the device in one of the two layouts.
struct DeviceTensor {
  DeviceBuffer<uint16_t> buffer;
  TensorRef ref;
};

inline int64_t offset_of(const ProblemShape& s, bool bhsd, int64_t b, int64_t i, int h, int heads, int dim) {
  return bhsd ? ((b * heads + h) * s.seqlen + i) * dim : ((b * s.seqlen + i) * heads + h) * dim;
}

inline DeviceTensor upload_tensor(const std::vector<double>& host, const ProblemShape& s, int heads, int dim,
                                  DType dtype, bool bhsd) {
  std::vector<uint16_t> bits(host.size());
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i = 0; i < s.seqlen; ++i) {
      for (int h = 0; h < heads; ++h) {
        const int64_t from = reference::offset_bshd(s, b, i, h, heads, dim);
        const int64_t to = offset_of(s, bhsd, b, i, h, heads, dim);
        for (int d = 0; d < dim; ++d) bits[to + d] = testing::to_half_bits(host[from + d], dtype);
      }
    }
  }
  DeviceTensor tensor{DeviceBuffer<uint16_t>(bits.size()), {}};
  tensor.buffer.upload(bits);
  tensor.ref = bhsd ? cases::bhsd(tensor.buffer.get(), s, heads, dim) : cases::bshd(tensor.buffer.get(), s, heads, dim);
  return tensor;
}

// An output tensor, poisoned with NaN.
inline DeviceTensor output_tensor(const ProblemShape& s, int heads, int dim, bool bhsd) {
  DeviceTensor tensor{DeviceBuffer<uint16_t>(size_t(s.batch * s.seqlen * heads * dim)), {}};
  tensor.buffer.poison();
  tensor.ref = bhsd ? cases::bhsd(tensor.buffer.get(), s, heads, dim) : cases::bshd(tensor.buffer.get(), s, heads, dim);
  return tensor;
}

inline std::vector<double> download_tensor(const DeviceTensor& tensor, const ProblemShape& s, int heads, int dim,
                                           DType dtype, bool bhsd) {
  const std::vector<uint16_t> bits = tensor.buffer.download();
  std::vector<double> host(bits.size());
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t i = 0; i < s.seqlen; ++i) {
      for (int h = 0; h < heads; ++h) {
        const int64_t to = reference::offset_bshd(s, b, i, h, heads, dim);
        const int64_t from = offset_of(s, bhsd, b, i, h, heads, dim);
        for (int d = 0; d < dim; ++d) host[to + d] = testing::from_half_bits(bits[from + d], dtype);
      }
    }
  }
  return host;
}

inline DeviceBuffer<float> upload_floats(const std::vector<double>& host) {
  std::vector<float> values(host.begin(), host.end());
  DeviceBuffer<float> buffer(values.size());
  buffer.upload(values);
  return buffer;
}

inline double max_abs(const std::vector<double>& values) {
  double m = 0.0;
  for (double x : values) {
    if (!std::isnan(x)) m = std::max(m, std::fabs(x));
  }
  return m;
}

inline int64_t count_nan(const std::vector<double>& values) {
  int64_t n = 0;
  for (double x : values) n += std::isnan(x) ? 1 : 0;
  return n;
}

}  // namespace flashmsa::host_tensors
