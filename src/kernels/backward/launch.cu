// launch_backward (src/kernels/launch.h): the one runtime -> template dispatch of the backward.
// The instantiations live in instantiations/*.cu, one per dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/launch.h"

namespace flashmsa::kernels {

namespace backward {
template <typename T>
Status run_backward(const BackwardParams& params, cudaStream_t stream);
}  // namespace backward

Status launch_backward(const BackwardParams& params, cudaStream_t stream) {
  switch (params.fwd.dtype) {
    case DType::kBF16:
      return backward::run_backward<__nv_bfloat16>(params, stream);
    case DType::kFP16:
      return backward::run_backward<__half>(params, stream);
  }
  return {StatusCode::kUnsupported, "fwd.dtype: the backward is built for bf16 and fp16 only"};
}

}  // namespace flashmsa::kernels
