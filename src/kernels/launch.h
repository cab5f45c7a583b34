// Host-side launchers of the CUDA kernels, one per stage. src/api/api.cpp calls them after
// validation; each is defined in its stage folder (src/kernels/<stage>/kernel.cuh + instantiations).
// Launchers assume valid params and report only CUDA errors.
#pragma once

#include <cstddef>

#include "flashmsa/api.h"

namespace flashmsa::kernels {

Status launch_select(const SelectParams& params, cudaStream_t stream);

// Builds the reverse index and work tiles of kernels/schedule/config.h in params.workspace.
Status launch_schedule(const ScheduleParams& params, cudaStream_t stream);

// Sparse-mode forward over the tiles of a schedule built for the same shape and block_idx.
Status launch_forward(const ForwardParams& params, cudaStream_t stream);

// Sparse backward (src/kernels/backward): kUnsupported for warmup mode and for H/Hp > 16.
Status launch_backward(const BackwardParams& params, cudaStream_t stream);

// Warmup mode (src/kernels/warmup): dense causal forward with the proxy LSE (kUnsupported for
// H/Hp > 128), and its backward with the KL gradient and value (kUnsupported for H/Hp > 64).
Status launch_warmup_forward(const ForwardParams& params, cudaStream_t stream);
Status launch_warmup_backward(const BackwardParams& params, cudaStream_t stream);

}  // namespace flashmsa::kernels
