// launch_warmup_forward / launch_warmup_backward (src/kernels/launch.h): the one runtime -> template
// dispatch of warmup mode. The instantiations live in instantiations/*.cu, one per (pass, dtype).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/launch.h"

namespace flashmsa::kernels {

namespace warmup {
template <typename T>
Status run_forward(const ForwardParams& params, cudaStream_t stream);
template <typename T>
Status run_backward(const BackwardParams& params, cudaStream_t stream);
}  // namespace warmup

Status launch_warmup_forward(const ForwardParams& params, cudaStream_t stream) {
  switch (params.dtype) {
    case DType::kBF16:
      return warmup::run_forward<__nv_bfloat16>(params, stream);
    case DType::kFP16:
      return warmup::run_forward<__half>(params, stream);
  }
  return {StatusCode::kUnsupported, "dtype: the warmup forward is built for bf16 and fp16 only"};
}

Status launch_warmup_backward(const BackwardParams& params, cudaStream_t stream) {
  switch (params.fwd.dtype) {
    case DType::kBF16:
      return warmup::run_backward<__nv_bfloat16>(params, stream);
    case DType::kFP16:
      return warmup::run_backward<__half>(params, stream);
  }
  return {StatusCode::kUnsupported, "fwd.dtype: the warmup backward is built for bf16 and fp16 only"};
}

}  // namespace flashmsa::kernels
