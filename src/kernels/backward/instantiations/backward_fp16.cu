// The fp16 instantiation of the backward (kernel.cuh).
#include "kernels/backward/kernel.cuh"

namespace flashmsa::kernels::backward {
template Status run_backward<__half>(const BackwardParams&, cudaStream_t);
}  // namespace flashmsa::kernels::backward
