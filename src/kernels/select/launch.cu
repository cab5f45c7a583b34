// launch_select (src/kernels/launch.h): the one runtime -> template dispatch of the select stage.
//
// Supported combinations (validation has already refused everything else):
//   dtype   bf16, fp16        -> Element
//   top_k   1..16 | 17..64    -> TopKBucket<16> | TopKBucket<64> (config.h)
// The instantiations live in instantiations/*.cu, one per (dtype, bucket).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/launch.h"

namespace flashmsa::kernels {

namespace select {
template <typename Element, int kMaxTopKOfBucket>
Status run_select(const SelectParams& params, cudaStream_t stream);
}  // namespace select

namespace {

template <typename Element>
Status dispatch_top_k(const SelectParams& params, cudaStream_t stream) {
  if (params.shape.top_k <= 16) return select::run_select<Element, 16>(params, stream);
  return select::run_select<Element, 64>(params, stream);
}

}  // namespace

Status launch_select(const SelectParams& params, cudaStream_t stream) {
  switch (params.dtype) {
    case DType::kBF16:
      return dispatch_top_k<__nv_bfloat16>(params, stream);
    case DType::kFP16:
      return dispatch_top_k<__half>(params, stream);
  }
  return {StatusCode::kUnsupported, "dtype: select is built for bf16 and fp16 only"};
}

}  // namespace flashmsa::kernels
