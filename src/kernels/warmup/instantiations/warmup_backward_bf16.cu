// The bf16 instantiation of the warmup backward (backward_kernel.cuh).
#include "kernels/warmup/backward_kernel.cuh"

namespace flashmsa::kernels::warmup {
template Status run_backward<__nv_bfloat16>(const BackwardParams&, cudaStream_t);
}  // namespace flashmsa::kernels::warmup
