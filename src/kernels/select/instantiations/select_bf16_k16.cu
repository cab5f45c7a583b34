// Select kernel instantiation: bf16 inputs, top-K bucket K <= 16 (kernel.cuh, config.h).
#include "kernels/select/kernel.cuh"

namespace flashmsa::kernels::select {
template Status run_select<__nv_bfloat16, 16>(const SelectParams&, cudaStream_t);
}  // namespace flashmsa::kernels::select
