// launch_forward (src/kernels/launch.h): the one runtime -> template dispatch of the sparse
// forward. The instantiations live in instantiations/*.cu, one per dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/launch.h"

namespace flashmsa::kernels {

namespace forward {
template <typename Element>
Status run_forward(const ForwardParams& params, cudaStream_t stream);
}  // namespace forward

Status launch_forward(const ForwardParams& params, cudaStream_t stream) {
  switch (params.dtype) {
    case DType::kBF16:
      return forward::run_forward<__nv_bfloat16>(params, stream);
    case DType::kFP16:
      return forward::run_forward<__half>(params, stream);
  }
  return {StatusCode::kUnsupported, "dtype: the forward is built for bf16 and fp16 only"};
}

}  // namespace flashmsa::kernels
