// A typed [b, s, heads, dim] view of a TensorRef (params.h) with element strides, as every kernel
// that gathers rows by (batch, position, head) addresses its tensors.
//
// Layer 1 of the device utilities, next to device_math.h.
#pragma once

#include <cstdint>

#include "flashmsa/params.h"

namespace flashmsa::kernels {

template <typename T>
struct Strided {
  T* ptr;
  int64_t batch_stride;
  int64_t seq_stride;
  int64_t head_stride;
  __device__ __forceinline__ T* row(int64_t b, int64_t s, int64_t head) const {
    return ptr + b * batch_stride + s * seq_stride + head * head_stride;
  }
};

template <typename T>
__host__ __device__ __forceinline__ Strided<T> strided(const TensorRef& ref) {
  return {static_cast<T*>(ref.ptr), ref.batch_stride, ref.seq_stride, ref.head_stride};
}

}  // namespace flashmsa::kernels
