// The bf16 instantiation of the backward (kernel.cuh).
#include "kernels/backward/kernel.cuh"

namespace flashmsa::kernels::backward {
template Status run_backward<__nv_bfloat16>(const BackwardParams&, cudaStream_t);
}  // namespace flashmsa::kernels::backward
