// The bf16 instantiation of the warmup forward (forward_kernel.cuh).
#include "kernels/warmup/forward_kernel.cuh"

namespace flashmsa::kernels::warmup {
template Status run_forward<__nv_bfloat16>(const ForwardParams&, cudaStream_t);
}  // namespace flashmsa::kernels::warmup
