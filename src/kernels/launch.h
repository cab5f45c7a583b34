// Host-side launchers of the CUDA kernels, one per stage. src/api/api.cpp calls them after
// validation; each is defined in its stage folder (src/kernels/<stage>/kernel.cuh + instantiations).
// Launchers assume valid params and report only CUDA errors.
#pragma once

#include <cstddef>

#include "flashmsa/api.h"

namespace flashmsa::kernels {

Status launch_select(const SelectParams& params, cudaStream_t stream);

}  // namespace flashmsa::kernels
