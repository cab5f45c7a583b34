// The sparse forward for fp16 inputs (one instantiation per file; see forward/launch.cu).
#include "kernels/forward/launcher.cuh"

namespace flashmsa::kernels::forward {

template Status run_forward<__half>(const ForwardParams& params, cudaStream_t stream);

}  // namespace flashmsa::kernels::forward
