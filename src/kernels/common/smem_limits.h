// The shared-memory budget of one thread block on sm_90 (H100/H200): the 227 KB a kernel may opt
// in to through cudaFuncAttributeMaxDynamicSharedMemorySize. Every stage sizes its tiles and stage
// counts against it.
#pragma once

#include <cstdint>

namespace flashmsa::kernels {

constexpr uint32_t kMaxBlockSharedBytes = 227 * 1024;

}  // namespace flashmsa::kernels
