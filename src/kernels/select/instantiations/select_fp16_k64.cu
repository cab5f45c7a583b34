// Select kernel instantiation: fp16 inputs, top-K bucket K <= 64 (kernel.cuh, config.h).
#include "kernels/select/kernel.cuh"

namespace flashmsa::kernels::select {
template Status run_select<__half, 64>(const SelectParams&, cudaStream_t);
}  // namespace flashmsa::kernels::select
