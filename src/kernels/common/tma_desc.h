// Host side of TMA: builds the CUtensorMap of a strided [batch, seq, heads, dim] activation
// (flashmsa::TensorRef) for the device loads of ptx/tma.h.
//
// The driver entry point is looked up through the runtime (cudaGetDriverEntryPointByVersion), so
// the library links only cudart. Maps are rank 4, dims ordered (dim, seq, heads, batch) innermost
// first, with the TensorRef's strides; both [B, S, H, D] and [B, H, S, D] storage are expressed
// this way. Out-of-range rows (seq >= S) of a box read as zeros.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "flashmsa/api.h"

namespace flashmsa::kernels {

struct TensorMapBox {
  uint32_t dim;    // elements along dim (64 for the 128-byte swizzle with 16-bit elements)
  uint32_t seq;    // rows along seq
  uint32_t heads;  // heads
};

// Encodes `ref` viewed as [batch, seq, heads, dim] of 16-bit elements with the 128-byte swizzle.
inline Status make_tensor_map_sw128(CUtensorMap* map, const TensorRef& ref, DType dtype,
                                    int64_t batch, int64_t seqlen, int64_t heads, int64_t dim,
                                    TensorMapBox box) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                         cudaEnableDefault, &query) != cudaSuccess ||
        query != cudaDriverEntryPointSuccess) {
      function = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  if (encode == nullptr) {
    return {StatusCode::kCudaError, "cuTensorMapEncodeTiled: driver entry point not found"};
  }
  constexpr int64_t kElementBytes = 2;
  const cuuint64_t sizes[4] = {cuuint64_t(dim), cuuint64_t(seqlen), cuuint64_t(heads),
                               cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(ref.seq_stride * kElementBytes),
                                 cuuint64_t(ref.head_stride * kElementBytes),
                                 cuuint64_t(ref.batch_stride * kElementBytes)};
  const cuuint32_t box_sizes[4] = {box.dim, box.seq, box.heads, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult result = encode(
      map, dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      4, ref.ptr, sizes, strides, box_sizes, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    return {StatusCode::kCudaError,
            "cuTensorMapEncodeTiled failed (code " + std::to_string(int(result)) + ")"};
  }
  return Status::Ok();
}

}  // namespace flashmsa::kernels
