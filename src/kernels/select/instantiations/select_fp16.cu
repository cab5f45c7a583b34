// The fp16 instantiation of the select kernel (kernel.cuh).
#include "kernels/select/kernel.cuh"

namespace flashmsa::kernels::select {
template Status run_select<__half>(const SelectParams&, cudaStream_t);
}  // namespace flashmsa::kernels::select
