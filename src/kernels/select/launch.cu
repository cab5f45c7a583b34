// launch_select (src/kernels/launch.h): the one runtime -> template dispatch of the select stage.
// The instantiations live in instantiations/*.cu, one per dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/launch.h"

namespace flashmsa::kernels {

namespace select {
template <typename T>
Status run_select(const SelectParams& params, cudaStream_t stream);
}  // namespace select

Status launch_select(const SelectParams& params, cudaStream_t stream) {
  switch (params.dtype) {
    case DType::kBF16:
      return select::run_select<__nv_bfloat16>(params, stream);
    case DType::kFP16:
      return select::run_select<__half>(params, stream);
  }
  return {StatusCode::kUnsupported, "dtype: select is built for bf16 and fp16 only"};
}

}  // namespace flashmsa::kernels
