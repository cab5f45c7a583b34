// The fp16 instantiation of the warmup backward (backward_kernel.cuh).
#include "kernels/warmup/backward_kernel.cuh"

namespace flashmsa::kernels::warmup {
template Status run_backward<__half>(const BackwardParams&, cudaStream_t);
}  // namespace flashmsa::kernels::warmup
